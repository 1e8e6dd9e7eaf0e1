// Shared by every kernel file. Header-free on purpose: NVRTC 13 ships no headers, so bf16 is
// carried as `unsigned short` and converted with the PTX `cvt` instruction (sm_80+); all math is
// f32. A float buffer's precision is chosen at allocation (`FloatKind`), so elementwise kernels
// take each buffer with a flag `f32` (1: float, 0: bf16) instead of one instantiation per mix.

typedef unsigned short bf16;

#define NEG_INF __int_as_float(0xff800000)

// A grid-stride loop over `long long` indices: tensors may exceed 2^31 elements.
#define GRID_STRIDE(i, n) \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned int)h) << 16); }

// Round to nearest even, as the host's `half::bf16::from_f32` does.
__device__ __forceinline__ bf16 f2bf(float f) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ float ld(const void* p, int f32, long long i) {
  return f32 ? ((const float*)p)[i] : bf2f(((const bf16*)p)[i]);
}

__device__ __forceinline__ void st(void* p, int f32, long long i, float v) {
  if (f32) {
    ((float*)p)[i] = v;
  } else {
    ((bf16*)p)[i] = f2bf(v);
  }
}

// Eight bf16 in one 16-byte uint4, element 0 in the low half of .x: the unit of the vectorized
// kernels' loads and stores. Widening is exact and narrowing rounds as f2bf does, so a kernel
// reading and writing through these gives the same bits as one using ld/st per element.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
  unsigned int w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = (unsigned int)f2bf(f[2 * k]) | ((unsigned int)f2bf(f[2 * k + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over a block of `blockDim.x` threads (a multiple of 32, at most 1024) in a fixed order;
// every thread gets the result. `red` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < warps ? red[lane] : 0.0f;
  return warp_sum(t);
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < warps ? red[lane] : NEG_INF;
  return warp_max(t);
}
