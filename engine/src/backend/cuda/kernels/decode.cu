// Attention of a few new queries against the key/value cache: the attention of the inference
// forward (generation), in f32 math on bf16 storage. The CPU twin is backend/cpu/decode.rs, which
// cites the transformers code: softmax(q kᵀ · scale) v over the cached positions the query sees
// (position p sees keys p − W < j ≤ p), query head h reading kv head h / (nq / nkv).
//
// Memory-bound: each query reads its visible key and value rows once. Grid (tokens, nq), DW
// warps per block; block (i, h) is query i (position past + i) and head h. Warp w takes chunks
// of KB consecutive keys, chunk w, w + DW, ... of the query's range, and keeps an online softmax
// (running max m, running sum l, accumulator o) with one head dimension per lane (d = lane +
// 32 c); the KB keys of a chunk are loaded together so their latencies overlap. The block then
// merges its warps' partial results in warp order, with GPT-OSS's sink (a logit with no value
// behind it: exp(sink) in the denominator) when `sinks` is not null. HD is the head-dim bucket
// (32, 64, 128, 256); the actual hd ≤ HD is a runtime value. Every sum runs in a fixed order:
// results are deterministic.

#define DW 8
#define KB 4

// out [tokens, nq hd], q [tokens, nq hd], kc and vc [past + tokens, nkv hd] (all bf16), sinks
// [nq] or null. window: 0 for none.
template <int HD>
__device__ __forceinline__ void attention_decode(bf16* out, const bf16* q, const bf16* kc,
                                                 const bf16* vc, const void* sinks, int sinks_f32,
                                                 int past, int nq, int nkv, int hd, int window,
                                                 float scale, float cap) {
  constexpr int C = HD / 32;
  __shared__ float Ms[DW];
  __shared__ float Ls[DW];
  __shared__ float Os[DW * HD];
  const int i = blockIdx.x, h = blockIdx.y, g = h / (nq / nkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int p = past + i;
  const int first = window > 0 && p + 1 > window ? p + 1 - window : 0;
  const long long kvw = (long long)nkv * hd;
  const bf16* kh = kc + (long long)g * hd;
  const bf16* vh = vc + (long long)g * hd;
  const bf16* qh = q + ((long long)i * nq + h) * hd;

  float qr[C], o[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int d = lane + 32 * c;
    qr[c] = d < hd ? bf2f(qh[d]) : 0.0f;
    o[c] = 0.0f;
  }
  float m = NEG_INF, l = 0.0f;
  for (int j0 = first + warp * KB; j0 <= p; j0 += DW * KB) {
    float s[KB], v[KB][C];
#pragma unroll
    for (int u = 0; u < KB; ++u) {
      const long long row = (long long)(j0 + u) * kvw;
      s[u] = 0.0f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int d = lane + 32 * c;
        const bool ok = j0 + u <= p && d < hd;
        s[u] += ok ? qr[c] * bf2f(kh[row + d]) : 0.0f;
        v[u][c] = ok ? bf2f(vh[row + d]) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < KB; ++u) {
      s[u] = warp_sum(s[u]) * scale;
      // Gemma 2's soft-cap, as the training kernels apply it: cap · tanh(s / cap).
      if (cap > 0.0f) s[u] = tanhf(s[u] / cap) * cap;
    }
#pragma unroll
    for (int u = 0; u < KB; ++u) {
      // Warp-uniform: keys past the query's own position are not visible.
      if (j0 + u > p) break;
      const float mn = fmaxf(m, s[u]);
      const float corr = expf(m - mn), pu = expf(s[u] - mn);
      l = l * corr + pu;
#pragma unroll
      for (int c = 0; c < C; ++c) o[c] = o[c] * corr + pu * v[u][c];
      m = mn;
    }
  }
  // A warp that saw no key leaves m = -inf, l = 0, o = 0: its weight below is exp(-inf) = 0.
  if (lane == 0) {
    Ms[warp] = m;
    Ls[warp] = l;
  }
#pragma unroll
  for (int c = 0; c < C; ++c) Os[warp * HD + lane + 32 * c] = o[c];
  __syncthreads();
  // The sink joins the merge as one more term of the denominator, once per block (a warp
  // starting its online softmax from it would count it DW times).
  const float sink = sinks != nullptr ? ld(sinks, sinks_f32, h) : NEG_INF;
  float mx = sink;
#pragma unroll
  for (int w = 0; w < DW; ++w) mx = fmaxf(mx, Ms[w]);
  float weight[DW], sum = sinks != nullptr ? expf(sink - mx) : 0.0f;
#pragma unroll
  for (int w = 0; w < DW; ++w) {
    weight[w] = expf(Ms[w] - mx);
    sum += Ls[w] * weight[w];
  }
  const float inv = 1.0f / sum;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
#pragma unroll
    for (int w = 0; w < DW; ++w) acc += Os[w * HD + d] * weight[w];
    out[((long long)i * nq + h) * hd + d] = f2bf(acc * inv);
  }
}

#define DECODE_ENTRY_POINT(HD)                                                                 \
  extern "C" __global__ void __launch_bounds__(DW * 32)                                        \
      attention_decode_##HD(bf16* out, const bf16* q, const bf16* kc, const bf16* vc,         \
                            const void* sinks, int sinks_f32, int past, int nq, int nkv,      \
                            int hd, int window, float scale, float cap) {                      \
    attention_decode<HD>(out, q, kc, vc, sinks, sinks_f32, past, nq, nkv, hd, window, scale,   \
                         cap);                                                                 \
  }

DECODE_ENTRY_POINT(32)
DECODE_ENTRY_POINT(64)
DECODE_ENTRY_POINT(128)
DECODE_ENTRY_POINT(256)
