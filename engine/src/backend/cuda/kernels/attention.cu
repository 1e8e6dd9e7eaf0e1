// FlashAttention-2-style causal grouped-query attention over packed documents with an optional
// sliding window, in f32 math on bf16 storage; [T, T] never exists. Reference:
// eager_attention_forward in transformers' modeling_llama.py, with the mask of packed documents
// (cu_seqlens) and of Hugging Face's sliding window: query i sees key j when both are in the
// same document and i − W < j ≤ i. The derivation of the backward is in the CPU twin
// (backend/cpu/attention.rs): with P_ij = exp(s_ij − lse_i) and D_i = dout_i · out_i,
// dS_ij = P_ij (dout_i · v_j − D_i), dq_i = scale Σ_j dS_ij k_j, dk_j = scale Σ_i dS_ij q_i,
// dv_j = Σ_i P_ij dout_i.
//
// Layout: 4 warps per block. Key/value (or query/dout) tiles of 32 tokens sit in shared memory
// transposed, [d][j] with rows padded to 34 halves (17 words), so that both "lane = token" dot
// products and "lane = dimension" accumulations hit 32 distinct banks. Scores are one key per
// lane; the output accumulators are one head dimension per lane (HD / 32 registers per row).
// HD is the head-dim bucket (32, 64, 128, 256); the actual hd ≤ HD is a runtime value and the
// tiles are zero-padded beyond it. Every sum runs in a fixed order: results are deterministic.

#define KT 32
#define KP 34
#define FULL 0xffffffffu

// Bounds [start, end) of the document holding token t (cu_seqlens has docs + 1 entries).
__device__ __forceinline__ void doc_of(const int* cu, int docs, int t, int* start, int* end) {
  int lo = 0, hi = docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  *start = cu[lo];
  *end = cu[lo + 1];
}

// First key query i sees.
__device__ __forceinline__ int first_key(const int* cu, int docs, int i, int window) {
  int s, e;
  doc_of(cu, docs, i, &s, &e);
  return window > 0 && i - window + 1 > s ? i - window + 1 : s;
}

// One past the last query that sees key j.
__device__ __forceinline__ int query_end(const int* cu, int docs, int j, int window) {
  int s, e;
  doc_of(cu, docs, j, &s, &e);
  return window > 0 && j + window < e ? j + window : e;
}

// Loads tokens [t0, t0 + 32) of head slot `slot` (in head units of the qkv row) into a
// transposed tile [HD][KP]; zero beyond T and beyond hd.
template <int HD>
__device__ __forceinline__ void load_tile_t(bf16* tile, const bf16* src, long long row_width,
                                            long long col, int t0, int T, int hd) {
  for (int idx = threadIdx.x; idx < KT * HD; idx += blockDim.x) {
    const int j = idx / HD, d = idx % HD, t = t0 + j;
    tile[d * KP + j] = (t < T && d < hd) ? src[(long long)t * row_width + col + d] : (bf16)0;
  }
}

// Loads `rows` tokens starting at t0 into a row-major tile [rows][HD].
template <int HD>
__device__ __forceinline__ void load_rows(bf16* tile, int rows, const bf16* src,
                                          long long row_width, long long col, int t0, int T,
                                          int hd) {
  for (int idx = threadIdx.x; idx < rows * HD; idx += blockDim.x) {
    const int j = idx / HD, d = idx % HD, t = t0 + j;
    tile[idx] = (t < T && d < hd) ? src[(long long)t * row_width + col + d] : (bf16)0;
  }
}

// Forward. Grid (ceil(T / (4 QW)), nq), 128 threads; each warp owns QW queries.
// out [T, nq hd] (bf16), lse [T, nq] (f32), qkv [T, (nq + 2 nkv) hd] (bf16).
template <int HD, int QW>
__device__ __forceinline__ void attention_forward(bf16* out, float* lse, const bf16* qkv,
                                                  const int* cu, int docs, int T, int nq,
                                                  int nkv, int hd, int window, float scale) {
  constexpr int BQ = 4 * QW, C = HD / 32;
  __shared__ bf16 Ks[HD * KP];
  __shared__ bf16 Vs[HD * KP];
  __shared__ bf16 Qs[BQ * HD];
  const long long width = (long long)(nq + 2 * nkv) * hd;
  const int h = blockIdx.y, g = h / (nq / nkv);
  const int q0 = blockIdx.x * BQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  load_rows<HD>(Qs, BQ, qkv, width, (long long)h * hd, q0, T, hd);

  float m[QW], l[QW], o[QW][C];
  int first[QW];
#pragma unroll
  for (int r = 0; r < QW; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < C; ++c) o[r][c] = 0.0f;
    const int i = q0 + warp * QW + r;
    first[r] = i < T ? first_key(cu, docs, i, window) : T;
  }
  const int kmin = first_key(cu, docs, q0, window);
  const int kmax = min(q0 + BQ, T) - 1;
  for (int kt = kmin; kt <= kmax; kt += KT) {
    __syncthreads();
    load_tile_t<HD>(Ks, qkv, width, (long long)(nq + g) * hd, kt, T, hd);
    load_tile_t<HD>(Vs, qkv, width, (long long)(nq + nkv + g) * hd, kt, T, hd);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < QW; ++r) {
      const int qi = warp * QW + r, i = q0 + qi;
      // Warp-uniform: this tile holds at least one key of query i, else skip it.
      if (i >= T || kt > i || kt + KT <= first[r]) continue;
      const int key = kt + lane;
      const bool vis = key >= first[r] && key <= i;
      const bf16* q = Qs + qi * HD;
      float s = 0.0f;
      for (int d = 0; d < hd; ++d) s += bf2f(q[d]) * bf2f(Ks[d * KP + lane]);
      s = vis ? s * scale : NEG_INF;
      const float mn = fmaxf(m[r], warp_max(s));
      const float p = vis ? expf(s - mn) : 0.0f;
      const float corr = expf(m[r] - mn);
      l[r] = l[r] * corr + warp_sum(p);
      m[r] = mn;
#pragma unroll
      for (int c = 0; c < C; ++c) o[r][c] *= corr;
      for (int j = 0; j < KT; ++j) {
        const float pj = __shfl_sync(FULL, p, j);
#pragma unroll
        for (int c = 0; c < C; ++c) o[r][c] += pj * bf2f(Vs[(lane + 32 * c) * KP + j]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < QW; ++r) {
    const int i = q0 + warp * QW + r;
    if (i >= T) continue;
    const float inv = 1.0f / l[r];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int d = lane + 32 * c;
      if (d < hd) out[((long long)i * nq + h) * hd + d] = f2bf(o[r][c] * inv);
    }
    if (lane == 0) lse[(long long)i * nq + h] = m[r] + logf(l[r]);
  }
}

// D_i = dout_i · out_i per query and head, one warp each. dsum [T, nq] (f32).
extern "C" __global__ void attention_backward_dot(float* dsum, const bf16* dout, const bf16* out,
                                                  long long rows, int hd) {
  const long long row = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  float acc = 0.0f;
  for (int d = lane; d < hd; d += 32) acc += bf2f(dout[row * hd + d]) * bf2f(out[row * hd + d]);
  acc = warp_sum(acc);
  if (lane == 0) dsum[row] = acc;
}

// dq of every query. Grid (ceil(T / (4 QW)), nq), 128 threads; each warp owns QW queries.
// dqkv [T, width] (writes the query heads), dout [T, nq hd], lse and dsum [T, nq].
template <int HD, int QW>
__device__ __forceinline__ void attention_backward_dq(bf16* dqkv, const bf16* dout,
                                                      const bf16* qkv, const float* lse,
                                                      const float* dsum, const int* cu, int docs,
                                                      int T, int nq, int nkv, int hd, int window,
                                                      float scale) {
  constexpr int BQ = 4 * QW, C = HD / 32;
  __shared__ bf16 Ks[HD * KP];
  __shared__ bf16 Vs[HD * KP];
  __shared__ bf16 Qs[BQ * HD];
  __shared__ bf16 Gs[BQ * HD];
  const long long width = (long long)(nq + 2 * nkv) * hd;
  const int h = blockIdx.y, g = h / (nq / nkv);
  const int q0 = blockIdx.x * BQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  load_rows<HD>(Qs, BQ, qkv, width, (long long)h * hd, q0, T, hd);
  load_rows<HD>(Gs, BQ, dout, (long long)nq * hd, (long long)h * hd, q0, T, hd);

  float dq[QW][C], L[QW], D[QW];
  int first[QW];
#pragma unroll
  for (int r = 0; r < QW; ++r) {
#pragma unroll
    for (int c = 0; c < C; ++c) dq[r][c] = 0.0f;
    const int i = q0 + warp * QW + r;
    first[r] = i < T ? first_key(cu, docs, i, window) : T;
    L[r] = i < T ? lse[(long long)i * nq + h] : 0.0f;
    D[r] = i < T ? dsum[(long long)i * nq + h] : 0.0f;
  }
  const int kmin = first_key(cu, docs, q0, window);
  const int kmax = min(q0 + BQ, T) - 1;
  for (int kt = kmin; kt <= kmax; kt += KT) {
    __syncthreads();
    load_tile_t<HD>(Ks, qkv, width, (long long)(nq + g) * hd, kt, T, hd);
    load_tile_t<HD>(Vs, qkv, width, (long long)(nq + nkv + g) * hd, kt, T, hd);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < QW; ++r) {
      const int qi = warp * QW + r, i = q0 + qi;
      if (i >= T || kt > i || kt + KT <= first[r]) continue;
      const int key = kt + lane;
      const bool vis = key >= first[r] && key <= i;
      const bf16* q = Qs + qi * HD;
      const bf16* go = Gs + qi * HD;
      float s = 0.0f, dp = 0.0f;
      for (int d = 0; d < hd; ++d) {
        s += bf2f(q[d]) * bf2f(Ks[d * KP + lane]);
        dp += bf2f(go[d]) * bf2f(Vs[d * KP + lane]);
      }
      const float p = vis ? expf(s * scale - L[r]) : 0.0f;
      const float ds = p * (dp - D[r]);
      for (int j = 0; j < KT; ++j) {
        const float dsj = __shfl_sync(FULL, ds, j);
#pragma unroll
        for (int c = 0; c < C; ++c) dq[r][c] += dsj * bf2f(Ks[(lane + 32 * c) * KP + j]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < QW; ++r) {
    const int i = q0 + warp * QW + r;
    if (i >= T) continue;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int d = lane + 32 * c;
      if (d < hd) dqkv[(long long)i * width + (long long)h * hd + d] = f2bf(scale * dq[r][c]);
    }
  }
}

// dk and dv of every key. Grid (ceil(T / (4 KW)), nkv), 128 threads; each warp owns KW keys and
// visits, for every query head of its kv head's group in order, the query tiles that see them.
// dqkv [T, width] (writes the key and value heads).
template <int HD, int KW>
__device__ __forceinline__ void attention_backward_dkv(bf16* dqkv, const bf16* dout,
                                                       const bf16* qkv, const float* lse,
                                                       const float* dsum, const int* cu,
                                                       int docs, int T, int nq, int nkv, int hd,
                                                       int window, float scale) {
  constexpr int KB = 4 * KW, C = HD / 32;
  __shared__ bf16 Qt[HD * KP];
  __shared__ bf16 Gt[HD * KP];
  __shared__ bf16 Kr[KB * HD];
  __shared__ bf16 Vr[KB * HD];
  __shared__ float Ls[KT];
  __shared__ float Ds[KT];
  const long long width = (long long)(nq + 2 * nkv) * hd;
  const int g = blockIdx.y, group = nq / nkv;
  const int k0 = blockIdx.x * KB;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  load_rows<HD>(Kr, KB, qkv, width, (long long)(nq + g) * hd, k0, T, hd);
  load_rows<HD>(Vr, KB, qkv, width, (long long)(nq + nkv + g) * hd, k0, T, hd);

  float dk[KW][C], dv[KW][C];
  int qend[KW];
#pragma unroll
  for (int r = 0; r < KW; ++r) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      dk[r][c] = 0.0f;
      dv[r][c] = 0.0f;
    }
    const int j = k0 + warp * KW + r;
    qend[r] = j < T ? query_end(cu, docs, j, window) : 0;
  }
  const int klast = min(k0 + KB, T) - 1;
  const int qmax = query_end(cu, docs, klast, window);
  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    for (int qt = k0; qt < qmax; qt += KT) {
      __syncthreads();
      load_tile_t<HD>(Qt, qkv, width, (long long)h * hd, qt, T, hd);
      load_tile_t<HD>(Gt, dout, (long long)nq * hd, (long long)h * hd, qt, T, hd);
      if (threadIdx.x < KT) {
        const int i = qt + threadIdx.x;
        Ls[threadIdx.x] = i < T ? lse[(long long)i * nq + h] : 0.0f;
        Ds[threadIdx.x] = i < T ? dsum[(long long)i * nq + h] : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < KW; ++r) {
        const int kj = warp * KW + r, j = k0 + kj;
        // Warp-uniform: some query of this tile sees key j, else skip it.
        if (j >= T || qt + KT <= j || qt >= qend[r]) continue;
        const int i = qt + lane;
        const bool vis = i >= j && i < qend[r];
        const bf16* k = Kr + kj * HD;
        const bf16* v = Vr + kj * HD;
        float s = 0.0f, dp = 0.0f;
        for (int d = 0; d < hd; ++d) {
          s += bf2f(Qt[d * KP + lane]) * bf2f(k[d]);
          dp += bf2f(Gt[d * KP + lane]) * bf2f(v[d]);
        }
        const float p = vis ? expf(s * scale - Ls[lane]) : 0.0f;
        const float ds = p * (dp - Ds[lane]);
        for (int q = 0; q < KT; ++q) {
          const float dsq = __shfl_sync(FULL, ds, q), pq = __shfl_sync(FULL, p, q);
#pragma unroll
          for (int c = 0; c < C; ++c) {
            dk[r][c] += dsq * bf2f(Qt[(lane + 32 * c) * KP + q]);
            dv[r][c] += pq * bf2f(Gt[(lane + 32 * c) * KP + q]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < KW; ++r) {
    const int j = k0 + warp * KW + r;
    if (j >= T) continue;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int d = lane + 32 * c;
      if (d < hd) {
        dqkv[(long long)j * width + (long long)(nq + g) * hd + d] = f2bf(scale * dk[r][c]);
        dqkv[(long long)j * width + (long long)(nq + nkv + g) * hd + d] = f2bf(dv[r][c]);
      }
    }
  }
}

#define ATTENTION_ENTRY_POINTS(HD, W)                                                          \
  extern "C" __global__ void __launch_bounds__(128)                                            \
      attention_forward_##HD(bf16* out, float* lse, const bf16* qkv, const int* cu, int docs,  \
                             int T, int nq, int nkv, int hd, int window, float scale) {         \
    attention_forward<HD, W>(out, lse, qkv, cu, docs, T, nq, nkv, hd, window, scale);          \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_##HD(                \
      bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,      \
      const int* cu, int docs, int T, int nq, int nkv, int hd, int window, float scale) {      \
    attention_backward_dq<HD, W>(dqkv, dout, qkv, lse, dsum, cu, docs, T, nq, nkv, hd, window, \
                                 scale);                                                       \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(128) attention_backward_dkv_##HD(               \
      bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,      \
      const int* cu, int docs, int T, int nq, int nkv, int hd, int window, float scale) {      \
    attention_backward_dkv<HD, W>(dqkv, dout, qkv, lse, dsum, cu, docs, T, nq, nkv, hd,        \
                                  window, scale);                                              \
  }

// Rows per warp: 4, or 2 at head_dim 256 to stay within 48 KiB of static shared memory.
ATTENTION_ENTRY_POINTS(32, 4)
ATTENTION_ENTRY_POINTS(64, 4)
ATTENTION_ENTRY_POINTS(128, 4)
ATTENTION_ENTRY_POINTS(256, 2)
