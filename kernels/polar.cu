// PolarQuant / TurboQuant on the GPU: quantize + pack, dequantize, and fused decode attention.
//
// The math and the packed layout are those of arraykv.quant.polar / arraykv.caches.polar:
//   rotation  y = M x with M = H diag(signs) / sqrt(D) (Walsh-Hadamard, power-of-two D) or a
//             dense orthogonal matrix (row-major, y_i = sum_j M[i][j] x_j);
//   encode    n = |x|, u = x / n, y = M u, code_i = #{thresholds < y_i},
//             gain = n <y, c> / <c, c> with c = centroids[code], stored as float16;
//   decode    x = M^T (gain * centroids[code]);
//   packing   code i of a row at stream bits [i*BITS, (i+1)*BITS), LSB first (bitpack.cu).
//
// Decode attention is three launches (arraykv/backends/_cuda_polar.py):
//   polar_prepare_queries  q -> scale * M (q / s) with outlier channels zeroed, the outlier
//                          part, scale * q . k_mean, and the QJL sketch S q (one block per head);
//   polar_decode_attn      split-K flash decoding over the packed tokens (tensor cores);
//   polar_merge_window     merge of the splits, back from the rotated domain, + l * v_mean,
//                          the float16 window tokens, normalisation, output dtype.
//
// No header is included: NVRTC (cupy.RawModule) compiles this file without the CUDA include
// folder, so the fixed-width types and the float16 conversions (PTX cvt) are defined here.
// float16 data is passed as its 16-bit pattern (unsigned short).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

namespace {

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// Two floats -> one register holding two float16 (lo in bits 0..15, hi in bits 16..31).
__device__ __forceinline__ u32 f2h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <typename T> struct Io;
template <> struct Io<float> {
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
template <> struct Io<u16> {  // float16 bits
    static __device__ __forceinline__ float load(u16 v) { return h2f(v); }
    static __device__ __forceinline__ u16 store(float v) { return f2h(v); }
};

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
__device__ __forceinline__ int extract_code(const u8* row, int i, int row_bytes) {
    const int bit = i * BITS;
    const int byte = bit >> 3;
    unsigned w = row[byte];
    if (byte + 1 < row_bytes) w |= static_cast<unsigned>(row[byte + 1]) << 8;
    return static_cast<int>((w >> (bit & 7)) & ((1u << BITS) - 1u));
}

// ---- packed-code access for the attention kernel --------------------------------------------
struct alignas(16) V4 { u32 x, y, z, w; };
struct alignas(8) V2 { u32 x, y; };

// Load CH_BITS consecutive bits of a packed row, chunk `idx` (bits [idx*CH_BITS, ...)), into
// w[] with the chunk's first bit at bit 0 of w[0]. Rows are ROW_BYTES long and 4-byte aligned,
// so a byte-aligned chunk is aligned to the largest power of two dividing its size (up to 16
// bytes), which sets the width of the loads.
template <int CH_BITS, int ROW_BYTES>
__device__ __forceinline__ void load_chunk(u32 (&w)[(CH_BITS + 31) / 32], const u8* __restrict__ row, int idx) {
    constexpr int NW = (CH_BITS + 31) / 32;
    if constexpr (CH_BITS % 8 == 0) {
        constexpr int CHB = CH_BITS / 8;
        const u8* p = row + idx * CHB;
        if constexpr (CHB % 16 == 0) {
#pragma unroll
            for (int i = 0; i < CHB / 16; ++i) {
                const V4 v = reinterpret_cast<const V4*>(p)[i];
                w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
            }
        } else if constexpr (CHB % 8 == 0) {
#pragma unroll
            for (int i = 0; i < CHB / 8; ++i) {
                const V2 v = reinterpret_cast<const V2*>(p)[i];
                w[2 * i] = v.x; w[2 * i + 1] = v.y;
            }
        } else if constexpr (CHB % 4 == 0) {
#pragma unroll
            for (int i = 0; i < CHB / 4; ++i) w[i] = reinterpret_cast<const u32*>(p)[i];
        } else if constexpr (CHB % 2 == 0) {
#pragma unroll
            for (int i = 0; i < NW; ++i) w[i] = 0u;
#pragma unroll
            for (int i = 0; i < CHB / 2; ++i)
                w[i >> 1] |= static_cast<u32>(reinterpret_cast<const u16*>(p)[i]) << (16 * (i & 1));
        } else {
#pragma unroll
            for (int i = 0; i < NW; ++i) w[i] = 0u;
#pragma unroll
            for (int i = 0; i < CHB; ++i) w[i >> 2] |= static_cast<u32>(p[i]) << (8 * (i & 3));
        }
    } else {
        // not byte aligned: read the covering words of the row and shift them down
        constexpr int ROW_WORDS = ROW_BYTES / 4;
        const u32* rw = reinterpret_cast<const u32*>(row);
        const int bit0 = idx * CH_BITS, w0 = bit0 >> 5, sh = bit0 & 31;
        u32 raw[NW + 1];
#pragma unroll
        for (int i = 0; i <= NW; ++i) raw[i] = (w0 + i < ROW_WORDS) ? rw[w0 + i] : 0u;
#pragma unroll
        for (int i = 0; i < NW; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
    }
}

// 4 * code at bit position `pos` of a chunk (a byte offset into a table of u32); `pos` is a
// compile-time constant once the caller's loops are unrolled.
template <int BITS>
__device__ __forceinline__ u32 code_off4(const u32* w, int pos) {
    constexpr u32 MASK4 = ((1u << BITS) - 1u) << 2;
    const int wi = pos >> 5, sh = pos & 31;
    if (sh + BITS > 32) return __funnelshift_r(w[wi], w[wi + 1], sh - 2) & MASK4;
    if (sh >= 2) return (w[wi] >> (sh - 2)) & MASK4;
    return (w[wi] << (2 - sh)) & MASK4;
}

// 32-bit shared-memory address of a __shared__ object.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// Table entry of the code at bit `pos` of a chunk: the float16 centroid replicated in both
// halves of a u32. `base` is the table's shared address, aligned to 4 << BITS bytes, so the
// address is (code * 4) | base: a shift and one LOP3 per code.
template <int BITS>
__device__ __forceinline__ u32 lut(const u32* w, int pos, u32 base) {
    const u32 addr = code_off4<BITS>(w, pos) | base;
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
// Low half of x, high half of y.
__device__ __forceinline__ u32 pack_lo_hi(u32 x, u32 y) { return __byte_perm(x, y, 0x7610); }

// Codes of two rows in one word each (BITS in 1, 2, 4: no code crosses a word), interleaved so
// that each pair (row 0's code m, row 1's code m) is one 2*BITS-bit field, row 0's code in the
// low bits: `even` holds the pairs of the even codes m = 2i at bit 2*i*BITS, `odd` those of the
// odd codes m = 2i + 1 at the same bit. A field is then an index into a table of code pairs.
template <int BITS>
__device__ __forceinline__ void interleave_rows(u32 w0, u32 w1, u32& even, u32& odd) {
    static_assert(BITS == 1 || BITS == 2 || BITS == 4, "codes must not cross a word");
    constexpr u32 M = BITS == 1 ? 0x55555555u : (BITS == 2 ? 0x33333333u : 0x0F0F0F0Fu);  // even codes' bits
    even = (w0 & M) | ((w1 << BITS) & ~M);
    odd = ((w0 >> BITS) & M) | (w1 & ~M);
}

// D(16x8, f32) += A(16x16, f16, row) * B(16x8, f16, col)
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


}  // namespace

// ---- quantize / dequantize ------------------------------------------------------------------

// One block of D threads per row: rows of `x` (rows, D) -> packed codes (rows, row_bytes) and
// float16 gains (rows). HADAMARD selects the fast transform (signs used) or the dense matrix.
// T is float or unsigned short (float16 bits). unbiased != 0 stores norm / <y, c> (inner
// products with x kept) instead of the least-squares norm * <y, c> / |c|^2.
template <typename T, int D, int BITS, bool HADAMARD>
__global__ void polar_quantize(const T* __restrict__ x, long long rows, const float* __restrict__ signs,
                               const float* __restrict__ matrix, const float* __restrict__ thresholds,
                               const float* __restrict__ centroids, u8* __restrict__ codes, u16* __restrict__ gains,
                               int unbiased) {
    static_assert(D % 32 == 0 && D <= 1024, "D must be a multiple of 32, at most 1024");
    __shared__ float s[D];
    __shared__ u8 c[D];
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int i = threadIdx.x;
    const float v = Io<T>::load(x[row * D + i]);
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
    c[i] = static_cast<u8>(lo);
    const float yc = block_sum(y * ch, scratch);
    const float cc = block_sum(ch * ch, scratch);
    if (i == 0) gains[row] = f2h(unbiased ? (yc > 0.f ? norm / yc : 0.f)
                                          : (cc > 0.f ? norm * yc / cc : 0.f));
    __syncthreads();
    if (i < D / 8) {  // pack a group of eight codes into BITS bytes
        unsigned long long word = 0;
        for (int k = 0; k < 8; ++k) word |= static_cast<unsigned long long>(c[i * 8 + k]) << (k * BITS);
        u8* dst = codes + row * (D * BITS / 8) + i * BITS;
        for (int b = 0; b < BITS; ++b) dst[b] = static_cast<u8>(word >> (8 * b));
    }
}

// One block of D threads per row: packed codes + gains -> x = M^T (gain * centroids[code]).
template <typename T, int D, int BITS, bool HADAMARD>
__global__ void polar_dequantize(const u8* __restrict__ codes, const u16* __restrict__ gains, long long rows,
                                 const float* __restrict__ signs, const float* __restrict__ matrix,
                                 const float* __restrict__ centroids, T* __restrict__ out) {
    __shared__ float s[D];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int i = threadIdx.x;
    constexpr int row_bytes = D * BITS / 8;
    const float y = centroids[extract_code<BITS>(codes + row * row_bytes, i, row_bytes)] * h2f(gains[row]);
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
    out[row * D + i] = Io<T>::store(xv);
}

// ---- rotary phases of a rotating key mean ----------------------------------------------------
//
// Row t of out (n, 2J + 1) float32: [cos(w_j p) (J values) | sin(w_j p) (J values) | 1] at
// position p = start + t (arraykv.quant.rotary_mean.RotaryMeanPlan.phase_rows). The angle is
// formed and reduced to [-pi, pi] in double precision: positions reach 10^5 and more, where a
// float angle is off by a tenth of a radian.
__global__ void rotary_phases(const float* __restrict__ freq, int n_pairs, long long start, int n,
                              float* __restrict__ out) {
    const int width = 2 * n_pairs + 1;
    const long long total = static_cast<long long>(n) * width;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long t = i / width;
        const int col = static_cast<int>(i - t * width);
        float v = 1.f;
        if (col < 2 * n_pairs) {
            const int j = col < n_pairs ? col : col - n_pairs;
            const double a = static_cast<double>(freq[j]) * static_cast<double>(start + t);
            const double r = a - 6.283185307179586 * rint(a * 0.15915494309189535);
            float sv, cv;
            sincosf(static_cast<float>(r), &sv, &cv);
            v = col < n_pairs ? cv : sv;
        }
        out[i] = v;
    }
}

// ---- decode attention, step 1: per-query quantities -----------------------------------------
//
// Grid (Gt, H, B), D threads; query row = (b * H + h) * Gt + g of q (B, H*Gt, 1, D).
// Writes, float32: qr (rows, D) = scale * M q~, qconst (rows) = scale * q . k_mean,
// qout (rows, nout) = scale * (q / s)[outlier channels], sq (rows, D) = sq_scale * S q~ (QJL),
// where q~ = q / s with the outlier channels zeroed (arraykv.attention.polar_fused.prepare_queries).
template <typename T, int D, bool HADAMARD>
__global__ void __launch_bounds__(D)
polar_prepare_queries(const T* __restrict__ q, const u16* __restrict__ k_scale, const u16* __restrict__ k_mean,
                      const int* __restrict__ out_idx, int nout, const float* __restrict__ signs,
                      const float* __restrict__ matrix, const float* __restrict__ sketch, float scale, float sq_scale,
                      int has_scale, int has_mean, int has_qjl, float* __restrict__ qr, float* __restrict__ qconst,
                      float* __restrict__ qout, float* __restrict__ sq) {
    __shared__ float qs_sh[D], qt_sh[D], rot[D], scratch[32];
    __shared__ float keep[D];
    const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int Gt = gridDim.x, H = gridDim.y;
    const long long bh = static_cast<long long>(b) * H + h;
    const long long row = bh * Gt + g;
    const int i = threadIdx.x;
    const float qv = Io<T>::load(q[row * D + i]);
    const float qs = has_scale ? qv / h2f(k_scale[bh * D + i]) : qv;
    qs_sh[i] = qs;
    keep[i] = 1.f;
    __syncthreads();
    for (int j = i; j < nout; j += D) {
        const int c = out_idx[bh * nout + j];
        qout[row * nout + j] = qs_sh[c] * scale;
        keep[c] = 0.f;
    }
    __syncthreads();
    const float qt = qs * keep[i];
    qt_sh[i] = qt;
    const float qc = block_sum(has_mean ? qv * h2f(k_mean[bh * D + i]) : 0.f, scratch);
    if (i == 0) qconst[row] = qc * scale;
    if (HADAMARD) {
        rot[i] = qt * signs[i];
        fwht_shared<D>(rot);
        qr[row * D + i] = rot[i] * (rsqrtf(static_cast<float>(D)) * scale);
    } else {
        __syncthreads();
        float acc = 0.f;
        for (int j = 0; j < D; ++j) acc += matrix[i * D + j] * qt_sh[j];
        qr[row * D + i] = acc * scale;
    }
    if (has_qjl) {
        __syncthreads();
        float acc = 0.f;
        for (int j = 0; j < D; ++j) acc += sketch[i * D + j] * qt_sh[j];
        sq[row * D + i] = acc * sq_scale;
    }
}

// ---- decode attention, step 2: split-K flash decoding over the packed tokens ----------------
//
// Grid (splits, H, B); block WARPS warps. A split owns a run of 16-token tiles; its warps take
// the tiles round-robin, each with its own online softmax, merged through shared memory at the
// end. One warp serves every query head g < G (<= 8) of its KV head, so a token's codes are
// decoded once per KV head. Both products run on the tensor cores (mma m16n8k16, float16 in,
// float32 accumulate):
//   scores  S (16 x 8 tokens) = Q (16 x D; rows = heads, rows >= G zero) . K^T (D x 8), two
//           n-tiles per 16-token tile; lane (r = lane/4, c = lane%4) gets head r's logits of
//           tokens 2c, 2c+1, 8+2c, 9+2c, exactly the B operand of the value product;
//   values  O^T (D x 8 heads) += V^T (D x 16 tokens) . P^T (16 tokens x 8 heads), P carrying
//           the value gains.
// A dot product does not depend on the order of its terms, so each lane decodes the channels
// of one contiguous piece of a packed row: for keys, lane c takes channels [c*D/4, (c+1)*D/4)
// of tokens r and 8+r (k-step j, k index {2c, 2c+1, 2c+8, 2c+9} <-> channel c*D/4 + 4j + {0..3},
// and the query fragments use the same map); for values, lane r takes channels
// [r*D/8, (r+1)*D/8) of tokens 2c, 2c+1, 8+2c, 9+2c (m-tile i, rows r and r+8 <-> channels
// r*D/8 + 2i and r*D/8 + 2i + 1). Centroids are read from a shared table of float16.
// The value accumulators are rescaled only in tiles where a running max moved. PREFETCH issues
// the next tile's loads before the current tile is computed (more registers per thread).
//
// Arrays of the cache are views of buffers of capacity `cap` tokens:
//   k_codes/v_codes (B, H, cap, D*KB/8 | D*VB/8) uint8, k_gain/v_gain (B, H, cap) half,
//   k_out (B, H, cap, nout) half, k_qjl (B, H, cap, D/8) uint8, k_qjl_norm (B, H, cap) half.
// Queries (step 1): qr (B*H, Gt, D), qconst (B*H, Gt), qout (B*H, Gt, nout), sq (B*H, Gt, D);
// with BIAS, bias (B*H, Gt, n_tokens) float32 adds a logit term per query and token (the
// rotating key mean's share, computed by the launcher; qconst is then 0);
// this launch serves heads [g0, g0 + G). Outputs per (b, h, split, g): running max m, sum l of
// exp(logit - m), acc (D) = sum exp(logit - m) * gain_v * centroids_v[codes] (rotated domain).
constexpr int MAX_OUTLIERS = 32;

template <int D, int KB, int VB, bool QJL, int WARPS, bool PREFETCH, bool BIAS = false>
__global__ void __launch_bounds__(WARPS * 32)
polar_decode_attn(const float* __restrict__ qr, const float* __restrict__ qconst, const float* __restrict__ qout,
                  const float* __restrict__ sq, const float* __restrict__ bias, const u8* __restrict__ k_codes, const u16* __restrict__ k_gain,
                  const float* __restrict__ k_cent, const u8* __restrict__ v_codes, const u16* __restrict__ v_gain,
                  const float* __restrict__ v_cent, const u16* __restrict__ k_out, const u8* __restrict__ k_qjl,
                  const u16* __restrict__ k_qjl_norm, int n_tokens, long long cap, int Gt, int g0, int G, int nout,
                  int tiles_per_split, int splits, float* __restrict__ out_m, float* __restrict__ out_l,
                  float* __restrict__ out_acc) {
    static_assert(D % 32 == 0 && D <= 256, "D must be a multiple of 32, at most 256");
    static_assert(KB >= 1 && KB <= 8 && VB >= 1 && VB <= 8, "bits must be in 1..8");
    constexpr int KBYTES = D * KB / 8, VBYTES = D * VB / 8, QBYTES = D / 8;
    constexpr int KCH = D / 4 * KB, VCH = D / 8 * VB, QCH = D / 4;  // bits per lane and token
    constexpr int KSTEPS = D / 16;
    constexpr int KW = (KCH + 31) / 32, VW = (VCH + 31) / 32, QW = (QCH + 31) / 32;

    // Centroid tables (float16 pairs in a u32). For 1- and 2-bit codes (KPAIR/VPAIR) entry i of
    // a table of 2*BITS-bit indices holds (centroid[i & mask], centroid[i >> BITS]): one shared
    // load gives an mma operand register of two codes. Otherwise entry i holds centroid[i] twice
    // and two loads are packed into one register: a pair table of 3- or 4-bit codes (64 or 256
    // words) puts different words of one bank under the lanes of a load, and the bank conflicts
    // cost more than the loads saved (H200, pqo4 at 32k tokens: 0.220 against 0.215 ms in two
    // runs; shared-memory pipe 85 % busy).
    constexpr bool KPAIR = KB <= 2, VPAIR = VB <= 2;
    constexpr int KT = KPAIR ? 2 * KB : KB, VT = VPAIR ? 2 * VB : VB;
    __shared__ alignas(4 << KT) u32 ktab[1 << KT];
    __shared__ alignas(4 << VT) u32 vtab[1 << VT];
    __shared__ alignas(16) u32 qtab[4];  // the QJL signs' pairs (-1, +1)
    __shared__ float sm_qout[8][MAX_OUTLIERS];
    __shared__ float sm_m[WARPS][8], sm_l[WARPS][8];
    __shared__ float sm_acc[WARPS][8][D];

    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int H = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = lane >> 2, c = lane & 3;
    const long long bh = static_cast<long long>(b) * H + h;

    for (int j = threadIdx.x; j < (1 << KT); j += WARPS * 32) {
        const int lo = j & ((1 << KB) - 1), hi = KPAIR ? j >> KB : lo;
        ktab[j] = static_cast<u32>(f2h(k_cent[lo])) | (static_cast<u32>(f2h(k_cent[hi])) << 16);
    }
    for (int j = threadIdx.x; j < (1 << VT); j += WARPS * 32) {
        const int lo = j & ((1 << VB) - 1), hi = VPAIR ? j >> VB : lo;
        vtab[j] = static_cast<u32>(f2h(v_cent[lo])) | (static_cast<u32>(f2h(v_cent[hi])) << 16);
    }
    for (int j = threadIdx.x; j < 8 * MAX_OUTLIERS; j += WARPS * 32) {
        const int g = j / MAX_OUTLIERS, o = j % MAX_OUTLIERS;
        sm_qout[g][o] = (g < G && o < nout) ? qout[(bh * Gt + g0 + g) * nout + o] : 0.f;
    }
    if (QJL && threadIdx.x < 4)  // bit 0 -> low half, bit 1 -> high half; bit set: +1, else -1
        qtab[threadIdx.x] = ((threadIdx.x & 1) ? 0x3C00u : 0xBC00u) | ((threadIdx.x & 2) ? 0x3C000000u : 0xBC000000u);
    // query fragments (A operand of the score product): head r, channels c*D/4 + 4j + {0..3}
    const bool head_ok = r < G;
    const long long qoff = (bh * Gt + g0 + (head_ok ? r : 0)) * D + c * (D / 4);
    u32 qa[KSTEPS][2], sa[QJL ? KSTEPS : 1][2];
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (head_ok) {
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = qr[qoff + 4 * j + e];
        }
        qa[j][0] = f2h2(v[0], v[1]);
        qa[j][1] = f2h2(v[2], v[3]);
        if constexpr (QJL) {
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = head_ok ? sq[qoff + 4 * j + e] : 0.f;
            sa[j][0] = f2h2(v[0], v[1]);
            sa[j][1] = f2h2(v[2], v[3]);
        }
    }
    const float qc = head_ok ? qconst[bh * Gt + g0 + r] : 0.f;
    // per-token logit terms of head r (the rotating key mean), row (b, h, g0 + r) of (B*H*Gt, n_tokens)
    const float* brow = bias + (BIAS ? (bh * Gt + g0 + (head_ok ? r : 0)) * static_cast<long long>(n_tokens) : 0);
    const u32 kbase_s = smem_addr(ktab), vbase_s = smem_addr(vtab), qbase_s = smem_addr(qtab);
    __syncthreads();

    const int n_tiles = (n_tokens + 15) >> 4;
    const int tile_lo = split * tiles_per_split;
    const int tile_hi = min(n_tiles, tile_lo + tiles_per_split);
    const int last = n_tokens - 1;
    const u8* kbase = k_codes + bh * cap * KBYTES;
    const u8* vbase = v_codes + bh * cap * VBYTES;
    const u16* kgb = k_gain + bh * cap;
    const u16* vgb = v_gain + bh * cap;
    const u8* qjb = QJL ? k_qjl + bh * cap * QBYTES : k_qjl;
    const u16* qnb = QJL ? k_qjl_norm + bh * cap : k_qjl_norm;
    const u16* kob = k_out + bh * cap * nout;

    float m_run = neg_inf(), l_run = 0.f;
    float acc[KSTEPS][4];
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    // registers of one tile: this lane's code chunks, gains and QJL norms
    struct TileRegs {
        u32 kw0[KW], kw1[KW], vw[4][VW], zw0[QJL ? QW : 1], zw1[QJL ? QW : 1];
        float kg[4], vg[4], qn[4];
    };
    auto load = [&](int tile, TileRegs& d) {
        const int base = tile * 16;
        const int tk0 = min(base + r, last), tk1 = min(base + 8 + r, last);  // key rows of this lane
        load_chunk<KCH, KBYTES>(d.kw0, kbase + static_cast<long long>(tk0) * KBYTES, c);
        load_chunk<KCH, KBYTES>(d.kw1, kbase + static_cast<long long>(tk1) * KBYTES, c);
        if constexpr (QJL) {
            load_chunk<QCH, QBYTES>(d.zw0, qjb + static_cast<long long>(tk0) * QBYTES, c);
            load_chunk<QCH, QBYTES>(d.zw1, qjb + static_cast<long long>(tk1) * QBYTES, c);
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {  // value rows / logits: tokens 2c, 2c+1, 8+2c, 9+2c
            const int tc = min(base + 2 * c + (t & 1) + 8 * (t >> 1), last);
            load_chunk<VCH, VBYTES>(d.vw[t], vbase + static_cast<long long>(tc) * VBYTES, r);
            d.kg[t] = h2f(kgb[tc]);
            d.vg[t] = h2f(vgb[tc]);
            d.qn[t] = QJL ? h2f(qnb[tc]) : 0.f;
        }
    };
    TileRegs cur;
    int tile = tile_lo + warp;
    if (PREFETCH && tile < tile_hi) load(tile, cur);
    for (; tile < tile_hi; tile += WARPS) {
        // with PREFETCH the next tile's loads are in flight while this one is computed
        TileRegs nxt;
        if constexpr (PREFETCH) {
            if (tile + WARPS < tile_hi) load(tile + WARPS, nxt);
        } else {
            load(tile, cur);
        }
        const int base = tile * 16;
        int tv[4];  // this lane's logits / value rows
        tv[0] = base + 2 * c; tv[1] = tv[0] + 1; tv[2] = tv[0] + 8; tv[3] = tv[0] + 9;
        const u32(&kw0)[KW] = cur.kw0;
        const u32(&kw1)[KW] = cur.kw1;
        const u32(&zw0)[QJL ? QW : 1] = cur.zw0;
        const u32(&zw1)[QJL ? QW : 1] = cur.zw1;
        const u32(&vw)[4][VW] = cur.vw;
        const float(&kg)[4] = cur.kg;
        const float(&vg)[4] = cur.vg;
        const float(&qn)[4] = cur.qn;
        // ---- logits: S = Q . K^T on the tensor cores, tokens base..base+7 and base+8..base+15
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < KSTEPS; ++j) {
            const int p = 4 * j * KB;
            u32 b00, b01, b10, b11;
            if constexpr (KPAIR) {  // consecutive codes of a row are one table index
                b00 = lut<2 * KB>(kw0, p, kbase_s);
                b01 = lut<2 * KB>(kw0, p + 2 * KB, kbase_s);
                b10 = lut<2 * KB>(kw1, p, kbase_s);
                b11 = lut<2 * KB>(kw1, p + 2 * KB, kbase_s);
            } else {
                b00 = pack_lo_hi(lut<KB>(kw0, p, kbase_s), lut<KB>(kw0, p + KB, kbase_s));
                b01 = pack_lo_hi(lut<KB>(kw0, p + 2 * KB, kbase_s), lut<KB>(kw0, p + 3 * KB, kbase_s));
                b10 = pack_lo_hi(lut<KB>(kw1, p, kbase_s), lut<KB>(kw1, p + KB, kbase_s));
                b11 = pack_lo_hi(lut<KB>(kw1, p + 2 * KB, kbase_s), lut<KB>(kw1, p + 3 * KB, kbase_s));
            }
            mma16816(s0, qa[j][0], 0u, qa[j][1], 0u, b00, b01);
            mma16816(s1, qa[j][0], 0u, qa[j][1], 0u, b10, b11);
        }
        float z0[4] = {0.f, 0.f, 0.f, 0.f}, z1[4] = {0.f, 0.f, 0.f, 0.f};
        if constexpr (QJL) {  // the QJL sign bits are a 1-bit code with centroids -1, +1
#pragma unroll
            for (int j = 0; j < KSTEPS; ++j) {
                const int p = 4 * j;
                mma16816(z0, sa[j][0], 0u, sa[j][1], 0u, lut<2>(zw0, p, qbase_s), lut<2>(zw0, p + 2, qbase_s));
                mma16816(z1, sa[j][0], 0u, sa[j][1], 0u, lut<2>(zw1, p, qbase_s), lut<2>(zw1, p + 2, qbase_s));
            }
        }
        float sc[4] = {s0[0], s0[1], s1[0], s1[1]};
        const float zq[4] = {z0[0], z0[1], z1[0], z1[1]};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            float v = sc[t] * kg[t] + qc;
            if constexpr (BIAS) v += brow[min(tv[t], last)];
            if constexpr (QJL) v += zq[t] * qn[t];
            if (nout) {  // exact outlier channels, float32
                const u16* kr = kob + static_cast<long long>(min(tv[t], last)) * nout;
                float o = 0.f;
                for (int j = 0; j < nout; ++j) o += sm_qout[r][j] * h2f(kr[j]);
                v += o;
            }
            sc[t] = tv[t] < n_tokens ? v : neg_inf();
        }
        // ---- online softmax of head r (lanes 4r..4r+3 hold its 16 logits)
        float mt = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float mn = fmaxf(m_run, mt);
        const float corr = __expf(m_run - mn);  // 0 on the first tile (m_run = -inf)
        float pr[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) pr[t] = __expf(sc[t] - mn);
        l_run = l_run * corr + ((pr[0] + pr[1]) + (pr[2] + pr[3]));
        m_run = mn;
        const u32 pb0 = f2h2(pr[0] * vg[0], pr[1] * vg[1]);
        const u32 pb1 = f2h2(pr[2] * vg[2], pr[3] * vg[3]);
        const float corr_lo = __shfl_sync(0xffffffffu, corr, 8 * c);      // head 2c
        const float corr_hi = __shfl_sync(0xffffffffu, corr, 8 * c + 4);  // head 2c+1
        // ---- values: O^T += V^T . P^T
        if (__any_sync(0xffffffffu, corr != 1.f)) {  // the running max moved: rescale (rare after a few tiles)
#pragma unroll
            for (int i = 0; i < KSTEPS; ++i) {
                acc[i][0] *= corr_lo; acc[i][1] *= corr_hi; acc[i][2] *= corr_lo; acc[i][3] *= corr_hi;
            }
        }
        if constexpr (VPAIR) {  // tokens (2c, 2c+1) and (8+2c, 9+2c): their codes interleaved by pairs
            u32 e01[VW], o01[VW], e23[VW], o23[VW];
#pragma unroll
            for (int k = 0; k < VW; ++k) {
                interleave_rows<VB>(vw[0][k], vw[1][k], e01[k], o01[k]);
                interleave_rows<VB>(vw[2][k], vw[3][k], e23[k], o23[k]);
            }
#pragma unroll
            for (int i = 0; i < KSTEPS; ++i) {
                const int p = 2 * i * VB;  // the pair fields of codes 2i (even) and 2i+1 (odd)
                mma16816(acc[i], lut<2 * VB>(e01, p, vbase_s), lut<2 * VB>(o01, p, vbase_s), lut<2 * VB>(e23, p, vbase_s),
                         lut<2 * VB>(o23, p, vbase_s), pb0, pb1);
            }
        } else {
#pragma unroll
            for (int i = 0; i < KSTEPS; ++i) {
                const int p0 = 2 * i * VB, p1 = p0 + VB;
                const u32 a0 = pack_lo_hi(lut<VB>(vw[0], p0, vbase_s), lut<VB>(vw[1], p0, vbase_s));
                const u32 a1 = pack_lo_hi(lut<VB>(vw[0], p1, vbase_s), lut<VB>(vw[1], p1, vbase_s));
                const u32 a2 = pack_lo_hi(lut<VB>(vw[2], p0, vbase_s), lut<VB>(vw[3], p0, vbase_s));
                const u32 a3 = pack_lo_hi(lut<VB>(vw[2], p1, vbase_s), lut<VB>(vw[3], p1, vbase_s));
                mma16816(acc[i], a0, a1, a2, a3, pb0, pb1);
            }
        }
        if constexpr (PREFETCH) cur = nxt;
    }
    // ---- merge the warps of this block
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    if (c == 0) {
        sm_m[warp][r] = m_run;
        sm_l[warp][r] = l_run;
    }
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
        const int ch = r * (D / 8) + 2 * i;
        sm_acc[warp][2 * c][ch] = acc[i][0];
        sm_acc[warp][2 * c + 1][ch] = acc[i][1];
        sm_acc[warp][2 * c][ch + 1] = acc[i][2];
        sm_acc[warp][2 * c + 1][ch + 1] = acc[i][3];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D, j = idx % D;
        float mt = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mt = fmaxf(mt, sm_m[w][g]);
        float lt = 0.f, at = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = sm_m[w][g] == neg_inf() ? 0.f : __expf(sm_m[w][g] - mt);
            lt += sm_l[w][g] * f;
            at += sm_acc[w][g][j] * f;
        }
        const long long o = (bh * splits + split) * Gt + g0 + g;
        out_acc[o * D + j] = at;
        if (j == 0) {
            out_m[o] = mt;
            out_l[o] = lt;
        }
    }
}

// ---- decode attention, step 3: merge splits, leave the rotated domain, add the window -------
//
// Grid (Gt, H, B), D threads. For query row (b*H + h)*Gt + g: m = max over splits, l and acc
// summed with exp(m_s - m); num = M^T acc + l * v_mean; the float16 window tokens (k_win, v_win
// (B, H, n_win, D), raw keys/values) join the softmax with logits scale * q . k; the output
// (B, H*Gt, 1, D) is num / den in the dtype of q.
template <typename T, int D, bool HADAMARD>
__global__ void __launch_bounds__(D)
polar_merge_window(const float* __restrict__ out_m, const float* __restrict__ out_l,
                   const float* __restrict__ out_acc, int splits, const T* __restrict__ q,
                   const u16* __restrict__ k_win, const u16* __restrict__ v_win, int n_win,
                   const u16* __restrict__ v_mean, int has_mean, const float* __restrict__ signs,
                   const float* __restrict__ matrix, float scale, T* __restrict__ out) {
    constexpr int CHUNK = 64, NWARP = D / 32;
    __shared__ float buf[D], qsh[D], sw[CHUNK];
    const int g = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int Gt = gridDim.x, H = gridDim.y;
    const long long bh = static_cast<long long>(b) * H + h, row = bh * Gt + g;
    const int i = threadIdx.x, lane = i & 31, warp = i >> 5;
    float M = neg_inf();
    for (int s = 0; s < splits; ++s) M = fmaxf(M, out_m[(bh * splits + s) * Gt + g]);
    float L = 0.f, A = 0.f;
    for (int s = 0; s < splits; ++s) {
        const long long o = (bh * splits + s) * Gt + g;
        const float ms = out_m[o];
        if (ms == neg_inf()) continue;  // a split with no token (same for every thread)
        const float f = __expf(ms - M);
        L += f * out_l[o];
        A += f * out_acc[o * D + i];
    }
    float num;
    buf[i] = A;
    if (HADAMARD) {
        fwht_shared<D>(buf);
        num = buf[i] * signs[i] * rsqrtf(static_cast<float>(D));
    } else {
        __syncthreads();
        float acc = 0.f;
        for (int j = 0; j < D; ++j) acc += matrix[j * D + i] * buf[j];
        num = acc;
    }
    if (has_mean) num += L * h2f(v_mean[bh * D + i]);
    float den = L, mrun = M;
    qsh[i] = Io<T>::load(q[row * D + i]);
    for (int w0 = 0; w0 < n_win; w0 += CHUNK) {
        const int cnt = min(CHUNK, n_win - w0);
        __syncthreads();  // qsh written, the previous chunk's sw read
        for (int k = warp; k < cnt; k += NWARP) {
            const u16* kr = k_win + (bh * n_win + w0 + k) * D;
            float part = 0.f;
            for (int j = lane; j < D; j += 32) part += qsh[j] * h2f(kr[j]);
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (lane == 0) sw[k] = part * scale;
        }
        __syncthreads();
        float cm = neg_inf();
        for (int k = 0; k < cnt; ++k) cm = fmaxf(cm, sw[k]);
        const float mn = fmaxf(mrun, cm);
        const float a = __expf(mrun - mn);
        num *= a;
        den *= a;
        for (int k = 0; k < cnt; ++k) {
            const float e = __expf(sw[k] - mn);
            den += e;
            num += e * h2f(v_win[(bh * n_win + w0 + k) * D + i]);
        }
        mrun = mn;
    }
    out[row * D + i] = Io<T>::store(num / den);
}

// Explicit instantiations so ahead-of-time compilation (nvcc --ptx) checks every body; at run
// time the loader instantiates what it needs by name expression.
template __global__ void polar_quantize<float, 128, 4, true>(const float*, long long, const float*, const float*,
                                                             const float*, const float*, u8*, u16*, int);
template __global__ void polar_quantize<u16, 64, 3, true>(const u16*, long long, const float*, const float*,
                                                          const float*, const float*, u8*, u16*, int);
template __global__ void polar_quantize<float, 96, 2, false>(const float*, long long, const float*, const float*,
                                                             const float*, const float*, u8*, u16*, int);
template __global__ void polar_dequantize<float, 128, 4, true>(const u8*, const u16*, long long, const float*,
                                                               const float*, const float*, float*);
template __global__ void polar_dequantize<u16, 256, 3, true>(const u8*, const u16*, long long, const float*,
                                                             const float*, const float*, u16*);
template __global__ void polar_dequantize<float, 96, 2, false>(const u8*, const u16*, long long, const float*,
                                                               const float*, const float*, float*);
#define ARRAYKV_PREP_MERGE(T, D, HAD)                                                                           \
    template __global__ void polar_prepare_queries<T, D, HAD>(const T*, const u16*, const u16*, const int*, int,  \
                                                              const float*, const float*, const float*, float,  \
                                                              float, int, int, int, float*, float*, float*,    \
                                                              float*);                                          \
    template __global__ void polar_merge_window<T, D, HAD>(const float*, const float*, const float*, int,         \
                                                           const T*, const u16*, const u16*, int, const u16*,   \
                                                           int, const float*, const float*, float, T*);
ARRAYKV_PREP_MERGE(float, 128, true)
ARRAYKV_PREP_MERGE(u16, 64, true)
ARRAYKV_PREP_MERGE(float, 96, false)
#undef ARRAYKV_PREP_MERGE
#define ARRAYKV_ATTN(D, KB, VB, QJL, PF)                                                                           \
    template __global__ void polar_decode_attn<D, KB, VB, QJL, 4, PF>(                                              \
        const float*, const float*, const float*, const float*, const float*, const u8*, const u16*,             \
        const float*, const u8*, const u16*, const float*, const u16*, const u8*, const u16*, int, long long, int, \
        int, int, int, int, int, float*, float*, float*);
ARRAYKV_ATTN(128, 4, 4, false, false)
ARRAYKV_ATTN(128, 4, 4, false, true)
ARRAYKV_ATTN(128, 3, 3, false, true)
ARRAYKV_ATTN(64, 1, 1, true, true)
ARRAYKV_ATTN(256, 2, 3, true, true)
ARRAYKV_ATTN(96, 3, 3, false, true)
ARRAYKV_ATTN(32, 1, 3, false, false)
template __global__ void polar_decode_attn<128, 4, 4, false, 4, false, true>(
    const float*, const float*, const float*, const float*, const float*, const u8*, const u16*, const float*,
    const u8*, const u16*, const float*, const u16*, const u8*, const u16*, int, long long, int, int, int, int,
    int, int, float*, float*, float*);
#undef ARRAYKV_ATTN
