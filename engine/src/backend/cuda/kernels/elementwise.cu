// Residual additions, copies between precisions, reductions, bias and the SwiGLU activation.
// Grid-stride loops over `long long` indices: tensors may exceed 2^31 elements.

#define GRID_STRIDE(i, n) \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

// out = a + b, all [n].
extern "C" __global__ void add(void* out, int out_f32, const void* a, int a_f32, const void* b,
                               int b_f32, long long n) {
  GRID_STRIDE(i, n) { st(out, out_f32, i, ld(a, a_f32, i) + ld(b, b_f32, i)); }
}

// dst += src, both [n].
extern "C" __global__ void add_assign(void* dst, int dst_f32, const void* src, int src_f32,
                                      long long n) {
  GRID_STRIDE(i, n) { st(dst, dst_f32, i, ld(dst, dst_f32, i) + ld(src, src_f32, i)); }
}

// dst = src, both [n]; converts between precisions.
extern "C" __global__ void convert(void* dst, int dst_f32, const void* src, int src_f32,
                                   long long n) {
  GRID_STRIDE(i, n) { st(dst, dst_f32, i, ld(src, src_f32, i)); }
}

// One f64 partial sum (of x or x²) per block over a fixed chunk of `chunk` elements, so the
// result does not depend on the grid: partials [blocks], src [n]. 256 threads.
extern "C" __global__ void sum_partials(double* partials, const void* src, int src_f32,
                                        long long n, long long chunk, int squares) {
  __shared__ double red[32];
  const long long start = (long long)blockIdx.x * chunk;
  const long long end = start + chunk < n ? start + chunk : n;
  double acc = 0.0;
  for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
    double x = (double)ld(src, src_f32, i);
    acc += squares ? x * x : x;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  acc = warp_sum_d(acc);
  if (lane == 0) red[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    double t = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0;
    t = warp_sum_d(t);
    if (lane == 0) partials[blockIdx.x] = t;
  }
}

// out[r, j] += bias[j]. out [rows, n], bias [n].
extern "C" __global__ void bias_forward(void* out, int out_f32, const void* bias, int bias_f32,
                                        long long rows, long long n) {
  GRID_STRIDE(i, rows * n) { st(out, out_f32, i, ld(out, out_f32, i) + ld(bias, bias_f32, i % n)); }
}

// Column sums of a chunk of `rows_per` rows: partials[c, j] = Σ_{r in chunk c} src[r, j].
// Grid (ceil(n / 256), chunks); rows summed in order, so the partial is deterministic.
extern "C" __global__ void colsum_partials(float* partials, const void* src, int src_f32,
                                           long long rows, long long n, long long rows_per) {
  const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const long long r0 = (long long)blockIdx.y * rows_per;
  const long long r1 = r0 + rows_per < rows ? r0 + rows_per : rows;
  float acc = 0.0f;
  for (long long r = r0; r < r1; ++r) acc += ld(src, src_f32, r * n + j);
  partials[(long long)blockIdx.y * n + j] = acc;
}

// dst[j] += Σ_c partials[c, j], chunks added in order (in f64, then rounded once).
// dst [n], partials [chunks, n].
extern "C" __global__ void colsum_finish(void* dst, int dst_f32, const float* partials,
                                         long long chunks, long long n) {
  GRID_STRIDE(j, n) {
    double acc = 0.0;
    for (long long c = 0; c < chunks; ++c) acc += (double)partials[c * n + j];
    st(dst, dst_f32, j, (float)((double)ld(dst, dst_f32, j) + acc));
  }
}

// The gated MLP's activations (act 0: SiLU, 1: GELU with the tanh approximation, as
// torch.nn.functional.gelu(approximate="tanh") computes it in f32) and their derivatives.
__device__ __forceinline__ float glu_act(float g, int act, float* dact) {
  if (act == 0) {
    const float s = 1.0f / (1.0f + expf(-g));
    *dact = s * (1.0f + g * (1.0f - s));
    return g * s;
  }
  const float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2 / pi)
  const float inner = beta * (g + kappa * g * g * g);
  const float t = tanhf(inner);
  *dact = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * beta * (1.0f + 3.0f * kappa * g * g);
  return 0.5f * g * (1.0f + t);
}

// out = act(gate) * up. out [rows, inter], gate_up [rows, 2 inter].
extern "C" __global__ void glu_forward(void* out, int out_f32, const void* gu, int gu_f32,
                                       long long rows, long long inter, int act) {
  GRID_STRIDE(i, rows * inter) {
    const long long r = i / inter, c = i % inter;
    const float g = ld(gu, gu_f32, r * 2 * inter + c);
    const float u = ld(gu, gu_f32, r * 2 * inter + inter + c);
    float dact;
    st(out, out_f32, i, glu_act(g, act, &dact) * u);
  }
}

// d gate = dout · up · act'(g), d up = dout · act(g).
// dgu [rows, 2 inter] (overwrites), dout [rows, inter], gu [rows, 2 inter].
extern "C" __global__ void glu_backward(void* dgu, int dgu_f32, const void* dout, int dout_f32,
                                        const void* gu, int gu_f32, long long rows,
                                        long long inter, int act) {
  GRID_STRIDE(i, rows * inter) {
    const long long r = i / inter, c = i % inter;
    const long long gi = r * 2 * inter + c, ui = gi + inter;
    const float g = ld(gu, gu_f32, gi), u = ld(gu, gu_f32, ui), d = ld(dout, dout_f32, i);
    float dact;
    const float a = glu_act(g, act, &dact);
    st(dgu, dgu_f32, gi, d * u * dact);
    st(dgu, dgu_f32, ui, d * a);
  }
}

// Rotates the first 2 * half dims of every q and k head of qkv [T, width] in place: element e <
// half pairs with e + half and turns by theta = pos[t] * inv_freq[e] (sign -1: the transpose),
// cos and sin multiplied by scale (rounded in f32, as the CPU reference does); dims 2 * half..hd
// pass through (partial rotary).
extern "C" __global__ void rope(void* qkv, int qkv_f32, const int* pos, const void* inv_freq,
                                int freq_f32, long long tokens, long long width, int heads,
                                int hd, int half, float scale, float sign) {
  GRID_STRIDE(i, tokens * heads * half) {
    const long long t = i / (heads * half);
    const int rest = (int)(i % (heads * half));
    const int h = rest / half, e = rest % half;
    const float theta = (float)pos[t] * ld(inv_freq, freq_f32, e);
    float s, c;
    sincosf(theta, &s, &c);
    c *= scale;
    s = sign * (s * scale);
    const long long lo = t * width + (long long)h * hd + e, hi = lo + half;
    const float x = ld(qkv, qkv_f32, lo), y = ld(qkv, qkv_f32, hi);
    st(qkv, qkv_f32, lo, x * c - y * s);
    st(qkv, qkv_f32, hi, y * c + x * s);
  }
}

// out[t] = scale * table[ids[t]]. out [T, hidden], ids [T], table [V, hidden].
extern "C" __global__ void embedding_forward(void* out, int out_f32, const int* ids,
                                             const void* table, int table_f32, long long tokens,
                                             long long hidden, float scale) {
  GRID_STRIDE(i, tokens * hidden) {
    const long long t = i / hidden, c = i % hidden;
    st(out, out_f32, i, scale * ld(table, table_f32, (long long)ids[t] * hidden + c));
  }
}

// dtable[id] += scale * dout[t] for the tokens t of each distinct id, in token order: `order` lists the
// tokens grouped by id (stably), `starts[s]..starts[s + 1]` are the tokens of group s, whose id
// is `rows[s]`. One block per group, so no two blocks touch the same row (deterministic, no
// atomics). dtable [V, hidden], dout [T, hidden].
extern "C" __global__ void embedding_backward(void* dtable, int dtable_f32, const void* dout,
                                              int dout_f32, const int* order, const int* starts,
                                              const int* rows, long long hidden, float scale) {
  const int s = blockIdx.x;
  const long long row = rows[s];
  const int t0 = starts[s], t1 = starts[s + 1];
  for (long long c = threadIdx.x; c < hidden; c += blockDim.x) {
    float acc = ld(dtable, dtable_f32, row * hidden + c);
    for (int k = t0; k < t1; ++k) acc += scale * ld(dout, dout_f32, (long long)order[k] * hidden + c);
    st(dtable, dtable_f32, row * hidden + c, acc);
  }
}
