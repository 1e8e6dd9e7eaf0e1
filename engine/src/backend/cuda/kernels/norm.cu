// RMSNorm over rows, and Qwen3's per-head RMSNorm of the query and key heads of a fused qkv row.
// Both are "rows of `dim` elements": token t's row h starts at t·stride + h·dim; rows h < nq use
// weight w[0, dim), the others w[dim, 2 dim) (plain RMSNorm: heads = 1, nq = 1, stride = dim).
// Reference: LlamaRMSNorm in transformers' modeling_llama.py, q_norm/k_norm in modeling_qwen3.py.

// One block per (token, row); block (t, heads) copies the token's value heads unchanged when
// `copy_tail` is set (head norm). out/inp [T, stride], rstd [T, heads], w [dim] or [2 dim].
extern "C" __global__ void rmsnorm_forward(void* out, int out_f32, float* rstd, const void* inp,
                                           int inp_f32, const void* w, int w_f32,
                                           long long stride, int heads, int nq, int dim,
                                           float eps, int copy_tail) {
  __shared__ float red[32];
  const long long t = blockIdx.x;
  const int h = blockIdx.y;
  if (h == heads) {
    for (long long c = (long long)heads * dim + threadIdx.x; c < stride; c += blockDim.x)
      st(out, out_f32, t * stride + c, ld(inp, inp_f32, t * stride + c));
    return;
  }
  const long long base = t * stride + (long long)h * dim;
  const int woff = h < nq ? 0 : dim;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < dim; c += blockDim.x) {
    const float x = ld(inp, inp_f32, base + c);
    ss += x * x;
  }
  ss = block_sum(ss, red);
  const float r = rsqrtf(ss / (float)dim + eps);
  for (int c = threadIdx.x; c < dim; c += blockDim.x)
    st(out, out_f32, base + c, ld(w, w_f32, woff + c) * (ld(inp, inp_f32, base + c) * r));
  if (threadIdx.x == 0) rstd[t * heads + h] = r;
}

// Backward of rows y_i = w_i x_i r: dx_j = r w_j g_j − (r³ / D) x_j Σ_i g_i w_i x_i, and the
// weight gradient g_j x_j r summed over the chunk's rows into partials[chunk, woff + j]
// (rows in order, so deterministic). Block c handles tokens [c·rows_per, (c+1)·rows_per).
// dinp [T, stride] (overwrites; the value tail is copied from dout when `copy_tail`),
// partials [chunks, wlen] (overwrites), dout/inp [T, stride], rstd [T, heads].
extern "C" __global__ void rmsnorm_backward(void* dinp, int dinp_f32, float* partials, int wlen,
                                            const void* dout, int dout_f32, const void* inp,
                                            int inp_f32, const void* w, int w_f32,
                                            const float* rstd, long long tokens,
                                            long long rows_per, long long stride, int heads,
                                            int nq, int dim, int copy_tail) {
  __shared__ float red[32];
  float* part = partials + (long long)blockIdx.x * wlen;
  for (int c = threadIdx.x; c < wlen; c += blockDim.x) part[c] = 0.0f;
  // Zeroed by column index, accumulated by row offset + column: other owners for the k half.
  __syncthreads();
  const long long t0 = (long long)blockIdx.x * rows_per;
  const long long t1 = t0 + rows_per < tokens ? t0 + rows_per : tokens;
  for (long long t = t0; t < t1; ++t) {
    for (int h = 0; h < heads; ++h) {
      const long long base = t * stride + (long long)h * dim;
      const int woff = h < nq ? 0 : dim;
      const float r = rstd[t * heads + h];
      float gwx = 0.0f;
      for (int c = threadIdx.x; c < dim; c += blockDim.x)
        gwx += ld(dout, dout_f32, base + c) * ld(w, w_f32, woff + c) * ld(inp, inp_f32, base + c);
      gwx = block_sum(gwx, red);
      const float k = r * r * r * gwx / (float)dim;
      // Each thread owns the same columns for every row, so its partials need no barrier.
      for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float g = ld(dout, dout_f32, base + c), x = ld(inp, inp_f32, base + c);
        st(dinp, dinp_f32, base + c, r * ld(w, w_f32, woff + c) * g - k * x);
        part[woff + c] += g * x * r;
      }
    }
    if (copy_tail)
      for (long long c = (long long)heads * dim + threadIdx.x; c < stride; c += blockDim.x)
        st(dinp, dinp_f32, t * stride + c, ld(dout, dout_f32, t * stride + c));
  }
}

// The vectorized kernels below take plain RMSNorm (heads = 1, stride = dim) on bf16 buffers with
// dim a multiple of 8 and 16-byte-aligned starts; each thread holds up to VPT vectors of 8
// elements (16 bytes) of a row, vector v at thread v % blockDim.x, all loaded before any is
// used so that a thread keeps VPT loads in flight. Sums of squares and of g·w·x run per thread
// over its vectors in order, then over the block in a fixed order: deterministic, but not the
// generic kernels' order, so results differ from theirs by f32 rounding in the sums.

#define NORM_FWD_VPT 4

// rmsnorm_forward: one block per row, blockDim.x >= vecs / NORM_FWD_VPT (rows up to 32768 at
// 1024 threads). The row is read once and kept in registers between the sum and the scaling; the
// weight is loaded with it, so its latency hides behind the reduction.
extern "C" __global__ void __launch_bounds__(1024)
    rmsnorm_forward_vec(uint4* __restrict__ out, float* __restrict__ rstd,
                        const uint4* __restrict__ inp, const uint4* __restrict__ w, int vecs,
                        float eps) {
  __shared__ float red[32];
  const long long t = blockIdx.x;
  uint4 raw[NORM_FWD_VPT], wraw[NORM_FWD_VPT];
#pragma unroll
  for (int i = 0; i < NORM_FWD_VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    raw[i] = v < vecs ? inp[t * vecs + v] : make_uint4(0, 0, 0, 0);
    wraw[i] = v < vecs ? w[v] : make_uint4(0, 0, 0, 0);
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < NORM_FWD_VPT; ++i) {
    float x[8];
    unpack8(raw[i], x);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
  }
  ss = block_sum(ss, red);
  const float r = rsqrtf(ss / (float)(vecs * 8) + eps);
#pragma unroll
  for (int i = 0; i < NORM_FWD_VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= vecs) break;
    float x[8], wf[8], y[8];
    unpack8(raw[i], x);
    unpack8(wraw[i], wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = wf[e] * (x[e] * r);
    out[t * vecs + v] = pack8(y);
  }
  if (threadIdx.x == 0) rstd[t] = r;
}

#define NORM_BWD_VPT 2
#define NORM_BWD_ROWS 4

// block_sum of N values with one pair of barriers for all of them. `red` holds N × 32 floats.
template <int N>
__device__ __forceinline__ void block_sum_n(float* v, float (*red)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = warp_sum(v[k]);
  __syncthreads();
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < N; ++k) red[k][warp] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = warp_sum(lane < warps ? red[k][lane] : 0.0f);
}

// rmsnorm_backward: block c handles tokens [c·rows_per, (c+1)·rows_per) as rmsnorm_backward
// does, but NORM_BWD_ROWS rows at a time (their loads all in flight, their dot products reduced
// together), with the weight and the thread's weight-gradient columns in registers; rows are
// still added to the partials in token order. blockDim.x >= vecs / NORM_BWD_VPT (rows up to 8192
// at 512 threads). partials [chunks, dim] (overwrites). With a residual (else null), each
// dinp row is the norm's input gradient plus that row of it, summed in f32 before rounding.
extern "C" __global__ void __launch_bounds__(512)
    rmsnorm_backward_vec(uint4* __restrict__ dinp, const uint4* __restrict__ residual,
                         float* __restrict__ partials,
                         const uint4* __restrict__ dout, const uint4* __restrict__ inp,
                         const uint4* __restrict__ w, const float* __restrict__ rstd,
                         long long tokens, long long rows_per, int vecs) {
  __shared__ float red[NORM_BWD_ROWS][32];
  const int dim = vecs * 8;
  uint4 wraw[NORM_BWD_VPT];
  float acc[NORM_BWD_VPT][8];
#pragma unroll
  for (int i = 0; i < NORM_BWD_VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    wraw[i] = v < vecs ? w[v] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] = 0.0f;
  }
  const long long t0 = (long long)blockIdx.x * rows_per;
  const long long t1 = t0 + rows_per < tokens ? t0 + rows_per : tokens;
  for (long long t = t0; t < t1; t += NORM_BWD_ROWS) {
    uint4 graw[NORM_BWD_ROWS][NORM_BWD_VPT], xraw[NORM_BWD_ROWS][NORM_BWD_VPT];
    float r[NORM_BWD_ROWS], gwx[NORM_BWD_ROWS];
#pragma unroll
    for (int k = 0; k < NORM_BWD_ROWS; ++k) {
      const bool row = t + k < t1;
      r[k] = row ? rstd[t + k] : 0.0f;
#pragma unroll
      for (int i = 0; i < NORM_BWD_VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        const bool in = row && v < vecs;
        graw[k][i] = in ? dout[(t + k) * vecs + v] : make_uint4(0, 0, 0, 0);
        xraw[k][i] = in ? inp[(t + k) * vecs + v] : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int k = 0; k < NORM_BWD_ROWS; ++k) {
      gwx[k] = 0.0f;
#pragma unroll
      for (int i = 0; i < NORM_BWD_VPT; ++i) {
        float g[8], wf[8], x[8];
        unpack8(graw[k][i], g);
        unpack8(wraw[i], wf);
        unpack8(xraw[k][i], x);
#pragma unroll
        for (int e = 0; e < 8; ++e) gwx[k] += g[e] * wf[e] * x[e];
      }
    }
    block_sum_n<NORM_BWD_ROWS>(gwx, red);
#pragma unroll
    for (int k = 0; k < NORM_BWD_ROWS; ++k) {
      if (t + k >= t1) break;
      const float kk = r[k] * r[k] * r[k] * gwx[k] / (float)dim;
#pragma unroll
      for (int i = 0; i < NORM_BWD_VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= vecs) break;
        float g[8], wf[8], x[8], dx[8];
        unpack8(graw[k][i], g);
        unpack8(wraw[i], wf);
        unpack8(xraw[k][i], x);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          dx[e] = r[k] * wf[e] * g[e] - kk * x[e];
          acc[i][e] += g[e] * x[e] * r[k];
        }
        if (residual != nullptr) {
          float res[8];
          unpack8(residual[(t + k) * vecs + v], res);
#pragma unroll
          for (int e = 0; e < 8; ++e) dx[e] += res[e];
        }
        dinp[(t + k) * vecs + v] = pack8(dx);
      }
    }
  }
  // A chunk's row of partials starts at a multiple of 8 floats: 16-byte stores.
  float4* part = (float4*)(partials + (long long)blockIdx.x * dim);
#pragma unroll
  for (int i = 0; i < NORM_BWD_VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v >= vecs) break;
    part[2 * v] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    part[2 * v + 1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
  }
}
