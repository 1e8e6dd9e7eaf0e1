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
