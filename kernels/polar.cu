// PolarQuant / TurboQuant on the GPU: quantize + pack, dequantize, and fused decode attention.
//
// The math and the packed layout are those of arraykv.quant.polar / arraykv.caches.polar:
//   rotation  y = M x with M = H diag(signs) / sqrt(D) (Walsh-Hadamard, power-of-two D) or a
//             dense orthogonal matrix (row-major, y_i = sum_j M[i][j] x_j);
//   encode    n = |x|, u = x / n, y = M u, code_i = #{thresholds < y_i},
//             gain = n <y, c> / <c, c> with c = centroids[code], stored as float16;
//   decode    x = M^T (gain * centroids[code]);
//   packing   code i of a row at stream bits [i*BITS, (i+1)*BITS), LSB first (bitpack.cu).
// Centering, exact outlier channels and the float16 recent-token window are handled by the
// caller in array-API code; decode attention takes queries already rotated and scaled
// (arraykv.attention.polar_fused.prepare_queries).

#include <cstdint>
#include <cuda_fp16.h>

namespace {

template <typename T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Sum over the block of one float per thread; `scratch` holds one float per warp.
__device__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < nwarps; ++w) total += scratch[w];
    return total;
}

// In-place Walsh-Hadamard butterflies on D floats in shared memory, one element per thread.
template <int D>
__device__ void fwht_shared(float* s) {
    const int i = threadIdx.x;
    for (int h = 1; h < D; h <<= 1) {
        __syncthreads();
        const float a = (i & h) ? s[i - h] : s[i];
        const float b = (i & h) ? s[i] : s[i + h];
        __syncthreads();
        s[i] = (i & h) ? (a - b) : (a + b);
    }
    __syncthreads();
}

// Code `i` of a packed row (bits [i*BITS, (i+1)*BITS) of the little-endian stream).
template <int BITS>
__device__ __forceinline__ int extract_code(const uint8_t* row, int i, int row_bytes) {
    const int bit = i * BITS;
    const int byte = bit >> 3;
    unsigned w = row[byte];
    if (byte + 1 < row_bytes) w |= static_cast<unsigned>(row[byte + 1]) << 8;
    return static_cast<int>((w >> (bit & 7)) & ((1u << BITS) - 1u));
}

}  // namespace

// One block of D threads per row: rows of `x` (rows, D) -> packed codes (rows, row_bytes) and
// float16 gains (rows). HADAMARD selects the fast transform (signs used) or the dense matrix.
template <typename T, int D, int BITS, bool HADAMARD>
__global__ void polar_quantize(const T* __restrict__ x, long long rows, const float* __restrict__ signs,
                               const float* __restrict__ matrix, const float* __restrict__ thresholds,
                               const float* __restrict__ centroids, uint8_t* __restrict__ codes,
                               __half* __restrict__ gains) {
    static_assert(D % 32 == 0 && D <= 1024, "D must be a multiple of 32, at most 1024");
    __shared__ float s[D];
    __shared__ uint8_t c[D];
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int i = threadIdx.x;
    const float v = to_float(x[row * D + i]);
    const float norm = sqrtf(block_sum(v * v, scratch));
    const float u = norm > 0.f ? v / norm : 0.f;
    float y;
    if (HADAMARD) {
        s[i] = u * signs[i];
        fwht_shared<D>(s);
        y = s[i] * rsqrtf(static_cast<float>(D));
    } else {
        s[i] = u;
        __syncthreads();
        float acc = 0.f;
        for (int j = 0; j < D; ++j) acc += matrix[i * D + j] * s[j];
        y = acc;
    }
    // code = number of thresholds strictly below y (searchsorted, side 'left')
    int lo = 0, hi = (1 << BITS) - 1;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (thresholds[mid] < y) lo = mid + 1; else hi = mid;
    }
    const float ch = centroids[lo];
    c[i] = static_cast<uint8_t>(lo);
    const float yc = block_sum(y * ch, scratch);
    const float cc = block_sum(ch * ch, scratch);
    if (i == 0) gains[row] = __float2half_rn(cc > 0.f ? norm * yc / cc : 0.f);
    __syncthreads();
    if (i < D / 8) {  // pack a group of eight codes into BITS bytes
        unsigned long long word = 0;
        for (int k = 0; k < 8; ++k) word |= static_cast<unsigned long long>(c[i * 8 + k]) << (k * BITS);
        uint8_t* dst = codes + row * (D * BITS / 8) + i * BITS;
        for (int b = 0; b < BITS; ++b) dst[b] = static_cast<uint8_t>(word >> (8 * b));
    }
}

// One block of D threads per row: packed codes + gains -> x = M^T (gain * centroids[code]).
template <typename T, int D, int BITS, bool HADAMARD>
__global__ void polar_dequantize(const uint8_t* __restrict__ codes, const __half* __restrict__ gains,
                                 long long rows, const float* __restrict__ signs, const float* __restrict__ matrix,
                                 const float* __restrict__ centroids, T* __restrict__ out) {
    __shared__ float s[D];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int i = threadIdx.x;
    constexpr int row_bytes = D * BITS / 8;
    const float y = centroids[extract_code<BITS>(codes + row * row_bytes, i, row_bytes)] * __half2float(gains[row]);
    float xv;
    if (HADAMARD) {
        s[i] = y;
        fwht_shared<D>(s);
        xv = s[i] * signs[i] * rsqrtf(static_cast<float>(D));
    } else {
        s[i] = y;
        __syncthreads();
        float acc = 0.f;
        for (int j = 0; j < D; ++j) acc += matrix[j * D + i] * s[j];
        xv = acc;
    }
    out[row * D + i] = from_float<T>(xv);
}

// Split-K decode attention from packed codes (flash decoding).
//
// Grid (splits, kv_heads, batch); block WARPS * 32 threads. Every warp takes tokens of the
// split round-robin; lane `l` owns channels [l*C, (l+1)*C), C = D / 32. A token's codes are
// decoded once and scored against all G <= GMAX query heads of its KV head; each warp keeps
// an online softmax per query head with its value accumulator in registers (rotated domain),
// and the warps merge through shared memory. Outputs per (b, h, split, g): running max m,
// sum l of exp(logit - m), and acc = sum exp(logit - m) * gain_v * centroids_v[codes] (D).
//
// Arrays of the cache are views of buffers of capacity `cap` tokens:
//   k_codes/v_codes (B, H, cap, D*KB/8 | D*VB/8) uint8, k_gain/v_gain (B, H, cap) half,
//   k_out (B, H, cap, nout) half, k_qjl (B, H, cap, qjl_bytes) uint8, k_qjl_norm (B, H, cap) half.
// Queries: qr (B, H, G, D), qconst (B, H, G), qout (B, H, G, nout), sq (B, H, G, m_rows), float32.
template <int D, int KB, int VB, int GMAX, bool QJL, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
polar_decode_attn(const float* __restrict__ qr, const float* __restrict__ qconst, const float* __restrict__ qout,
                  const float* __restrict__ sq, const uint8_t* __restrict__ k_codes, const __half* __restrict__ k_gain,
                  const float* __restrict__ k_cent, const uint8_t* __restrict__ v_codes,
                  const __half* __restrict__ v_gain, const float* __restrict__ v_cent,
                  const __half* __restrict__ k_out, const uint8_t* __restrict__ k_qjl,
                  const __half* __restrict__ k_qjl_norm, int n_tokens, long long cap, int G, int nout,
                  int m_rows, int splits, float* __restrict__ out_m, float* __restrict__ out_l,
                  float* __restrict__ out_acc) {
    static_assert(D % 32 == 0 && D <= 256, "D must be a multiple of 32, at most 256");
    constexpr int C = D / 32;
    constexpr int KBYTES = D * KB / 8, VBYTES = D * VB / 8;
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int H = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long bh = static_cast<long long>(b) * H + h;
    const int per = (n_tokens + splits - 1) / splits;
    const int t_lo = split * per, t_hi = min(n_tokens, t_lo + per);
    const int qjl_bytes = (m_rows + 7) / 8;

    float q[GMAX][C], acc[GMAX][C], m[GMAX], l[GMAX];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            q[g][c] = g < G ? qr[((bh * G) + g) * D + lane * C + c] : 0.f;
            acc[g][c] = 0.f;
        }
    }
    for (int t = t_lo + warp; t < t_hi; t += WARPS) {
        const long long tok = bh * cap + t;
        const uint8_t* krow = k_codes + tok * KBYTES;
        float kv[C];
#pragma unroll
        for (int c = 0; c < C; ++c) kv[c] = k_cent[extract_code<KB>(krow, lane * C + c, KBYTES)];
        const float kg = __half2float(k_gain[tok]);
        const float qn = QJL ? __half2float(k_qjl_norm[tok]) : 0.f;
        float s_tok[GMAX];
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g >= G) { s_tok[g] = -INFINITY; continue; }
            const long long qg = bh * G + g;
            float part = 0.f;
#pragma unroll
            for (int c = 0; c < C; ++c) part += q[g][c] * kv[c];
            part *= kg;
            for (int j = lane; j < nout; j += 32) part += qout[qg * nout + j] * __half2float(k_out[tok * nout + j]);
            if (QJL) {
                float sp = 0.f;
                for (int j = lane; j < m_rows; j += 32) {
                    const int bit = (k_qjl[tok * qjl_bytes + (j >> 3)] >> (j & 7)) & 1;
                    const float v = sq[qg * m_rows + j];
                    sp += bit ? v : -v;
                }
                part += sp * qn;
            }
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            s_tok[g] = part + qconst[qg];
        }
        const uint8_t* vrow = v_codes + tok * VBYTES;
        const float vg = __half2float(v_gain[tok]);
        float vv[C];
#pragma unroll
        for (int c = 0; c < C; ++c) vv[c] = v_cent[extract_code<VB>(vrow, lane * C + c, VBYTES)] * vg;
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g >= G) continue;
            const float mn = fmaxf(m[g], s_tok[g]);
            const float corr = __expf(m[g] - mn);  // exp(-inf) = 0 on the first token
            const float p = __expf(s_tok[g] - mn);
            l[g] = l[g] * corr + p;
#pragma unroll
            for (int c = 0; c < C; ++c) acc[g][c] = acc[g][c] * corr + p * vv[c];
            m[g] = mn;
        }
    }
    // merge the warps of this block
    __shared__ float sm_m[WARPS][GMAX], sm_l[WARPS][GMAX];
    __shared__ float sm_acc[WARPS][GMAX][D];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
#pragma unroll
        for (int c = 0; c < C; ++c) sm_acc[warp][g][lane * C + c] = acc[g][c];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D, j = idx % D;
        float mt = -INFINITY;
        for (int w = 0; w < WARPS; ++w) mt = fmaxf(mt, sm_m[w][g]);
        float lt = 0.f, at = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            const float f = sm_m[w][g] == -INFINITY ? 0.f : __expf(sm_m[w][g] - mt);
            lt += sm_l[w][g] * f;
            at += sm_acc[w][g][j] * f;
        }
        const long long o = (bh * splits + split) * G + g;
        out_acc[o * D + j] = at;
        if (j == 0) { out_m[o] = mt; out_l[o] = lt; }
    }
}

// Explicit instantiations so ahead-of-time compilation (nvcc --ptx) checks every body; at run
// time the loader instantiates what it needs by name expression.
template __global__ void polar_quantize<float, 128, 4, true>(const float*, long long, const float*, const float*,
                                                             const float*, const float*, uint8_t*, __half*);
template __global__ void polar_quantize<__half, 64, 3, true>(const __half*, long long, const float*, const float*,
                                                             const float*, const float*, uint8_t*, __half*);
template __global__ void polar_quantize<float, 96, 2, false>(const float*, long long, const float*, const float*,
                                                             const float*, const float*, uint8_t*, __half*);
template __global__ void polar_dequantize<float, 128, 4, true>(const uint8_t*, const __half*, long long, const float*,
                                                               const float*, const float*, float*);
template __global__ void polar_dequantize<__half, 256, 3, true>(const uint8_t*, const __half*, long long, const float*,
                                                                const float*, const float*, __half*);
template __global__ void polar_dequantize<float, 96, 2, false>(const uint8_t*, const __half*, long long, const float*,
                                                               const float*, const float*, float*);
#define ARRAYKV_ATTN(D, KB, VB, GMAX, QJL)                                                                          \
    template __global__ void polar_decode_attn<D, KB, VB, GMAX, QJL, 4>(                                           \
        const float*, const float*, const float*, const float*, const uint8_t*, const __half*, const float*,       \
        const uint8_t*, const __half*, const float*, const __half*, const uint8_t*, const __half*, int, long long, \
        int, int, int, int, float*, float*, float*);
ARRAYKV_ATTN(128, 4, 4, 4, false)
ARRAYKV_ATTN(128, 3, 3, 8, false)
ARRAYKV_ATTN(64, 2, 2, 1, false)
ARRAYKV_ATTN(256, 2, 3, 8, true)
#undef ARRAYKV_ATTN
