// Residual additions, copies between precisions, reductions, bias and the gated MLP's
// activations, as grid-stride loops (GRID_STRIDE, common.cuh).

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
    long long c = 0;
    // A load waits out the whole memory latency before its add, so eight are issued ahead;
    // they are still added in chunk order.
    for (; c + 8 <= chunks; c += 8) {
      float p[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) p[k] = partials[(c + k) * n + j];
#pragma unroll
      for (int k = 0; k < 8; ++k) acc += (double)p[k];
    }
    for (; c < chunks; ++c) acc += (double)partials[c * n + j];
    st(dst, dst_f32, j, (float)((double)ld(dst, dst_f32, j) + acc));
  }
}

// The gated MLP's activations (act 0: SiLU, 1: GELU with the tanh approximation, as
// torch.nn.functional.gelu(approximate="tanh") computes it in f32) and their derivatives.
// Where a sum of two products leaves the compiler a choice of which one to fuse into an fma, the
// choice is written out (__fmaf_rn), so that the vectorized kernels and the generic ones, which
// inline this into different code, round alike.
__device__ __forceinline__ float glu_act(float g, int act, float* dact) {
  if (act == 0) {
    const float s = 1.0f / (1.0f + expf(-g));
    *dact = s * (1.0f + g * (1.0f - s));
    return g * s;
  }
  const float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2 / pi)
  const float inner = beta * (g + kappa * g * g * g);
  const float t = tanhf(inner);
  *dact = __fmaf_rn(0.5f, 1.0f + t,
                    0.5f * g * (1.0f - t * t) * beta * (1.0f + 3.0f * kappa * g * g));
  return 0.5f * g * (1.0f + t);
}

// GPT-OSS's clamped SwiGLU (act 2, GptOssExperts._apply_gate):
// (clamp(u, −7, 7) + 1) · g' σ(1.702 g') with g' = min(g, 7). torch.clamp passes the gradient
// where min ≤ x ≤ max, bounds included, so d/dg is 0 only above 7 and d/du only outside
// [−7, 7]. The constants are CLAMPED_SWIGLU_ALPHA and CLAMPED_SWIGLU_LIMIT in backend/mod.rs.
#define SWIGLU_ALPHA 1.702f
#define SWIGLU_LIMIT 7.0f

// f(g, u) and its partial derivatives, for every act.
__device__ __forceinline__ float glu_gated(float g, float u, int act, float* dg, float* du) {
  if (act == 2) {
    const float gc = fminf(g, SWIGLU_LIMIT);
    const float uc = fminf(fmaxf(u, -SWIGLU_LIMIT), SWIGLU_LIMIT);
    const float s = 1.0f / (1.0f + expf(-(gc * SWIGLU_ALPHA)));
    const float glu = gc * s;
    *dg = g <= SWIGLU_LIMIT ? (uc + 1.0f) * (s + gc * SWIGLU_ALPHA * s * (1.0f - s)) : 0.0f;
    *du = u >= -SWIGLU_LIMIT && u <= SWIGLU_LIMIT ? glu : 0.0f;
    return (uc + 1.0f) * glu;
  }
  float dact;
  const float a = glu_act(g, act, &dact);
  *dg = dact * u;
  *du = a;
  return a * u;
}

// Where row r's c-th gate and up values sit in gate_up [rows, 2 inter]: [gate | up], or
// interleaved [g0, u0, g1, u1, ...] for the clamped SwiGLU (GPT-OSS stores its experts' gate_up
// projection that way).
__device__ __forceinline__ void glu_columns(long long r, long long c, long long inter, int act,
                                            long long* gi, long long* ui) {
  if (act == 2) {
    *gi = r * 2 * inter + 2 * c;
    *ui = *gi + 1;
  } else {
    *gi = r * 2 * inter + c;
    *ui = *gi + inter;
  }
}

// out = f(gate, up). out [rows, inter], gate_up [rows, 2 inter].
extern "C" __global__ void glu_forward(void* out, int out_f32, const void* gu, int gu_f32,
                                       long long rows, long long inter, int act) {
  GRID_STRIDE(i, rows * inter) {
    long long gi, ui;
    glu_columns(i / inter, i % inter, inter, act, &gi, &ui);
    float dg, du;
    st(out, out_f32, i, glu_gated(ld(gu, gu_f32, gi), ld(gu, gu_f32, ui), act, &dg, &du));
  }
}

// d gate = dout · ∂f/∂g, d up = dout · ∂f/∂u (act 0, 1: up · act'(g) and act(g)).
// dgu [rows, 2 inter] (overwrites), dout [rows, inter], gu [rows, 2 inter].
extern "C" __global__ void glu_backward(void* dgu, int dgu_f32, const void* dout, int dout_f32,
                                        const void* gu, int gu_f32, long long rows,
                                        long long inter, int act) {
  GRID_STRIDE(i, rows * inter) {
    long long gi, ui;
    glu_columns(i / inter, i % inter, inter, act, &gi, &ui);
    const float d = ld(dout, dout_f32, i);
    float dg, du;
    glu_gated(ld(gu, gu_f32, gi), ld(gu, gu_f32, ui), act, &dg, &du);
    st(dgu, dgu_f32, gi, d * dg);
    st(dgu, dgu_f32, ui, d * du);
  }
}

// glu_forward and glu_backward for bf16 buffers, act 0 or 1 ([gate | up] columns), inter a
// multiple of 8 and 16-byte-aligned starts: each thread takes 8 columns of a row as one 16-byte
// vector (`vecs` = inter / 8 per row), rows on the grid's y axis, so there is no per-element
// index division or precision flag. The math is glu_gated's, element for element, so the bits
// match the generic kernels'. Grid (ceil(vecs / blockDim.x), min(rows, 65535)).
template <int ACT>
__device__ __forceinline__ uint4 glu8(uint4 g, uint4 u) {
  float gf[8], uf[8], o[8];
  unpack8(g, gf);
  unpack8(u, uf);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float dg, du;
    o[e] = glu_gated(gf[e], uf[e], ACT, &dg, &du);
  }
  return pack8(o);
}

extern "C" __global__ void glu_forward_vec(uint4* __restrict__ out, const uint4* __restrict__ gu,
                                           long long rows, int vecs, int act) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= vecs) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const uint4 g = gu[r * 2 * vecs + c], u = gu[r * 2 * vecs + vecs + c];
    out[r * vecs + c] = act == 0 ? glu8<0>(g, u) : glu8<1>(g, u);
  }
}

template <int ACT>
__device__ __forceinline__ void glu8_backward(uint4 d, uint4 g, uint4 u, uint4* dg, uint4* du) {
  float df[8], gf[8], uf[8], dgf[8], duf[8];
  unpack8(d, df);
  unpack8(g, gf);
  unpack8(u, uf);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float pg, pu;
    glu_gated(gf[e], uf[e], ACT, &pg, &pu);
    dgf[e] = df[e] * pg;
    duf[e] = df[e] * pu;
  }
  *dg = pack8(dgf);
  *du = pack8(duf);
}

extern "C" __global__ void glu_backward_vec(uint4* __restrict__ dgu,
                                            const uint4* __restrict__ dout,
                                            const uint4* __restrict__ gu, long long rows,
                                            int vecs, int act) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= vecs) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const long long gi = r * 2 * vecs + c, ui = gi + vecs;
    const uint4 d = dout[r * vecs + c], g = gu[gi], u = gu[ui];
    if (act == 0) {
      glu8_backward<0>(d, g, u, &dgu[gi], &dgu[ui]);
    } else {
      glu8_backward<1>(d, g, u, &dgu[gi], &dgu[ui]);
    }
  }
}

// (x, y) turned by (c, s), each sum with its fma written out (see glu_act) so that rope and
// rope_vec round alike.
__device__ __forceinline__ void rotate(float x, float y, float c, float s, float* a, float* b) {
  *a = __fmaf_rn(x, c, -__fmul_rn(y, s));
  *b = __fmaf_rn(x, s, __fmul_rn(y, c));
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
    float a, b;
    rotate(ld(qkv, qkv_f32, lo), ld(qkv, qkv_f32, hi), c, s, &a, &b);
    st(qkv, qkv_f32, lo, a);
    st(qkv, qkv_f32, hi, b);
  }
}

// rope for bf16 qkv with head_dim and half multiples of 8, half <= 256 and a 16-byte-aligned
// start: one block per token. The token's cos and sin are computed once per frequency (not once per
// head) into shared memory, then each thread turns 8 pairs (e, e + half) of one head as two
// 16-byte vectors. Same expressions as rope, so the same bits. Grid (tokens).
extern "C" __global__ void rope_vec(uint4* __restrict__ qkv, const int* __restrict__ pos,
                                    const void* inv_freq, int freq_f32, long long width,
                                    int heads, int hd, int half, float scale, float sign) {
  __shared__ float cs[2][256];
  const long long t = blockIdx.x;
  for (int e = threadIdx.x; e < half; e += blockDim.x) {
    const float theta = (float)pos[t] * ld(inv_freq, freq_f32, e);
    float s, c;
    sincosf(theta, &s, &c);
    cs[0][e] = c * scale;
    cs[1][e] = sign * (s * scale);
  }
  __syncthreads();
  const int nv = half / 8;
  for (int k = threadIdx.x; k < heads * nv; k += blockDim.x) {
    const int h = k / nv, e0 = (k - h * nv) * 8;
    const long long lo = (t * width + (long long)h * hd + e0) / 8, hi = lo + half / 8;
    float x[8], y[8], a[8], b[8];
    unpack8(qkv[lo], x);
    unpack8(qkv[hi], y);
#pragma unroll
    for (int e = 0; e < 8; ++e) rotate(x[e], y[e], cs[0][e0 + e], cs[1][e0 + e], &a[e], &b[e]);
    qkv[lo] = pack8(a);
    qkv[hi] = pack8(b);
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
