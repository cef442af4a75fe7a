// Bit packing of small integer codes (1..8 bits) on the GPU.
//
// Layout (the same as arraykv.quant.bitpack on the CPU): each row of `n` codes becomes a
// little-endian bit stream of ceil(n * BITS / 8) bytes. Code i occupies stream bits
// [i * BITS, (i + 1) * BITS); stream bit j is bit (j % 8) of byte j / 8. Eight codes always
// fill exactly BITS bytes, so one thread packs or unpacks one group of eight codes.

// No header is included: NVRTC (cupy.RawModule) compiles this file without the CUDA include
// folder, so the fixed-width types are defined here.
typedef unsigned char uint8_t;

template <int BITS>
__global__ void pack_bits(const uint8_t* __restrict__ codes, uint8_t* __restrict__ packed,
                          long long rows, int n, int row_bytes) {
    static_assert(BITS >= 1 && BITS <= 8, "BITS must be in 1..8");
    const int groups = (n + 7) / 8;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= rows * groups) return;
    const long long row = gid / groups;
    const int g = (int)(gid % groups);
    const uint8_t* src = codes + row * n + g * 8;
    const int valid = min(8, n - g * 8);
    unsigned long long word = 0;
    for (int i = 0; i < valid; ++i) {
        word |= (unsigned long long)(src[i] & ((1u << BITS) - 1u)) << (i * BITS);
    }
    uint8_t* dst = packed + row * row_bytes + g * BITS;
    const int nbytes = (valid * BITS + 7) / 8;
    for (int b = 0; b < nbytes; ++b) dst[b] = (uint8_t)(word >> (8 * b));
}

template <int BITS>
__global__ void unpack_bits(const uint8_t* __restrict__ packed, uint8_t* __restrict__ codes,
                            long long rows, int n, int row_bytes) {
    static_assert(BITS >= 1 && BITS <= 8, "BITS must be in 1..8");
    const int groups = (n + 7) / 8;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= rows * groups) return;
    const long long row = gid / groups;
    const int g = (int)(gid % groups);
    const int valid = min(8, n - g * 8);
    const int nbytes = (valid * BITS + 7) / 8;
    const uint8_t* src = packed + row * row_bytes + g * BITS;
    unsigned long long word = 0;
    for (int b = 0; b < nbytes; ++b) word |= (unsigned long long)src[b] << (8 * b);
    uint8_t* dst = codes + row * n + g * 8;
    for (int i = 0; i < valid; ++i) dst[i] = (uint8_t)((word >> (i * BITS)) & ((1u << BITS) - 1u));
}

// Explicit instantiations so the module can also be compiled ahead of time (nvcc --ptx).
template __global__ void pack_bits<1>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void pack_bits<2>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void pack_bits<3>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void pack_bits<4>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void pack_bits<5>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void pack_bits<6>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void pack_bits<7>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void pack_bits<8>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<1>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<2>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<3>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<4>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<5>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<6>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<7>(const uint8_t*, uint8_t*, long long, int, int);
template __global__ void unpack_bits<8>(const uint8_t*, uint8_t*, long long, int, int);
