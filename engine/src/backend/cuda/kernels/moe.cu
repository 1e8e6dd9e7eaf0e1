// A mixture-of-experts MLP's routing and dispatch: the router's softmax and top-k, its backward,
// the load-balancing statistics, the stable sort of (token, slot) pairs by expert, the gather of
// each pair's input row, the weighted combine of the experts' outputs, and the experts' biases.
// The CPU twin with the derivations is backend/cpu/moe.rs (MixtralTopKRouter, GptOssTopKRouter,
// load_balancing_loss_func in transformers); the experts' GEMMs are cuBLASLt's (moe.rs).
//
// Nothing here adds floats atomically: per-token work belongs to one warp and sums run in a
// fixed order, the pair counts are integers (whose atomic sums do not depend on the order), and
// the sort assigns rows in pair order. Results are deterministic.

#define FULL 0xffffffffu

// Routers (RouterKind): softmax then top-k, its chosen probabilities renormalised or not, or
// top-k then a softmax over the chosen logits.
#define ROUTER_SOFTMAX_TOPK 0
#define ROUTER_SOFTMAX_TOPK_RENORM 1
#define ROUTER_TOPK_SOFTMAX 2

extern __shared__ int moe_smem[];

// A key whose signed order is Rust's f32::total_cmp order (the CPU twin sorts by it): negative
// floats' magnitude bits flipped.
__device__ __forceinline__ int total_key(float x) {
  const int b = __float_as_int(x);
  return b ^ (int)((unsigned)(b >> 31) >> 1);
}

// Expert e's rank among a token's logits, as one integer: larger logit first, then lower index.
__device__ __forceinline__ long long expert_rank(float z, int e) {
  return (long long)total_key(z) * 4294967296LL + (long long)(~(unsigned)e);
}

__device__ __forceinline__ int rank_expert(long long rank) { return (int)~(unsigned)rank; }

__device__ __forceinline__ long long warp_max_ll(long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long other = __shfl_xor_sync(FULL, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// One warp per token: probs[t] = softmax(logits[t]) over E in f32, then the k experts with the
// largest logits in descending order (ties to the lower index), each step taking the best
// rank below the previous one, and their weights. Lane 0 writes experts and weights; the
// weights are formed from the same expressions as the probabilities, so a chosen probability
// equals its weight bit for bit before any renormalisation. weights [T, k], probs [T, E] (f32),
// experts [T, k], logits [T, E].
extern "C" __global__ void moe_route(float* weights, float* probs, int* experts,
                                     const void* logits, int z_f32, long long tokens, int E, int k,
                                     int router) {
  const long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= tokens) return;
  const int lane = threadIdx.x & 31;
  const long long zb = t * E, wb = t * k;
  float m = NEG_INF;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, ld(logits, z_f32, zb + e));
  m = warp_max(m);
  float sum = 0.0f;
  for (int e = lane; e < E; e += 32) sum += expf(ld(logits, z_f32, zb + e) - m);
  sum = warp_sum(sum);
  for (int e = lane; e < E; e += 32) probs[zb + e] = expf(ld(logits, z_f32, zb + e) - m) / sum;

  long long prev = 0;
  float top = 0.0f, total = 0.0f;
  for (int j = 0; j < k; ++j) {
    long long best = (long long)0x8000000000000000ULL;
    for (int e = lane; e < E; e += 32) {
      const long long r = expert_rank(ld(logits, z_f32, zb + e), e);
      if ((j == 0 || r < prev) && r > best) best = r;
    }
    best = warp_max_ll(best);
    prev = best;
    if (lane == 0) {
      const int e = rank_expert(best);
      const float z = ld(logits, z_f32, zb + e);
      experts[wb + j] = e;
      // TopKSoftmax: the first pick holds the largest chosen logit, the softmax's shift.
      if (j == 0) top = z;
      const float w = router == ROUTER_TOPK_SOFTMAX ? expf(z - top) : expf(z - m) / sum;
      total += w;
      weights[wb + j] = w;
    }
  }
  if (lane == 0 && router != ROUTER_SOFTMAX_TOPK)
    for (int j = 0; j < k; ++j) weights[wb + j] /= total;
}

// The routing weights' gradient dp_e with respect to probability (SoftmaxTopK) or chosen logit
// (TopKSoftmax) e: nonzero only where e is chosen (the last slot naming it, as the CPU twin's
// overwrite). `dot` and `S` as in moe_route_backward.
__device__ __forceinline__ float chosen_grad(int e, const int* ids, const void* dw, int dw_f32,
                                            const float* w, long long wb, int k, int router,
                                            float dot, float S) {
  float g = 0.0f;
  for (int j = 0; j < k; ++j) {
    if (ids[j] != e) continue;
    const float dwj = ld(dw, dw_f32, wb + j);
    if (router == ROUTER_SOFTMAX_TOPK) g = dwj;
    else if (router == ROUTER_SOFTMAX_TOPK_RENORM) g = (dwj - dot) / S;
    else g = w[wb + j] * (dwj - dot);
  }
  return g;
}

// One warp per token; the derivation is the CPU twin's. SoftmaxTopK: dp_{e_j} = dw_j, or
// (dw_j − Σ_i dw_i w_i) / S renormalised (S = Σ_j p_{e_j}), then dz = p ⊙ (dp − Σ_e p_e dp_e).
// TopKSoftmax: dz_{e_j} = w_j (dw_j − Σ_i w_i dw_i), 0 elsewhere. With counts, the
// load-balancing loss adds scale · p_e (c_e − Σ_e' p_e' c_e'). dlogits [T, E] (overwrites),
// dweights [T, k], weights [T, k] and probs [T, E] (f32), experts [T, k], counts [E] (f32) or
// null.
extern "C" __global__ void moe_route_backward(void* dlogits, int dz_f32, const void* dweights,
                                              int dw_f32, const float* weights,
                                              const float* probs, const int* experts,
                                              const float* counts, float aux_scale,
                                              long long tokens, int E, int k, int router) {
  const long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= tokens) return;
  const int lane = threadIdx.x & 31;
  const long long zb = t * E, wb = t * k;
  const int* ids = experts + wb;
  const float* p = probs + zb;
  // Per-token scalars over the k slots, in slot order (every lane alike, as the CPU sums them).
  float dot = 0.0f, S = 0.0f;
  if (router != ROUTER_SOFTMAX_TOPK)
    for (int j = 0; j < k; ++j) dot += ld(dweights, dw_f32, wb + j) * weights[wb + j];
  if (router == ROUTER_SOFTMAX_TOPK_RENORM)
    for (int j = 0; j < k; ++j) {
      const int e = ids[j];
      if (e >= 0 && e < E) S += p[e];
    }
  // Σ_e p_e dp_e for the softmax over every expert.
  float pdp = 0.0f;
  if (router != ROUTER_TOPK_SOFTMAX) {
    for (int e = lane; e < E; e += 32)
      pdp += p[e] * chosen_grad(e, ids, dweights, dw_f32, weights, wb, k, router, dot, S);
    pdp = warp_sum(pdp);
  }
  float pc = 0.0f;
  if (counts != nullptr) {
    for (int e = lane; e < E; e += 32) pc += p[e] * counts[e];
    pc = warp_sum(pc);
  }
  for (int e = lane; e < E; e += 32) {
    const float g = chosen_grad(e, ids, dweights, dw_f32, weights, wb, k, router, dot, S);
    float dz = router == ROUTER_TOPK_SOFTMAX ? g : p[e] * (g - pdp);
    if (counts != nullptr) dz += aux_scale * p[e] * (counts[e] - pc);
    st(dlogits, dz_f32, zb + e, dz);
  }
}

// counts[c, e] = the pairs of chunk c routed to expert e, for e < E, and counts[c, E] those
// whose id is outside 0..E (the host refuses the sort then). Integer atomics in shared memory:
// their sum does not depend on the order. counts [chunks, E + 1], experts [pairs]; dynamic
// shared memory (E + 1) ints.
extern "C" __global__ void moe_count(int* counts, const int* experts, long long pairs, int E,
                                     long long chunk) {
  int* hist = moe_smem;
  for (int e = threadIdx.x; e <= E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const long long p0 = (long long)blockIdx.x * chunk;
  const long long p1 = p0 + chunk < pairs ? p0 + chunk : pairs;
  for (long long p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
    const int e = experts[p];
    atomicAdd(&hist[e >= 0 && e < E ? e : E], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += blockDim.x)
    counts[(long long)blockIdx.x * (E + 1) + e] = hist[e];
}

// stats[e] += Σ_c counts[c, e]: the pairs routed to e (exact in f32 below 2^24). stats [E],
// counts [chunks, E + 1].
extern "C" __global__ void moe_count_stats(void* stats, int stats_f32, const int* counts,
                                           int chunks, int E) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    long long n = 0;
    for (int c = 0; c < chunks; ++c) n += counts[(long long)c * (E + 1) + e];
    st(stats, stats_f32, e, ld(stats, stats_f32, e) + (float)n);
  }
}

// The sort's bounds, from moe_count's chunk counts: offsets[e] = the pairs routed to experts
// before e (offsets[E] = the valid pairs, offsets[E + 1] = the invalid ones), and base[c, e] =
// offsets[e] + the pairs of chunks before c routed to e, where chunk c's first pair for e goes.
// One block. offsets [E + 2], base [chunks, E], counts [chunks, E + 1]; dynamic shared memory
// (E + 1) ints.
extern "C" __global__ void moe_sort_bounds(int* offsets, int* base, const int* counts, int chunks,
                                           int E) {
  int* start = moe_smem;
  for (int e = threadIdx.x; e <= E; e += blockDim.x) {
    int n = 0;
    for (int c = 0; c < chunks; ++c) n += counts[(long long)c * (E + 1) + e];
    start[e] = n;
  }
  __syncthreads();
  // An exclusive scan over the experts; E is at most a few thousand, a serial pass is enough.
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < E; ++e) {
      const int n = start[e];
      offsets[e] = run;
      start[e] = run;
      run += n;
    }
    offsets[E] = run;
    offsets[E + 1] = start[E];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = start[e];
    for (int c = 0; c < chunks; ++c) {
      base[(long long)c * E + e] = run;
      run += counts[(long long)c * (E + 1) + e];
    }
  }
}

// The stable scatter: one warp per chunk walks its pairs 32 at a time in order; lanes holding
// the same expert (__match_any_sync) take consecutive rows by lane order from that expert's
// cursor, which the group's last lane then advances. So pair p lands at offsets[e] + (the pairs
// before p routed to e), the CPU twin's counting sort. order and rows [pairs], experts [pairs],
// base [chunks, E]; dynamic shared memory E ints. Pairs with an invalid id get no row.
extern "C" __global__ void moe_sort_scatter(int* order, int* rows, const int* experts,
                                            const int* base, long long pairs, int E,
                                            long long chunk) {
  int* cursor = moe_smem;
  const int lane = threadIdx.x;
  for (int e = lane; e < E; e += 32) cursor[e] = base[(long long)blockIdx.x * E + e];
  __syncwarp();
  const long long p0 = (long long)blockIdx.x * chunk;
  const long long p1 = p0 + chunk < pairs ? p0 + chunk : pairs;
  for (long long g = p0; g < p1; g += 32) {
    const long long p = g + lane;
    const int e = p < p1 ? experts[p] : -1;
    const bool ok = e >= 0 && e < E;
    const unsigned same = __match_any_sync(FULL, ok ? e : -1);
    int r = 0;
    if (ok) {
      r = cursor[e] + __popc(same & ((1u << lane) - 1u));
      order[r] = (int)p;
      rows[p] = r;
    }
    // Every lane has read its cursor before the group's last lane moves it on.
    __syncwarp();
    if (ok && lane == 31 - __clz(same)) cursor[e] = r + 1;
    __syncwarp();
  }
}

// xs[r] = x[order[r] / k]. xs [pairs, hidden], x [T, hidden], order [pairs]. A row outside the
// pairs (which moe_sort never writes) reads as 0 rather than out of bounds.
extern "C" __global__ void moe_gather(void* xs, int xs_f32, const void* x, int x_f32,
                                      const int* order, long long pairs, long long hidden, int k) {
  GRID_STRIDE(i, pairs * hidden) {
    const int p = order[i / hidden];
    const bool ok = p >= 0 && p < pairs;
    st(xs, xs_f32, i, ok ? ld(x, x_f32, (long long)(p / k) * hidden + i % hidden) : 0.0f);
  }
}

// dx[t] = Σ_j dxs[rows[t k + j]], j ascending, in f32. dx [T, hidden] (overwrites), dxs [pairs,
// hidden], rows [pairs].
extern "C" __global__ void moe_gather_backward(void* dx, int dx_f32, const void* dxs, int dxs_f32,
                                               const int* rows, long long tokens, long long pairs,
                                               long long hidden, int k) {
  GRID_STRIDE(i, tokens * hidden) {
    const long long t = i / hidden, c = i % hidden;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int r = rows[t * k + j];
      if (r >= 0 && r < pairs) acc += ld(dxs, dxs_f32, (long long)r * hidden + c);
    }
    st(dx, dx_f32, i, acc);
  }
}

// out[t] = Σ_j weights[t, j] · y[rows[t k + j]], j ascending, in f32. out [T, hidden]
// (overwrites), y [pairs, hidden], weights [T, k] (f32), rows [pairs].
extern "C" __global__ void moe_combine(void* out, int out_f32, const void* y, int y_f32,
                                       const float* weights, const int* rows, long long tokens,
                                       long long pairs, long long hidden, int k) {
  GRID_STRIDE(i, tokens * hidden) {
    const long long t = i / hidden, c = i % hidden;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int r = rows[t * k + j];
      if (r >= 0 && r < pairs) acc += weights[t * k + j] * ld(y, y_f32, (long long)r * hidden + c);
    }
    st(out, out_f32, i, acc);
  }
}

// dy[rows[p]] = weights[p] · dout[p / k] for every pair p. dy [pairs, hidden] (overwrites),
// dout [T, hidden], weights [pairs] (f32), rows [pairs].
extern "C" __global__ void moe_combine_backward_dy(void* dy, int dy_f32, const void* dout,
                                                   int dout_f32, const float* weights,
                                                   const int* rows, long long pairs,
                                                   long long hidden, int k) {
  GRID_STRIDE(i, pairs * hidden) {
    const long long p = i / hidden, c = i % hidden;
    const int r = rows[p];
    if (r >= 0 && r < pairs)
      st(dy, dy_f32, (long long)r * hidden + c, weights[p] * ld(dout, dout_f32, (p / k) * hidden + c));
  }
}

// dweights[p] = dout[p / k] · y[rows[p]] in f32, one warp per pair (lane-strided partials, then
// the warp's fixed reduction tree). dweights [pairs] (f32), dout [T, hidden], y [pairs, hidden].
extern "C" __global__ void moe_combine_backward_dw(float* dweights, const void* dout,
                                                   int dout_f32, const void* y, int y_f32,
                                                   const int* rows, long long pairs,
                                                   long long hidden, int k) {
  const long long p = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (p >= pairs) return;
  const int lane = threadIdx.x & 31;
  const int r = rows[p];
  const bool ok = r >= 0 && r < pairs;
  float acc = 0.0f;
  for (long long c = lane; ok && c < hidden; c += 32)
    acc += ld(dout, dout_f32, (p / k) * hidden + c) * ld(y, y_f32, (long long)r * hidden + c);
  acc = warp_sum(acc);
  if (lane == 0) dweights[p] = acc;
}

// out[r] += bias[e] for the expert e whose rows offsets[e]..offsets[e + 1] hold r: the last
// expert starting at or before r (empty experts before it start there too). out [rows, n],
// bias [E, n], offsets [E + 1].
extern "C" __global__ void grouped_bias_forward(void* out, int out_f32, const void* bias,
                                                int bias_f32, const int* offsets, int E,
                                                long long rows, long long n) {
  GRID_STRIDE(i, rows * n) {
    const int r = (int)(i / n);
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
    }
    st(out, out_f32, i, ld(out, out_f32, i) + ld(bias, bias_f32, (long long)lo * n + i % n));
  }
}

// Qwen2 MoE's shared expert: out[t] += sigmoid(logits[t]) · y[t]. out, y [rows, n] (out
// accumulates), logits [rows] (f32).
extern "C" __global__ void sigmoid_gate_forward(void* out, int out_f32, const void* y, int y_f32,
                                                const float* logits, long long rows, long long n) {
  GRID_STRIDE(i, rows * n) {
    const float g = 1.0f / (1.0f + expf(-logits[i / n]));
    st(out, out_f32, i, ld(out, out_f32, i) + g * ld(y, y_f32, i));
  }
}

// dy[t] = σ(z[t]) · dout[t]; dlogits[t] = σ(1 − σ) · (dout[t] · y[t]) in f32, one warp per row
// (lane-strided partials, then the warp's fixed reduction tree). dy [rows, n] and dlogits
// [rows] overwrite.
extern "C" __global__ void sigmoid_gate_backward(void* dy, int dy_f32, void* dlogits,
                                                 int dlogits_f32, const void* dout, int dout_f32,
                                                 const void* y, int y_f32, const float* logits,
                                                 long long rows, long long n) {
  const long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= rows) return;
  const int lane = threadIdx.x & 31;
  const float g = 1.0f / (1.0f + expf(-logits[t]));
  float acc = 0.0f;
  for (long long c = lane; c < n; c += 32) {
    const float d = ld(dout, dout_f32, t * n + c);
    st(dy, dy_f32, t * n + c, g * d);
    acc += d * ld(y, y_f32, t * n + c);
  }
  acc = warp_sum(acc);
  if (lane == 0) st(dlogits, dlogits_f32, t, g * (1.0f - g) * acc);
}
