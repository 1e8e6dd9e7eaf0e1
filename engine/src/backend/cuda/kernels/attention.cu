// Causal grouped-query attention over packed documents with an optional sliding window, in f32
// math on bf16 storage; [T, T] never exists. Reference: eager_attention_forward in transformers'
// modeling_llama.py, with the mask of packed documents (cu_seqlens) and of Hugging Face's
// sliding window: query i sees key j when both are in the same document and i − W < j ≤ i. The
// derivation of the backward is in the CPU twin (backend/cpu/attention.rs): with
// P_ij = exp(s_ij − lse_i) and D_i = dout_i · out_i, dS_ij = P_ij (dout_i · v_j − D_i),
// dq_i = scale Σ_j dS_ij k_j, dk_j = scale Σ_i dS_ij q_i, dv_j = Σ_i P_ij dout_i.
//
// Two implementations: tensor-core kernels (`flash_*`) for the head sizes models use (64, 80,
// 96, 128, 256), and scalar kernels (`attention_*`) for any other head size up to 256. Both
// are deterministic: no atomics on the data, every sum in a fixed order. Backward:
// `attention_backward_dot` computes D, then one kernel writes dq (one query tile per block, over
// its keys) and another dk and dv (one key tile per block, over the query tiles of every query
// head of its group); or, on request, `flash_backward_fused_*` writes all three (one key block
// and query head per block; partial sums meet in f32 in a fixed order, see there).

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

// ---- tensor-core kernels (head_dim 64, 80, 96, 128, 256) ---------------------------------------
//
// FlashAttention-2 (Dao, 2023) on `mma.sync.m16n8k16` with bf16 operands and f32 accumulators.
// Each warp owns 16 rows of the output tile it computes (queries in the forward and dq kernels,
// keys in the dk/dv kernel) and sweeps the other side's tiles from shared memory, which cp.async
// fills (double-buffered where shared memory allows). Tiles are rows of HD bf16 padded by 8: the
// row stride is then an odd multiple of 16 bytes, so the 8 rows of 16 bytes that one ldmatrix
// phase (or one cp.async pass) touches cover all 32 banks once.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4 gr + tg:
//   A (16 x 16, row):  a0 (gr, 2tg..+1), a1 (gr+8, 2tg..), a2 (gr, 2tg+8..), a3 (gr+8, 2tg+8..)
//   B (16 x 8, col):   b0 (k 2tg..+1, n gr), b1 (k 2tg+8..+9, n gr)
//   C (16 x 8, f32):   c0 c1 (gr, 2tg..+1), c2 c3 (gr+8, 2tg..+1)
// So the accumulator of two adjacent 8-column tiles is, packed to bf16, the A fragment of the
// next product over those 16 columns (P and dS never leave registers). ldmatrix.x4 reads four
// 8 x 8 matrices whose row addresses come from lanes 0-7, 8-15, 16-23, 24-31; without .trans,
// lane l gets row l/4, columns 2(l%4)..+1 of each, with .trans the transpose.
//
// Softmax runs in base 2: scores are scaled by scale·log2(e) and exponentiated with ex2, and the
// lse written out is converted back to base e. A row sees no key in a tile (max = -inf) only
// while other rows of its warp do; its exponent base is then 0, so every p is exp2(-inf) = 0.
//
// Skipping and masking: a query tile sweeps the keys from the first one its first query sees
// (document or window start) to its last query; a key tile sweeps the queries from its first key
// to the last query that sees its last key. A warp skips a tile none of its rows sees, runs a
// tile all its rows fully see without masking, and masks the others element by element: query i
// sees key j when first_key(i) <= j <= i, equivalently j <= i < query_end(j). Rows past T are
// computed on clamped indices (or see nothing) and are never stored.

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// Gemma 2's soft-cap (cap > 0) in the scalar kernels' `_capped` instantiations: a raw score
// s = q · k, whose scaled value s · scale becomes cap · tanh(s · scale / cap), is replaced by that
// capped value divided by scale, so the code around it scales and exponentiates as without a
// cap; returns the cap's slope 1 − tanh², by which dS is multiplied in the backward. tanh goes
// through one exponential (1 − 2 / (1 + e^2x)): fewer registers than tanhf, and an error (about
// 1e-7 absolute) far below the bf16 operands' rounding.
__device__ __forceinline__ float cap_score(float& s, float scale, float cap) {
  const float t = 1.0f - __fdividef(2.0f, 1.0f + __expf(2.0f * (s * scale / cap)));
  s = t * cap / scale;
  return 1.0f - t * t;
}

// ---- PTX wrappers
struct alignas(16) Chunk {
  unsigned x, y, z, w;
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_t(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a b for one 16 x 8 tile, k = 16.
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16x2, `lo` in the low half (the lower column index).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
  return r;
}
// ---- end of PTX wrappers

extern __shared__ Chunk flash_smem[];

// Stops the kernel when the launch gave less dynamic shared memory than its tiles need.
__device__ __forceinline__ void require_smem(unsigned bytes) {
  if (dynamic_smem_bytes() < bytes) __trap();
}

// Starts copying rows [t0, t0 + ROWS) of one head (HD wide, at element `col` of rows `stride`
// elements apart) into a padded tile [ROWS][HD + 8]; rows at or past T read as zero.
template <int ROWS, int HD, int THREADS>
__device__ __forceinline__ void load_rows_async(unsigned tile, const bf16* src, long long stride,
                                                long long col, int t0, int T) {
  constexpr int CH = HD / 8, LD = HD + 8;
#pragma unroll
  for (int u = 0; u < (ROWS * CH + THREADS - 1) / THREADS; ++u) {
    const int c = threadIdx.x + u * THREADS, r = c / CH, k = c % CH, t = t0 + r;
    if ((ROWS * CH) % THREADS == 0 || c < ROWS * CH) {
      const bool ok = t < T;
      cp_async16(tile + 2 * (r * LD + k * 8), src + (long long)(ok ? t : 0) * stride + col + k * 8,
                 ok);
    }
  }
}

// A fragment of rows [row0, row0 + 16) x columns [k0, k0 + 16) of a padded tile.
template <int LD>
__device__ __forceinline__ void frag_a(unsigned (&a)[4], unsigned tile, int row0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm(a, tile + 2 * ((row0 + (lane & 15)) * LD + k0 + (lane >> 4) * 8));
}

// B fragments of X^T for two adjacent 8-column tiles, X [n][k] a padded tile (rows n0..n0+15,
// columns k0..k0+15): b[0], b[1] for n0 and b[2], b[3] for n0 + 8.
template <int LD>
__device__ __forceinline__ void frag_bt(unsigned (&b)[4], unsigned tile, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm(b, tile + 2 * ((n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + k0 + ((lane >> 3) & 1) * 8));
}

// B fragments of X itself, X [k][n] a padded tile (rows k0..k0+15, columns n0..n0+15).
template <int LD>
__device__ __forceinline__ void frag_b(unsigned (&b)[4], unsigned tile, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  ldsm_t(b, tile + 2 * ((k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 + (lane >> 4) * 8));
}

// acc[16 x 8 NT] += A[16 x 16 KC] · X^T, A's fragments from `a` (registers, when AREG) or rows
// row0.. of the tile `as`, X [8 NT][16 KC] the padded tile `x`.
template <int LD, int KC, int NT, bool AREG, int KA>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const unsigned (&a)[KA][4],
                                        unsigned as, int row0, unsigned x) {
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    unsigned f[4];
    if constexpr (AREG) {
#pragma unroll
      for (int r = 0; r < 4; ++r) f[r] = a[kc][r];
    } else {
      frag_a<LD>(f, as, row0, kc * 16);
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned b[4];
      frag_bt<LD>(b, x, np * 16, kc * 16);
      mma(acc[2 * np], f, b[0], b[1]);
      mma(acc[2 * np + 1], f, b[2], b[3]);
    }
  }
}

// acc[16 x 8 NT] += P[16 x 8 KT] · X, P the f32 accumulator of a previous product (rounded to
// bf16 here), X [8 KT][8 NT] the padded tile `x`.
template <int LD, int KT, int NT>
__device__ __forceinline__ void mma_pb(float (&acc)[NT][4], const float (&p)[KT][4],
                                       unsigned x) {
#pragma unroll
  for (int kc = 0; kc < KT / 2; ++kc) {
    const unsigned a[4] = {pack_bf16(p[2 * kc][0], p[2 * kc][1]),
                           pack_bf16(p[2 * kc][2], p[2 * kc][3]),
                           pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]),
                           pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned b[4];
      frag_b<LD>(b, x, kc * 16, np * 16);
      mma(acc[2 * np], a, b[0], b[1]);
      mma(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Loads the A fragments of the warp's 16 rows of a tile into registers.
template <int LD, int KC>
__device__ __forceinline__ void frags_a(unsigned (&a)[KC][4], unsigned tile, int row0) {
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) frag_a<LD>(a[kc], tile, row0, kc * 16);
}

// Writes a warp's 16 x HD accumulator (times `ka` for rows gr, `kb` for rows gr + 8) as bf16 to
// rows [r0, r0 + 16) of `dst` (row stride `stride`, from element `col`), through the warp's own
// 16 rows of the padded tile `stage`; rows at or past T are not written.
template <int HD>
__device__ __forceinline__ void store_rows(bf16* dst, long long stride, long long col, int r0,
                                           int T, const float (&acc)[HD / 8][4], float ka,
                                           float kb, bf16* stage) {
  constexpr int LD = HD + 8, CH = HD / 8;
  const int lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  __syncwarp();
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    *(unsigned*)(stage + gr * LD + n * 8 + 2 * tg) = pack_bf16(acc[n][0] * ka, acc[n][1] * ka);
    *(unsigned*)(stage + (gr + 8) * LD + n * 8 + 2 * tg) =
        pack_bf16(acc[n][2] * kb, acc[n][3] * kb);
  }
  __syncwarp();
#pragma unroll
  for (int u = 0; u < CH / 2; ++u) {
    const int c = lane + 32 * u, r = c / CH, k = c % CH, t = r0 + r;
    if (t < T) {
      *(Chunk*)(dst + (long long)t * stride + col + k * 8) = *(const Chunk*)(stage + r * LD + k * 8);
    }
  }
}

// Largest of a value over the four lanes that share a row.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(FULL, v, 1));
  return fmaxf(v, __shfl_xor_sync(FULL, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(FULL, v, 1);
  return v + __shfl_xor_sync(FULL, v, 2);
}

// Forward. Grid (ceil(T / 16 WARPS), nq), 32 WARPS threads; query tiles in reverse order, so
// the tiles with the most keys start first. Each block takes 16 WARPS queries of head h and
// sweeps key tiles of BK through STAGES shared buffers. QREG keeps the Q fragments in registers.
// out [T, nq, HD] (bf16), lse [T, nq] (f32), qkv [T, (nq + 2 nkv) HD] (bf16).
// Dynamic shared memory: (16 WARPS + 2 STAGES BK) (HD + 8) bf16.
template <int HD, int WARPS, int BK, int STAGES, bool QREG>
__device__ __forceinline__ void flash_forward(bf16* out, float* lse, const bf16* qkv,
                                              const int* cu, int docs, int T, int nq, int nkv,
                                              int window, float scale) {
  constexpr int BQ = 16 * WARPS, LD = HD + 8, THREADS = 32 * WARPS, KC = HD / 16;
  require_smem((BQ + 2 * STAGES * BK) * LD * 2);
  bf16* Qs = (bf16*)flash_smem;
  const unsigned qs = smem_addr(flash_smem), ks = qs + BQ * LD * 2, vs = ks + STAGES * BK * LD * 2;
  const long long width = (long long)(nq + 2 * nkv) * HD;
  const int h = blockIdx.y, g = h / (nq / nkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const long long kcol = (long long)(nq + g) * HD, vcol = (long long)(nq + nkv + g) * HD;

  const int kstart = first_key(cu, docs, q0, window);
  const int ntiles = (min(q0 + BQ, T) - kstart + BK - 1) / BK;
  load_rows_async<BQ, HD, THREADS>(qs, qkv, width, (long long)h * HD, q0, T);
  load_rows_async<BK, HD, THREADS>(ks, qkv, width, kcol, kstart, T);
  load_rows_async<BK, HD, THREADS>(vs, qkv, width, vcol, kstart, T);
  cp_commit();

  // This thread's rows (clamped to the last token) and the warp's bounds.
  const int w0 = q0 + 16 * warp, wlast = min(w0 + 15, T - 1);
  const int ia = min(w0 + gr, T - 1), ib = min(w0 + gr + 8, T - 1);
  const int fa = first_key(cu, docs, ia, window), fb = first_key(cu, docs, ib, window);
  const int wfirst_lo = __shfl_sync(FULL, fa, 0), wfirst_hi = __shfl_sync(FULL, fb, 28);
  const float sc = scale * LOG2E;

  unsigned qf[QREG ? KC : 1][4];
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float ma = NEG_INF, mb = NEG_INF, la = 0.0f, lb = 0.0f;

  for (int t = 0; t < ntiles; ++t) {
    const int k0 = kstart + t * BK;
    if (STAGES == 2 && t + 1 < ntiles) {
      const int nb = (t + 1) & 1;
      load_rows_async<BK, HD, THREADS>(ks + nb * BK * LD * 2, qkv, width, kcol, k0 + BK, T);
      load_rows_async<BK, HD, THREADS>(vs + nb * BK * LD * 2, qkv, width, vcol, k0 + BK, T);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    if constexpr (QREG) {
      if (t == 0) frags_a<LD, KC>(qf, qs, 16 * warp);
    }
    const unsigned kt = ks + (STAGES == 2 ? (t & 1) : 0) * BK * LD * 2;
    const unsigned vt = vs + (STAGES == 2 ? (t & 1) : 0) * BK * LD * 2;
    if (w0 < T && k0 <= wlast && k0 + BK > wfirst_lo) {
      float s[BK / 8][4];
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      mma_abt<LD, KC, BK / 8, QREG>(s, qf, qs, 16 * warp, kt);
      if (!(k0 >= wfirst_hi && k0 + BK - 1 <= w0)) {
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = k0 + n * 8 + 2 * tg + e;
            if (j < fa || j > ia) s[n][e] = NEG_INF;
            if (j < fb || j > ib) s[n][2 + e] = NEG_INF;
          }
        }
      }
      float xa = NEG_INF, xb = NEG_INF;
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        xa = fmaxf(xa, fmaxf(s[n][0], s[n][1]));
        xb = fmaxf(xb, fmaxf(s[n][2], s[n][3]));
      }
      const float na = fmaxf(ma, quad_max(xa) * sc), nb = fmaxf(mb, quad_max(xb) * sc);
      const float ua = na == NEG_INF ? 0.0f : na, ub = nb == NEG_INF ? 0.0f : nb;
      const float ca = ex2(ma - ua), cb = ex2(mb - ub);
      ma = na;
      mb = nb;
      float suma = 0.0f, sumb = 0.0f;
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        s[n][0] = ex2(fmaf(s[n][0], sc, -ua));
        s[n][1] = ex2(fmaf(s[n][1], sc, -ua));
        s[n][2] = ex2(fmaf(s[n][2], sc, -ub));
        s[n][3] = ex2(fmaf(s[n][3], sc, -ub));
        suma += s[n][0] + s[n][1];
        sumb += s[n][2] + s[n][3];
      }
      la = la * ca + suma;
      lb = lb * cb + sumb;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        o[n][0] *= ca;
        o[n][1] *= ca;
        o[n][2] *= cb;
        o[n][3] *= cb;
      }
      mma_pb<LD, BK / 8, HD / 8>(o, s, vt);
    }
    __syncthreads();
    if (STAGES == 1 && t + 1 < ntiles) {
      load_rows_async<BK, HD, THREADS>(ks, qkv, width, kcol, k0 + BK, T);
      load_rows_async<BK, HD, THREADS>(vs, qkv, width, vcol, k0 + BK, T);
      cp_commit();
    }
  }
  if (w0 >= T) return;
  la = quad_sum(la);
  lb = quad_sum(lb);
  // Every stored row saw at least itself, so l >= 1.
  store_rows<HD>(out, (long long)nq * HD, (long long)h * HD, w0, T, o, 1.0f / la, 1.0f / lb,
                 Qs + 16 * warp * LD);
  if (tg == 0) {
    if (w0 + gr < T) lse[(long long)(w0 + gr) * nq + h] = ma * LN2 + logf(la);
    if (w0 + gr + 8 < T) lse[(long long)(w0 + gr + 8) * nq + h] = mb * LN2 + logf(lb);
  }
}

// dq. Grid (ceil(T / 16 WARPS), nq), 32 WARPS threads, query tiles in reverse order. Each block
// takes 16 WARPS queries of head h and sweeps the key tiles they see, recomputing
// P = exp(s − lse) and dS = P (dout · v − D): dq_i = scale Σ_j dS_ij k_j.
// dqkv [T, width] (writes the query heads), dout [T, nq, HD], lse and dsum [T, nq].
// Dynamic shared memory: (32 WARPS + 2 STAGES BK) (HD + 8) bf16.
template <int HD, int WARPS, int BK, int STAGES, bool QREG>
__device__ __forceinline__ void flash_backward_dq(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                  const float* lse, const float* dsum,
                                                  const int* cu, int docs, int T, int nq,
                                                  int nkv, int window, float scale) {
  constexpr int BQ = 16 * WARPS, LD = HD + 8, THREADS = 32 * WARPS, KC = HD / 16;
  require_smem((2 * BQ + 2 * STAGES * BK) * LD * 2);
  bf16* Qs = (bf16*)flash_smem;
  const unsigned qs = smem_addr(flash_smem), gs = qs + BQ * LD * 2, ks = gs + BQ * LD * 2;
  const unsigned vs = ks + STAGES * BK * LD * 2;
  const long long width = (long long)(nq + 2 * nkv) * HD;
  const int h = blockIdx.y, g = h / (nq / nkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const long long kcol = (long long)(nq + g) * HD, vcol = (long long)(nq + nkv + g) * HD;

  const int kstart = first_key(cu, docs, q0, window);
  const int ntiles = (min(q0 + BQ, T) - kstart + BK - 1) / BK;
  load_rows_async<BQ, HD, THREADS>(qs, qkv, width, (long long)h * HD, q0, T);
  load_rows_async<BQ, HD, THREADS>(gs, dout, (long long)nq * HD, (long long)h * HD, q0, T);
  load_rows_async<BK, HD, THREADS>(ks, qkv, width, kcol, kstart, T);
  load_rows_async<BK, HD, THREADS>(vs, qkv, width, vcol, kstart, T);
  cp_commit();

  const int w0 = q0 + 16 * warp, wlast = min(w0 + 15, T - 1);
  const int ia = min(w0 + gr, T - 1), ib = min(w0 + gr + 8, T - 1);
  const int fa = first_key(cu, docs, ia, window), fb = first_key(cu, docs, ib, window);
  const int wfirst_lo = __shfl_sync(FULL, fa, 0), wfirst_hi = __shfl_sync(FULL, fb, 28);
  const float sc = scale * LOG2E;
  const float La = lse[(long long)ia * nq + h] * LOG2E, Lb = lse[(long long)ib * nq + h] * LOG2E;
  const float Da = dsum[(long long)ia * nq + h], Db = dsum[(long long)ib * nq + h];

  unsigned qf[QREG ? KC : 1][4], gf[QREG ? KC : 1][4];
  float dq[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  for (int t = 0; t < ntiles; ++t) {
    const int k0 = kstart + t * BK;
    if (STAGES == 2 && t + 1 < ntiles) {
      const int nb = (t + 1) & 1;
      load_rows_async<BK, HD, THREADS>(ks + nb * BK * LD * 2, qkv, width, kcol, k0 + BK, T);
      load_rows_async<BK, HD, THREADS>(vs + nb * BK * LD * 2, qkv, width, vcol, k0 + BK, T);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    if constexpr (QREG) {
      if (t == 0) {
        frags_a<LD, KC>(qf, qs, 16 * warp);
        frags_a<LD, KC>(gf, gs, 16 * warp);
      }
    }
    const unsigned kt = ks + (STAGES == 2 ? (t & 1) : 0) * BK * LD * 2;
    const unsigned vt = vs + (STAGES == 2 ? (t & 1) : 0) * BK * LD * 2;
    if (w0 < T && k0 <= wlast && k0 + BK > wfirst_lo) {
      float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
      }
      mma_abt<LD, KC, BK / 8, QREG>(s, qf, qs, 16 * warp, kt);
      mma_abt<LD, KC, BK / 8, QREG>(dp, gf, gs, 16 * warp, vt);
      const bool full = k0 >= wfirst_hi && k0 + BK - 1 <= w0;
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = k0 + n * 8 + 2 * tg + e;
          const bool va = full || (j >= fa && j <= ia), vb = full || (j >= fb && j <= ib);
          const float pa = va ? ex2(fmaf(s[n][e], sc, -La)) : 0.0f;
          const float pb = vb ? ex2(fmaf(s[n][2 + e], sc, -Lb)) : 0.0f;
          s[n][e] = pa * (dp[n][e] - Da);
          s[n][2 + e] = pb * (dp[n][2 + e] - Db);
        }
      }
      mma_pb<LD, BK / 8, HD / 8>(dq, s, kt);
    }
    __syncthreads();
    if (STAGES == 1 && t + 1 < ntiles) {
      load_rows_async<BK, HD, THREADS>(ks, qkv, width, kcol, k0 + BK, T);
      load_rows_async<BK, HD, THREADS>(vs, qkv, width, vcol, k0 + BK, T);
      cp_commit();
    }
  }
  if (w0 >= T) return;
  store_rows<HD>(dqkv, width, (long long)h * HD, w0, T, dq, scale, scale, Qs + 16 * warp * LD);
}

// dk and dv (MODE 3), dv alone (MODE 1) or dk alone (MODE 2). Grid (ceil(T / 16 WARPS), nkv),
// 32 WARPS threads. Each block takes 16 WARPS keys of kv head g and, for every query head of
// its group in order, sweeps the query tiles of BQ that see them (so each sum over heads and
// queries runs in a fixed order): with S^T = K Q^T, P^T = exp(S^T − lse), dS^T = P^T (V dout^T
// − D), dv_j = Σ_i P_ij dout_i and dk_j = scale Σ_i dS_ij q_i.
// dqkv [T, width] (writes the key and/or value heads), dout [T, nq, HD], lse and dsum [T, nq].
// Dynamic shared memory: (MODE & 2 ? 2 : 1) 16 WARPS (HD + 8) bf16
//   + STAGES (2 BQ (HD + 8) bf16 + 2 BQ f32).
template <int HD, int WARPS, int BQ, int STAGES, int MODE>
__device__ __forceinline__ void flash_backward_dkv(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                   const float* lse, const float* dsum,
                                                   const int* cu, int docs, int T, int nq,
                                                   int nkv, int window, float scale) {
  constexpr bool DV = MODE & 1, DK = MODE & 2;
  constexpr int BKV = 16 * WARPS, LD = HD + 8, THREADS = 32 * WARPS, KC = HD / 16;
  constexpr int STAGE = 2 * BQ * LD * 2 + 2 * BQ * 4;  // bytes: Q, dout, lse, D
  require_smem((DK ? 2 : 1) * BKV * LD * 2 + STAGES * STAGE);
  bf16* Ks = (bf16*)flash_smem;
  bf16* Vs = Ks + BKV * LD;  // only with DK
  const unsigned ks = smem_addr(flash_smem), vs = ks + BKV * LD * 2;
  const unsigned stages = ks + (DK ? 2 : 1) * BKV * LD * 2;
  const long long width = (long long)(nq + 2 * nkv) * HD, gstride = (long long)nq * HD;
  const int g = blockIdx.y, group = nq / nkv;
  const int k0 = blockIdx.x * BKV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const long long kcol = (long long)(nq + g) * HD, vcol = (long long)(nq + nkv + g) * HD;

  const int klast = min(k0 + BKV, T) - 1;
  const int nqt = (query_end(cu, docs, klast, window) - k0 + BQ - 1) / BQ;
  const int total = group * nqt;
  // Issues the copies of step `it` (query head, query tile) into stage buffer `b`.
  auto issue = [&](int it, int b) {
    const int h = g * group + it / nqt, qt = k0 + (it % nqt) * BQ;
    const unsigned st = stages + b * STAGE;
    load_rows_async<BQ, HD, THREADS>(st, qkv, width, (long long)h * HD, qt, T);
    load_rows_async<BQ, HD, THREADS>(st + BQ * LD * 2, dout, gstride, (long long)h * HD, qt, T);
    for (int c = threadIdx.x; c < 2 * BQ; c += THREADS) {
      const int i = qt + c % BQ;
      const float* src = c < BQ ? lse : dsum;
      cp_async4(st + 2 * BQ * LD * 2 + 4 * c, src + (long long)(i < T ? i : 0) * nq + h, i < T);
    }
  };
  load_rows_async<BKV, HD, THREADS>(ks, qkv, width, kcol, k0, T);
  if (DK) load_rows_async<BKV, HD, THREADS>(vs, qkv, width, vcol, k0, T);
  issue(0, 0);
  cp_commit();

  // This thread's keys; a key past T sees no query (query_end 0).
  const int w0 = k0 + 16 * warp, ja = w0 + gr, jb = w0 + gr + 8;
  const int ea = ja < T ? query_end(cu, docs, ja, window) : 0;
  const int eb = jb < T ? query_end(cu, docs, jb, window) : 0;
  // The warp's smallest and largest query end.
  const int wend_lo = w0 + 15 < T ? __shfl_sync(FULL, ea, 0) : 0;
  int wend_hi = max(ea, eb);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) wend_hi = max(wend_hi, __shfl_xor_sync(FULL, wend_hi, o));
  const float sc = scale * LOG2E;

  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
  }
  const unsigned none[1][4] = {{0, 0, 0, 0}};

  for (int it = 0; it < total; ++it) {
    const int qt = k0 + (it % nqt) * BQ;
    if (STAGES == 2 && it + 1 < total) {
      issue(it + 1, (it + 1) & 1);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const int b = STAGES == 2 ? (it & 1) : 0;
    const unsigned qt_s = stages + b * STAGE, gt_s = qt_s + BQ * LD * 2;
    const float* Lt = (const float*)((const unsigned char*)(Ks + (DK ? 2 : 1) * BKV * LD) +
                                     b * STAGE + 2 * BQ * LD * 2);
    const float* Dt = Lt + BQ;
    if (w0 < T && qt + BQ > w0 && qt < wend_hi) {
      float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
      for (int n = 0; n < BQ / 8; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
      }
      mma_abt<LD, KC, BQ / 8, false>(s, none, ks, 16 * warp, qt_s);
      if (DK) mma_abt<LD, KC, BQ / 8, false>(dp, none, vs, 16 * warp, gt_s);
      const bool full = qt >= w0 + 15 && qt + BQ <= wend_lo;
#pragma unroll
      for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = n * 8 + 2 * tg + e, i = qt + c;
          const float L = Lt[c] * LOG2E;
          const bool va = full || (i >= ja && i < ea), vb = full || (i >= jb && i < eb);
          const float pa = va ? ex2(fmaf(s[n][e], sc, -L)) : 0.0f;
          const float pb = vb ? ex2(fmaf(s[n][2 + e], sc, -L)) : 0.0f;
          s[n][e] = pa;
          s[n][2 + e] = pb;
          if (DK) {
            dp[n][e] = pa * (dp[n][e] - Dt[c]);
            dp[n][2 + e] = pb * (dp[n][2 + e] - Dt[c]);
          }
        }
      }
      if (DV) mma_pb<LD, BQ / 8, HD / 8>(dv, s, gt_s);
      if (DK) mma_pb<LD, BQ / 8, HD / 8>(dk, dp, qt_s);
    }
    __syncthreads();
    if (STAGES == 1 && it + 1 < total) {
      issue(it + 1, 0);
      cp_commit();
    }
  }
  if (w0 >= T) return;
  if (DK) store_rows<HD>(dqkv, width, kcol, w0, T, dk, scale, scale, Ks + 16 * warp * LD);
  if (DV) {
    store_rows<HD>(dqkv, width, vcol, w0, T, dv, 1.0f, 1.0f, (DK ? Vs : Ks) + 16 * warp * LD);
  }
}

// ---- fused backward (dq, dk and dv in one kernel) ------------------------------------------------
//
// Five products per tile where the dq and dk/dv kernels above run seven (both recompute S and
// dP). A block takes BKV = 16 WARPS keys and one query head h, and sweeps the query tiles of BQ
// that see those keys, as the dk/dv kernel does for each head of its group; the tile's dS, put
// in shared memory as bf16 (the rounding the dk product gives it), yields the tile's dq
// contribution dS K. Contributions meet in `acc` [T, width] (f32, the layout of dqkv) in a
// fixed order, so a run is deterministic with no atomics on the data:
//   dq of (head h, query tile): the key blocks that sweep the tile, from the one holding it
//     (which stores) down to the lowest (which adds, scales and writes bf16 into dqkv); block j
//     reads the running sum once the (top - j) blocks above it have added, on a counter per
//     (head, tile).
//   dk and dv of (kv head g, key block): the query heads of g in order, the first storing, the
//     last adding, scaling dk and writing both as bf16; a counter per (kv head, key block).
// Blocks claim their work by ticket (`sync[0]`), so a block only waits for blocks holding
// earlier tickets, which are running or done: no deadlock, whatever order the hardware starts
// blocks in. Tickets take key blocks from the last to the first (heads fastest): a block's dq
// predecessors for a tile reach it BKV / BQ iterations earlier in their own sweeps and started
// no later, so in the steady state nobody waits; the price is that the longest blocks (the
// first keys of long documents) start last.
// Each tile's running dq is copied in (cp.async.cg) one iteration ahead, with its Q and dout, so
// the sweep waits on no load; the count it waits for was reached iterations before, and is read
// an iteration before it is looked at. Counts are published as CUTLASS's semaphores do: the
// block's barrier after every thread's writes, then one thread's fence and add; the thread that
// finds a count short polls it with acquire, and the block's barrier follows either way.
// Running sums go through L2 only (st.global.cg, ld.global.cg, cp.async.cg: no stale L1 line).
// sync [4 + nq ceil(ceil(T / BQ) / 4) 4 + nkv ceil(T / BKV)] is zeroed before the launch; acc needs no
// initialisation (every element read was stored first). Grid ceil(T / BKV) nq, 32 WARPS
// threads. Dynamic shared memory: 2 BKV (HD + 8) bf16 (K, V) + 2 (2 BQ (HD + 8) bf16 + 2 BQ
// f32) (Q, dout, lse and D of two tiles) + BQ (BKV + 8) bf16 (dS) + 2 BQ (HD + 8) f32 (the
// running dq of two tiles).

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One thread publishes what its block wrote before the barrier it has just passed.
__device__ __forceinline__ void release_add(int* p, int v) {
  asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v)
               : "memory");
}

// Polls until *p reaches `target` (one thread; the block's next barrier passes it on).
__device__ __forceinline__ void poll_until(const int* p, int target) {
  while (ld_acquire(p) < target) asm volatile("nanosleep.u32 64;\n" ::: "memory");
}


__device__ __forceinline__ void ld_cg2(const float* p, float& x, float& y) {
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];\n" : "=f"(x), "=f"(y) : "l"(p) : "memory");
}

__device__ __forceinline__ void st_cg2(float* p, float x, float y) {
  asm volatile("st.global.cg.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
}

template <int HD, int WARPS, int BQ>
__device__ __forceinline__ void flash_backward_fused(bf16* dqkv, float* acc, int* sync,
                                                     const bf16* dout, const bf16* qkv,
                                                     const float* lse, const float* dsum,
                                                     const int* cu, int docs, int T, int nq,
                                                     int nkv, int window, float scale) {
  constexpr int BKV = 16 * WARPS, LD = HD + 8, LDS = BKV + 8, LDA = HD + 8;
  constexpr int THREADS = 32 * WARPS, KC = HD / 16;
  constexpr int STAGE = 2 * BQ * LD * 2 + 2 * BQ * 4;  // bytes: Q, dout, lse, D
  constexpr int KV_BYTES = 2 * BKV * LD * 2, DS_BYTES = BQ * LDS * 2, DQ_BYTES = BQ * LDA * 4;
  // A tile's dq: BQ / 16 row groups times CG column groups of DQC columns, one per warp.
  constexpr int RG = BQ / 16, CG = WARPS / RG, DQC = HD / CG, DQN = DQC / 8;
  static_assert(WARPS % RG == 0 && HD % CG == 0 && DQC % 16 == 0, "dq split across warps");
  require_smem(KV_BYTES + 2 * STAGE + DS_BYTES + 2 * DQ_BYTES);
  __shared__ int ticket_s;
  // Four counts of a head's tiles, copied in an iteration before thread 0 looks at one.
  __shared__ __align__(16) int seen_s[4];
  if (threadIdx.x == 0) ticket_s = atomicAdd(sync, 1);
  __syncthreads();
  const int ticket = ticket_s;
  const int nkb = (T + BKV - 1) / BKV, nqtiles = (T + BQ - 1) / BQ;
  const int j = nkb - 1 - ticket / nq, h = ticket % nq;
  const int group = nq / nkv, g = h / group, hg = h % group;
  // A head's counts start on 16 bytes, so four of them are one cp.async.
  const long long qpad = (nqtiles + 3) & ~3;
  int* qsem = sync + 4 + h * qpad;

  unsigned char* base = (unsigned char*)flash_smem;
  const unsigned ks = smem_addr(flash_smem), vs = ks + BKV * LD * 2, stages = ks + KV_BYTES;
  const unsigned ds = stages + 2 * STAGE, dqs = ds + DS_BYTES;
  bf16* dS = (bf16*)(base + KV_BYTES + 2 * STAGE);
  const float* dQ = (const float*)(base + KV_BYTES + 2 * STAGE + DS_BYTES);
  const long long width = (long long)(nq + 2 * nkv) * HD, gstride = (long long)nq * HD;
  const long long qcol = (long long)h * HD;
  const long long kcol = (long long)(nq + g) * HD, vcol = (long long)(nq + nkv + g) * HD;
  const int k0 = j * BKV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;

  const int klast = min(k0 + BKV, T) - 1;
  const int nqt = (query_end(cu, docs, klast, window) - k0 + BQ - 1) / BQ;
  // Tiles from prev_end on are swept by no lower key block: this block adds their dq last.
  const int prev_end = j > 0 ? query_end(cu, docs, k0 - 1, window) : 0;
  // Issues the copies of query tile `it` into buffer `b`: Q, dout, lse and D, and the tile's
  // running dq unless this block holds the tile (and adds first).
  auto issue = [&](int it, int b) {
    const int qt = k0 + it * BQ;
    const unsigned st = stages + b * STAGE;
    load_rows_async<BQ, HD, THREADS>(st, qkv, width, qcol, qt, T);
    load_rows_async<BQ, HD, THREADS>(st + BQ * LD * 2, dout, gstride, qcol, qt, T);
    for (int c = threadIdx.x; c < 2 * BQ; c += THREADS) {
      const int i = qt + c % BQ;
      const float* src = c < BQ ? lse : dsum;
      cp_async4(st + 2 * BQ * LD * 2 + 4 * c, src + (long long)(i < T ? i : 0) * nq + h, i < T);
    }
    if (qt >= k0 + BKV) {
      constexpr int CH = HD / 4;
#pragma unroll
      for (int u = 0; u < (BQ * CH + THREADS - 1) / THREADS; ++u) {
        const int c = threadIdx.x + u * THREADS, r = c / CH, k = c % CH, t = qt + r;
        if ((BQ * CH) % THREADS == 0 || c < BQ * CH) {
          const bool ok = t < T;
          cp_async16(dqs + b * DQ_BYTES + 4 * (r * LDA + k * 4),
                     acc + (long long)(ok ? t : 0) * width + qcol + k * 4, ok);
        }
      }
    }
  };
  // Thread 0: waits until the blocks above have added their dq to tile `it`, unless the count
  // copied in an iteration ago already showed it (an older copy only ever shows less).
  auto wait_tile = [&](int it) {
    const int qt = k0 + it * BQ, i = qt / BQ;
    if (qt >= k0 + BKV && seen_s[i & 3] < qt / BKV - j) poll_until(qsem + i, qt / BKV - j);
  };
  load_rows_async<BKV, HD, THREADS>(ks, qkv, width, kcol, k0, T);
  load_rows_async<BKV, HD, THREADS>(vs, qkv, width, vcol, k0, T);
  issue(0, 0);  // tile 0 is this block's own: no running dq to read
  cp_commit();

  // This thread's keys, as in the dk/dv kernel; a key past T sees no query.
  const int w0 = k0 + 16 * warp, ja = w0 + gr, jb = w0 + gr + 8;
  const int ea = ja < T ? query_end(cu, docs, ja, window) : 0;
  const int eb = jb < T ? query_end(cu, docs, jb, window) : 0;
  const int wend_lo = w0 + 15 < T ? __shfl_sync(FULL, ea, 0) : 0;
  int wend_hi = max(ea, eb);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) wend_hi = max(wend_hi, __shfl_xor_sync(FULL, wend_hi, o));
  const float sc = scale * LOG2E;
  // This warp's part of a tile's dq: rows dq_r0.. (16) and columns dq_c0.. (DQC).
  const int dq_r0 = 16 * (warp % RG), dq_c0 = DQC * (warp / RG);

  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
  }
  const unsigned none[1][4] = {{0, 0, 0, 0}};
  // The tile whose count this block raises once its barrier has passed its writes (-1: none).
  int pending = -1;

  for (int it = 0; it < nqt; ++it) {
    const int qt = k0 + it * BQ, b = it & 1;
    cp_wait<0>();
    if (threadIdx.x == 0 && it + 1 < nqt) wait_tile(it + 1);
    __syncthreads();  // tile it is in, tile it + 1's sum is complete, buffers b ^ 1 are free
    if (threadIdx.x == 0 && pending >= 0) release_add(qsem + pending, 1);
    pending = -1;
    if (it + 1 < nqt) {
      issue(it + 1, b ^ 1);
      cp_commit();
    }
    const unsigned qt_s = stages + b * STAGE, gt_s = qt_s + BQ * LD * 2;
    const float* Lt = (const float*)(base + KV_BYTES + b * STAGE + 2 * BQ * LD * 2);
    const float* Dt = Lt + BQ;
    const bool active = w0 < T && qt + BQ > w0 && qt < wend_hi;
    float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
    }
    if (active) {
      mma_abt<LD, KC, BQ / 8, false>(s, none, ks, 16 * warp, qt_s);
      mma_abt<LD, KC, BQ / 8, false>(dp, none, vs, 16 * warp, gt_s);
      const bool full = qt >= w0 + 15 && qt + BQ <= wend_lo;
#pragma unroll
      for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = n * 8 + 2 * tg + e, i = qt + c;
          const float L = Lt[c] * LOG2E;
          const bool va = full || (i >= ja && i < ea), vb = full || (i >= jb && i < eb);
          const float pa = va ? ex2(fmaf(s[n][e], sc, -L)) : 0.0f;
          const float pb = vb ? ex2(fmaf(s[n][2 + e], sc, -L)) : 0.0f;
          s[n][e] = pa;
          s[n][2 + e] = pb;
          dp[n][e] = pa * (dp[n][e] - Dt[c]);
          dp[n][2 + e] = pb * (dp[n][2 + e] - Dt[c]);
        }
      }
    }
    // This warp's rows of dS^T into the tile's dS [query][key] (zero where nothing is seen).
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = n * 8 + 2 * tg + e;
        dS[q * LDS + 16 * warp + gr] = f2bf(dp[n][e]);
        dS[q * LDS + 16 * warp + gr + 8] = f2bf(dp[n][2 + e]);
      }
    }
    __syncthreads();  // the dS tile is complete
    // The count of tile it + 2 (with its neighbours), copied now so that the next iteration
    // rarely waits for a load.
    if (threadIdx.x == 0 && it + 2 < nqt && qt + 2 * BQ >= k0 + BKV) {
      cp_async16(smem_addr(seen_s), qsem + (((qt + 2 * BQ) / BQ) & ~3), true);
      cp_commit();
    }
    if (active) {
      mma_pb<LD, BQ / 8, HD / 8>(dv, s, gt_s);
      mma_pb<LD, BQ / 8, HD / 8>(dk, dp, qt_s);
    }
    float dq[DQN][4];
#pragma unroll
    for (int n = 0; n < DQN; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BKV / 16; ++kk) {
      unsigned a[4];
      frag_a<LDS>(a, ds, dq_r0, kk * 16);
#pragma unroll
      for (int np = 0; np < DQN / 2; ++np) {
        unsigned bk[4];
        frag_b<LD>(bk, ks, kk * 16, dq_c0 + np * 16);
        mma(dq[2 * np], a, bk[0], bk[1]);
        mma(dq[2 * np + 1], a, bk[2], bk[3]);
      }
    }
    const bool top = qt < k0 + BKV;      // this block holds the tile: it adds first
    const bool bottom = qt >= prev_end;  // no lower block sweeps the tile: it adds last
    const float* sum = dQ + b * (DQ_BYTES / 4);
#pragma unroll
    for (int n = 0; n < DQN; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = dq_r0 + gr + 8 * half, t = qt + r, c = dq_c0 + n * 8 + 2 * tg;
        float x = dq[n][2 * half], y = dq[n][2 * half + 1];
        if (!top) {
          x += sum[r * LDA + c];
          y += sum[r * LDA + c + 1];
        }
        if (t < T) {
          if (bottom) {
            *(unsigned*)(dqkv + (long long)t * width + qcol + c) = pack_bf16(x * scale, y * scale);
          } else {
            st_cg2(acc + (long long)t * width + qcol + c, x, y);
          }
        }
      }
    }
    if (!bottom) pending = qt / BQ;
  }
  __syncthreads();
  if (threadIdx.x == 0 && pending >= 0) release_add(qsem + pending, 1);

  // dk and dv: the query heads of group g add in order; the last one writes dqkv.
  int* kvsem = sync + 4 + nq * qpad + (long long)g * nkb + j;
  if (hg > 0) {
    if (threadIdx.x == 0) poll_until(kvsem, hg);
    __syncthreads();
  }
  const bool last_head = hg == group - 1;
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = w0 + gr + 8 * half, c = n * 8 + 2 * tg;
      if (key >= T) continue;
      float kx = dk[n][2 * half], ky = dk[n][2 * half + 1];
      float vx = dv[n][2 * half], vy = dv[n][2 * half + 1];
      float* ka = acc + (long long)key * width + kcol + c;
      float* va = acc + (long long)key * width + vcol + c;
      if (hg > 0) {
        float x, y;
        ld_cg2(ka, x, y);
        kx += x;
        ky += y;
        ld_cg2(va, x, y);
        vx += x;
        vy += y;
      }
      if (last_head) {
        *(unsigned*)(dqkv + (long long)key * width + kcol + c) = pack_bf16(kx * scale, ky * scale);
        *(unsigned*)(dqkv + (long long)key * width + vcol + c) = pack_bf16(vx, vy);
      } else {
        st_cg2(ka, kx, ky);
        st_cg2(va, vx, vy);
      }
    }
  }
  if (!last_head) {
    __syncthreads();
    if (threadIdx.x == 0) release_add(kvsem, 1);
  }
}

#define FLASH_ENTRY_POINTS(HD, FWD_WARPS, FWD_BK, FWD_STAGES, DQ_WARPS, DQ_BK, DQ_STAGES, QREG) \
  extern "C" __global__ void __launch_bounds__(32 * FWD_WARPS)                                  \
      flash_forward_##HD(bf16* out, float* lse, const bf16* qkv, const int* cu, int docs, int T, \
                         int nq, int nkv, int window, float scale) {                             \
    flash_forward<HD, FWD_WARPS, FWD_BK, FWD_STAGES, QREG>(out, lse, qkv, cu, docs, T, nq, nkv,  \
                                                           window, scale);                       \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(32 * DQ_WARPS) flash_backward_dq_##HD(            \
      bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,        \
      const int* cu, int docs, int T, int nq, int nkv, int window, float scale) {                \
    flash_backward_dq<HD, DQ_WARPS, DQ_BK, DQ_STAGES, QREG>(dqkv, dout, qkv, lse, dsum, cu,      \
                                                            docs, T, nq, nkv, window, scale);    \
  }

#define FLASH_DKV_ENTRY_POINT(NAME, HD, WARPS, BQ, STAGES, MODE)                                 \
  extern "C" __global__ void __launch_bounds__(32 * WARPS)                                       \
      NAME(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,   \
           const int* cu, int docs, int T, int nq, int nkv, int window, float scale) {           \
    flash_backward_dkv<HD, WARPS, BQ, STAGES, MODE>(dqkv, dout, qkv, lse, dsum, cu, docs, T, nq, \
                                                    nkv, window, scale);                         \
  }

#define FLASH_FUSED_ENTRY_POINT(HD, WARPS, BQ)                                                   \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) flash_backward_fused_##HD(            \
      bf16* dqkv, float* acc, int* sync, const bf16* dout, const bf16* qkv, const float* lse,    \
      const float* dsum, const int* cu, int docs, int T, int nq, int nkv, int window,            \
      float scale) {                                                                             \
    flash_backward_fused<HD, WARPS, BQ>(dqkv, acc, sync, dout, qkv, lse, dsum, cu, docs, T, nq,  \
                                        nkv, window, scale);                                     \
  }

// Tile shapes, mirrored by `attention.rs` (which sizes the dynamic shared memory from them):
// every kernel fits the 99 KiB a block may have on sm_86 and sm_89. At head_dim 256 the
// Q fragments stay in shared memory and dk and dv take one kernel each (both accumulators of
// 16 keys x 256 would need 256 registers a thread).
FLASH_ENTRY_POINTS(64, 4, 64, 2, 4, 32, 2, true)
FLASH_ENTRY_POINTS(80, 4, 64, 2, 4, 32, 2, true)
FLASH_ENTRY_POINTS(96, 4, 64, 2, 4, 32, 2, true)
FLASH_ENTRY_POINTS(128, 4, 64, 2, 4, 32, 2, true)
FLASH_ENTRY_POINTS(256, 4, 32, 1, 2, 16, 2, false)
FLASH_DKV_ENTRY_POINT(flash_backward_dkv_64, 64, 4, 32, 2, 3)
FLASH_DKV_ENTRY_POINT(flash_backward_dkv_80, 80, 4, 32, 2, 3)
FLASH_DKV_ENTRY_POINT(flash_backward_dkv_96, 96, 4, 32, 2, 3)
FLASH_DKV_ENTRY_POINT(flash_backward_dkv_128, 128, 4, 32, 2, 3)
FLASH_DKV_ENTRY_POINT(flash_backward_dv_256, 256, 4, 32, 1, 1)
FLASH_DKV_ENTRY_POINT(flash_backward_dk_256, 256, 2, 16, 2, 2)
// The fused backward needs more shared memory than sm_86 and sm_89 give a block at head_dim
// 128 (145 KiB); `attention.rs` takes it only where the device allows.
FLASH_FUSED_ENTRY_POINT(64, 8, 32)
FLASH_FUSED_ENTRY_POINT(128, 8, 32)

// ---- Hopper forward (sm_90a: warpgroup MMAs) ---------------------------------------------------
//
// The forward on `wgmma.mma_async` (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-
// Accumulate"): a warpgroup (4 warps, 128 threads) multiplies 64 rows at once with operands the
// tensor cores read straight from shared memory through a descriptor, so the ldmatrix traffic
// that bounds the mma.sync kernels above is gone. Compiled only for sm_90a (the Rust side
// compiles for it on sm_90 devices); elsewhere the entry points trap and are never launched.
//
// Tiles sit in shared memory in the 128-byte swizzled layout: a tile of R rows is HD / 64
// "halves" of R rows x 64 columns (128 bytes a row), each 1024-byte aligned, the 16-byte chunk c
// of row r at chunk c ^ (r % 8) of its row (the swizzle the hardware undoes from the address
// bits, so each 8-row group must start on 1024 bytes). Descriptors: start address >> 4 (bits
// 0-13), leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), 1 in bits 62-63
// for the 128-byte swizzle.
//   K-major operands (Q and K in Q K^T: the head dimension, which the product sums over, is
//   contiguous): stride 1024 (8 rows of 128 bytes), leading unused; the k-th 16 columns of a
//   half start 32 k bytes into it.
//   MN-major operand (V in P V: the product sums over keys, the head is contiguous,
//   "imm-trans-b" 1): leading = the offset between halves (R x 128 bytes), stride 1024 (8
//   keys); the k-th 16 keys start 2048 k bytes in.
// The m64nN accumulator gives warp w of the warpgroup rows 16 w .. 16 w + 15 in the mma.sync C
// layout repeated over N / 8 column tiles, and an A operand in registers takes the mma.sync A
// layout: P goes from the S accumulator into P V exactly as `mma_pb` does above.
//
// cp.async writes shared memory through the generic proxy and wgmma reads it through the async
// proxy: every thread fences (fence.proxy.async) after its copies land, before the barrier.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lead,
                                                      unsigned stride) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lead >> 4) << 16) |
         ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wg_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

__device__ __forceinline__ void proxy_fence() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous
// MMAs that own it (they write it between issue and wait).
template <int NT>
__device__ __forceinline__ void wg_hold(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
  }
}

// d[64 x N] (+)= A[64 x 16] B[16 x N]: `wg_ss` with A and B in shared memory, `wg_rs` with A in
// registers; TB 0 reads B K-major, 1 MN-major; acc 0 overwrites d.
template <int TB>
__device__ __forceinline__ void wg_ss(float (&d)[8][4], unsigned long long a, unsigned long long b,
                                      int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 "
      "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a), "l"(b), "r"(acc), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wg_rs(float (&d)[8][4], const unsigned (&a)[4],
                                      unsigned long long b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 "
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wg_ss(float (&d)[16][4], unsigned long long a, unsigned long long b,
                                      int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 "
      "}, %64, %65, p, 1, 1, 0, %67;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(a), "l"(b), "r"(acc), "n"(TB));
}

template <int TB>
__device__ __forceinline__ void wg_rs(float (&d)[16][4], const unsigned (&a)[4],
                                      unsigned long long b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 "
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TB));
}


// Starts copying rows [t0, t0 + ROWS) of one head (HD wide, at element `col` of rows `stride`
// elements apart) into a swizzled tile (see above); rows at or past T read as zero.
template <int ROWS, int HD, int THREADS>
__device__ __forceinline__ void load_swizzled(unsigned tile, const bf16* src, long long stride,
                                              long long col, int t0, int T) {
  constexpr int CH = HD / 8;
  static_assert(ROWS * CH % THREADS == 0, "whole passes");
#pragma unroll
  for (int u = 0; u < ROWS * CH / THREADS; ++u) {
    const int c = threadIdx.x + u * THREADS, r = c / CH, k = c % CH, t = t0 + r;
    const bool ok = t < T;
    const unsigned dst = tile + (k >> 3) * (ROWS * 128) + r * 128 + (((k & 7) ^ (r & 7)) << 4);
    cp_async16(dst, src + (long long)(ok ? t : 0) * stride + col + k * 8, ok);
  }
}

// Forward. Grid (ceil(T / 128), nq), 256 threads: two warpgroups of 64 queries, query tiles in
// reverse order. The block sweeps key tiles of 128 through two shared buffers, the next tile's
// copy in flight while the current one is multiplied. Same masking, skipping and base-2
// softmax as `flash_forward`, skipping decided per warpgroup (its four warps multiply together).
// Dynamic shared memory: 1024 (alignment) + Q (128 HD bf16) + two stages of K and V.
template <int HD>
__device__ __forceinline__ void hopper_forward(bf16* out, float* lse, const bf16* qkv,
                                               const int* cu, int docs, int T, int nq, int nkv,
                                               int window, float scale) {
  constexpr int BQ = 128, BK = 128, THREADS = 256, KC = HD / 16;
  constexpr unsigned QB = BQ * HD * 2, KB = BK * HD * 2;
  require_smem(1024 + QB + 4 * KB);
  const unsigned raw = smem_addr(flash_smem), base = (raw + 1023) & ~1023u;
  const unsigned qs = base, ks = qs + QB, vs = ks + 2 * KB;
  const long long width = (long long)(nq + 2 * nkv) * HD;
  const int h = blockIdx.y, g = h / (nq / nkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tg = lane & 3;
  const long long kcol = (long long)(nq + g) * HD, vcol = (long long)(nq + nkv + g) * HD;

  const int kstart = first_key(cu, docs, q0, window);
  const int ntiles = (min(q0 + BQ, T) - kstart + BK - 1) / BK;
  load_swizzled<BQ, HD, THREADS>(qs, qkv, width, (long long)h * HD, q0, T);
  load_swizzled<BK, HD, THREADS>(ks, qkv, width, kcol, kstart, T);
  load_swizzled<BK, HD, THREADS>(vs, qkv, width, vcol, kstart, T);
  cp_commit();

  // The warpgroup's rows and bounds (uniform over its 128 threads), then the warp's and this
  // thread's (rows clamped to the last token).
  const int g0 = q0 + 64 * wg, glast = min(g0 + 63, T - 1);
  const bool active = g0 < T;
  const int gfirst = first_key(cu, docs, min(g0, T - 1), window);
  const int w0 = g0 + 16 * warp, wlast = min(w0 + 15, T - 1);
  const int wfirst_hi = first_key(cu, docs, wlast, window);
  const int ia = min(w0 + gr, T - 1), ib = min(w0 + gr + 8, T - 1);
  const int fa = first_key(cu, docs, ia, window), fb = first_key(cu, docs, ib, window);
  const float sc = scale * LOG2E;
  const unsigned qa = qs + 64 * wg * 128;

  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float ma = NEG_INF, mb = NEG_INF, la = 0.0f, lb = 0.0f;

  for (int t = 0; t < ntiles; ++t) {
    const int k0 = kstart + t * BK;
    const unsigned kt = ks + (t & 1) * KB, vt = vs + (t & 1) * KB;
    cp_wait<0>();
    proxy_fence();
    __syncthreads();
    // Every thread is past the previous tile: its buffers take the next one.
    if (t + 1 < ntiles) {
      load_swizzled<BK, HD, THREADS>(ks + ((t + 1) & 1) * KB, qkv, width, kcol, k0 + BK, T);
      load_swizzled<BK, HD, THREADS>(vs + ((t + 1) & 1) * KB, qkv, width, vcol, k0 + BK, T);
      cp_commit();
    }
    if (!active || k0 > glast || k0 + BK <= gfirst) continue;
    float s[BK / 8][4];
    wg_fence();
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      const unsigned off = (c & 3) * 32;
      wg_ss<0>(s, wg_desc(qa + (c >> 2) * (BQ * 128) + off, 16, 1024),
               wg_desc(kt + (c >> 2) * (BK * 128) + off, 16, 1024), c > 0);
    }
    wg_commit();
    wg_wait_all();
    wg_hold(s);
    if (!(k0 >= wfirst_hi && k0 + BK - 1 <= w0)) {
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = k0 + n * 8 + 2 * tg + e;
          if (j < fa || j > ia) s[n][e] = NEG_INF;
          if (j < fb || j > ib) s[n][2 + e] = NEG_INF;
        }
      }
    }
    float xa = NEG_INF, xb = NEG_INF;
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      xa = fmaxf(xa, fmaxf(s[n][0], s[n][1]));
      xb = fmaxf(xb, fmaxf(s[n][2], s[n][3]));
    }
    const float na = fmaxf(ma, quad_max(xa) * sc), nb = fmaxf(mb, quad_max(xb) * sc);
    const float ua = na == NEG_INF ? 0.0f : na, ub = nb == NEG_INF ? 0.0f : nb;
    const float ca = ex2(ma - ua), cb = ex2(mb - ub);
    ma = na;
    mb = nb;
    float suma = 0.0f, sumb = 0.0f;
    unsigned p[BK / 16][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = ex2(fmaf(s[n][0], sc, -ua));
      s[n][1] = ex2(fmaf(s[n][1], sc, -ua));
      s[n][2] = ex2(fmaf(s[n][2], sc, -ub));
      s[n][3] = ex2(fmaf(s[n][3], sc, -ub));
      suma += s[n][0] + s[n][1];
      sumb += s[n][2] + s[n][3];
      p[n >> 1][(n & 1) * 2] = pack_bf16(s[n][0], s[n][1]);
      p[n >> 1][(n & 1) * 2 + 1] = pack_bf16(s[n][2], s[n][3]);
    }
    la = la * ca + suma;
    lb = lb * cb + sumb;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      o[n][0] *= ca;
      o[n][1] *= ca;
      o[n][2] *= cb;
      o[n][3] *= cb;
    }
    wg_fence();
#pragma unroll
    for (int c = 0; c < BK / 16; ++c) {
      wg_rs<1>(o, p[c], wg_desc(vt + c * 2048, BK * 128, 1024), 1);
    }
    wg_commit();
    wg_wait_all();
    wg_hold(o);
  }
  // Every warpgroup is done with the tiles: the first K buffer stages the output.
  cp_wait<0>();
  __syncthreads();
  if (!active) return;
  la = quad_sum(la);
  lb = quad_sum(lb);
  bf16* stage = (bf16*)((char*)flash_smem + (ks - raw)) + (64 * wg + 16 * warp) * (HD + 8);
  // Every stored row saw at least itself, so l >= 1.
  store_rows<HD>(out, (long long)nq * HD, (long long)h * HD, w0, T, o, 1.0f / la, 1.0f / lb,
                 stage);
  if (tg == 0) {
    if (w0 + gr < T) lse[(long long)(w0 + gr) * nq + h] = ma * LN2 + logf(la);
    if (w0 + gr + 8 < T) lse[(long long)(w0 + gr + 8) * nq + h] = mb * LN2 + logf(lb);
  }
}

// dq on sm_90a. Grid (ceil(T / 128), nq), 256 threads: two warpgroups of 64 queries of head h,
// query tiles in reverse order, sweeping key tiles of 64 through two shared buffers. As
// `flash_backward_dq`: S = Q K^T and dP = dout V^T (both operands K-major in shared memory),
// dS = P (dP − D) in registers, dq += dS K (dS from registers, K MN-major).
// Dynamic shared memory: 1024 (alignment) + Q and dout (2 x 128 HD bf16) + two stages of K and V
// (4 x 64 HD bf16).
template <int HD>
__device__ __forceinline__ void hopper_backward_dq(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                   const float* lse, const float* dsum,
                                                   const int* cu, int docs, int T, int nq,
                                                   int nkv, int window, float scale) {
  constexpr int BQ = 128, BK = 64, THREADS = 256, KC = HD / 16;
  constexpr unsigned QB = BQ * HD * 2, KB = BK * HD * 2;
  require_smem(1024 + 2 * QB + 4 * KB);
  const unsigned raw = smem_addr(flash_smem), base = (raw + 1023) & ~1023u;
  const unsigned qs = base, gs = qs + QB, ks = gs + QB, vs = ks + 2 * KB;
  const long long width = (long long)(nq + 2 * nkv) * HD;
  const int h = blockIdx.y, g = h / (nq / nkv);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tg = lane & 3;
  const long long kcol = (long long)(nq + g) * HD, vcol = (long long)(nq + nkv + g) * HD;

  const int kstart = first_key(cu, docs, q0, window);
  const int ntiles = (min(q0 + BQ, T) - kstart + BK - 1) / BK;
  load_swizzled<BQ, HD, THREADS>(qs, qkv, width, (long long)h * HD, q0, T);
  load_swizzled<BQ, HD, THREADS>(gs, dout, (long long)nq * HD, (long long)h * HD, q0, T);
  load_swizzled<BK, HD, THREADS>(ks, qkv, width, kcol, kstart, T);
  load_swizzled<BK, HD, THREADS>(vs, qkv, width, vcol, kstart, T);
  cp_commit();

  const int g0 = q0 + 64 * wg, glast = min(g0 + 63, T - 1);
  const bool active = g0 < T;
  const int gfirst = first_key(cu, docs, min(g0, T - 1), window);
  const int w0 = g0 + 16 * warp, wlast = min(w0 + 15, T - 1);
  const int wfirst_hi = first_key(cu, docs, wlast, window);
  const int ia = min(w0 + gr, T - 1), ib = min(w0 + gr + 8, T - 1);
  const int fa = first_key(cu, docs, ia, window), fb = first_key(cu, docs, ib, window);
  const float sc = scale * LOG2E;
  const float La = lse[(long long)ia * nq + h] * LOG2E, Lb = lse[(long long)ib * nq + h] * LOG2E;
  const float Da = dsum[(long long)ia * nq + h], Db = dsum[(long long)ib * nq + h];
  const unsigned qa = qs + 64 * wg * 128, ga = gs + 64 * wg * 128;

  float dq[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  for (int t = 0; t < ntiles; ++t) {
    const int k0 = kstart + t * BK;
    const unsigned kt = ks + (t & 1) * KB, vt = vs + (t & 1) * KB;
    cp_wait<0>();
    proxy_fence();
    __syncthreads();
    if (t + 1 < ntiles) {
      load_swizzled<BK, HD, THREADS>(ks + ((t + 1) & 1) * KB, qkv, width, kcol, k0 + BK, T);
      load_swizzled<BK, HD, THREADS>(vs + ((t + 1) & 1) * KB, qkv, width, vcol, k0 + BK, T);
      cp_commit();
    }
    if (!active || k0 > glast || k0 + BK <= gfirst) continue;
    float s[BK / 8][4], dp[BK / 8][4];
    wg_fence();
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      const unsigned off = (c >> 2) * (BQ * 128) + (c & 3) * 32;
      const unsigned long long kd = wg_desc(kt + (c >> 2) * (BK * 128) + (c & 3) * 32, 16, 1024);
      wg_ss<0>(s, wg_desc(qa + off, 16, 1024), kd, c > 0);
    }
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      const unsigned off = (c >> 2) * (BQ * 128) + (c & 3) * 32;
      const unsigned long long vd = wg_desc(vt + (c >> 2) * (BK * 128) + (c & 3) * 32, 16, 1024);
      wg_ss<0>(dp, wg_desc(ga + off, 16, 1024), vd, c > 0);
    }
    wg_commit();
    wg_wait_all();
    wg_hold(s);
    wg_hold(dp);
    const bool full = k0 >= wfirst_hi && k0 + BK - 1 <= w0;
    unsigned ds[BK / 16][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = k0 + n * 8 + 2 * tg + e;
        const bool va = full || (j >= fa && j <= ia), vb = full || (j >= fb && j <= ib);
        const float pa = va ? ex2(fmaf(s[n][e], sc, -La)) : 0.0f;
        const float pb = vb ? ex2(fmaf(s[n][2 + e], sc, -Lb)) : 0.0f;
        s[n][e] = pa * (dp[n][e] - Da);
        s[n][2 + e] = pb * (dp[n][2 + e] - Db);
      }
      ds[n >> 1][(n & 1) * 2] = pack_bf16(s[n][0], s[n][1]);
      ds[n >> 1][(n & 1) * 2 + 1] = pack_bf16(s[n][2], s[n][3]);
    }
    wg_fence();
#pragma unroll
    for (int c = 0; c < BK / 16; ++c) {
      wg_rs<1>(dq, ds[c], wg_desc(kt + c * 2048, BK * 128, 1024), 1);
    }
    wg_commit();
    wg_wait_all();
    wg_hold(dq);
  }
  cp_wait<0>();
  __syncthreads();
  if (!active) return;
  bf16* stage = (bf16*)((char*)flash_smem + (ks - raw)) + (64 * wg + 16 * warp) * (HD + 8);
  store_rows<HD>(dqkv, width, (long long)h * HD, w0, T, dq, scale, scale, stage);
}

// dk and dv on sm_90a. Grid (ceil(T / 128), nkv), 256 threads: two warpgroups of 64 keys of kv
// head g; for every query head of the group in order, the block sweeps the query tiles of BQ
// that see its keys (each sum over heads and queries in a fixed order), as
// `flash_backward_dkv`: S^T = K Q^T and dP^T = V dout^T (K-major operands), P^T and dS^T in
// registers, dv += P^T dout and dk += dS^T Q (dout and Q MN-major).
// Dynamic shared memory: 1024 (alignment) + K and V (2 x 128 HD bf16) + two stages of Q, dout
// (2 x BQ HD bf16), lse and D (2 x BQ f32), each stage rounded up to 1024 bytes.
template <int HD, int BQ>
__device__ __forceinline__ void hopper_backward_dkv(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                    const float* lse, const float* dsum,
                                                    const int* cu, int docs, int T, int nq,
                                                    int nkv, int window, float scale) {
  constexpr int BKV = 128, THREADS = 256, KC = HD / 16;
  constexpr unsigned KB = BKV * HD * 2, QT = BQ * HD * 2;
  constexpr unsigned STAGE = (2 * QT + 2 * BQ * 4 + 1023) / 1024 * 1024;
  require_smem(1024 + 2 * KB + 2 * STAGE);
  const unsigned raw = smem_addr(flash_smem), base = (raw + 1023) & ~1023u;
  const unsigned ks = base, vs = ks + KB, stages = vs + KB;
  const long long width = (long long)(nq + 2 * nkv) * HD, gstride = (long long)nq * HD;
  const int g = blockIdx.y, group = nq / nkv;
  const int k0 = blockIdx.x * BKV;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tg = lane & 3;
  const long long kcol = (long long)(nq + g) * HD, vcol = (long long)(nq + nkv + g) * HD;

  const int klast = min(k0 + BKV, T) - 1;
  const int nqt = (query_end(cu, docs, klast, window) - k0 + BQ - 1) / BQ;
  const int total = group * nqt;
  auto issue = [&](int it, int b) {
    const int h = g * group + it / nqt, qt = k0 + (it % nqt) * BQ;
    const unsigned st = stages + b * STAGE;
    load_swizzled<BQ, HD, THREADS>(st, qkv, width, (long long)h * HD, qt, T);
    load_swizzled<BQ, HD, THREADS>(st + QT, dout, gstride, (long long)h * HD, qt, T);
    for (int c = threadIdx.x; c < 2 * BQ; c += THREADS) {
      const int i = qt + c % BQ;
      const float* src = c < BQ ? lse : dsum;
      cp_async4(st + 2 * QT + 4 * c, src + (long long)(i < T ? i : 0) * nq + h, i < T);
    }
  };
  load_swizzled<BKV, HD, THREADS>(ks, qkv, width, kcol, k0, T);
  load_swizzled<BKV, HD, THREADS>(vs, qkv, width, vcol, k0, T);
  issue(0, 0);
  cp_commit();

  // The warpgroup's keys (uniform over its threads), the warp's and this thread's; a key past
  // T sees no query (query_end 0).
  const int g0 = k0 + 64 * wg;
  const bool active = g0 < T;
  const int gend = active ? query_end(cu, docs, min(g0 + 63, T - 1), window) : 0;
  const int w0 = g0 + 16 * warp, ja = w0 + gr, jb = w0 + gr + 8;
  const int ea = ja < T ? query_end(cu, docs, ja, window) : 0;
  const int eb = jb < T ? query_end(cu, docs, jb, window) : 0;
  const int wend_lo = w0 + 15 < T ? query_end(cu, docs, w0, window) : 0;
  const float sc = scale * LOG2E;
  const unsigned ka = ks + 64 * wg * 128, va = vs + 64 * wg * 128;
  const float* smem_f = (const float*)((const char*)flash_smem + (stages - raw));

  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) {
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
  }

  for (int it = 0; it < total; ++it) {
    const int qt = k0 + (it % nqt) * BQ, b = it & 1;
    cp_wait<0>();
    proxy_fence();
    __syncthreads();
    if (it + 1 < total) {
      issue(it + 1, (it + 1) & 1);
      cp_commit();
    }
    if (!active || qt + BQ <= g0 || qt >= gend) continue;
    const unsigned qt_s = stages + b * STAGE, gt_s = qt_s + QT;
    const float* Lt = smem_f + (b * STAGE + 2 * QT) / 4;
    const float* Dt = Lt + BQ;
    float s[BQ / 8][4], dp[BQ / 8][4];
    wg_fence();
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      const unsigned off = (c >> 2) * (BKV * 128) + (c & 3) * 32;
      const unsigned qoff = (c >> 2) * (BQ * 128) + (c & 3) * 32;
      wg_ss<0>(s, wg_desc(ka + off, 16, 1024), wg_desc(qt_s + qoff, 16, 1024), c > 0);
    }
#pragma unroll
    for (int c = 0; c < KC; ++c) {
      const unsigned off = (c >> 2) * (BKV * 128) + (c & 3) * 32;
      const unsigned qoff = (c >> 2) * (BQ * 128) + (c & 3) * 32;
      wg_ss<0>(dp, wg_desc(va + off, 16, 1024), wg_desc(gt_s + qoff, 16, 1024), c > 0);
    }
    wg_commit();
    wg_wait_all();
    wg_hold(s);
    wg_hold(dp);
    const bool full = qt >= w0 + 15 && qt + BQ <= wend_lo;
    unsigned pf[BQ / 16][4], df[BQ / 16][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = n * 8 + 2 * tg + e, i = qt + c;
        const float L = Lt[c] * LOG2E, D = Dt[c];
        const bool oka = full || (i >= ja && i < ea), okb = full || (i >= jb && i < eb);
        const float pa = oka ? ex2(fmaf(s[n][e], sc, -L)) : 0.0f;
        const float pb = okb ? ex2(fmaf(s[n][2 + e], sc, -L)) : 0.0f;
        s[n][e] = pa;
        s[n][2 + e] = pb;
        dp[n][e] = pa * (dp[n][e] - D);
        dp[n][2 + e] = pb * (dp[n][2 + e] - D);
      }
      pf[n >> 1][(n & 1) * 2] = pack_bf16(s[n][0], s[n][1]);
      pf[n >> 1][(n & 1) * 2 + 1] = pack_bf16(s[n][2], s[n][3]);
      df[n >> 1][(n & 1) * 2] = pack_bf16(dp[n][0], dp[n][1]);
      df[n >> 1][(n & 1) * 2 + 1] = pack_bf16(dp[n][2], dp[n][3]);
    }
    wg_fence();
#pragma unroll
    for (int c = 0; c < BQ / 16; ++c) {
      wg_rs<1>(dv, pf[c], wg_desc(gt_s + c * 2048, BQ * 128, 1024), 1);
    }
#pragma unroll
    for (int c = 0; c < BQ / 16; ++c) {
      wg_rs<1>(dk, df[c], wg_desc(qt_s + c * 2048, BQ * 128, 1024), 1);
    }
    wg_commit();
    wg_wait_all();
    wg_hold(dv);
    wg_hold(dk);
  }
  cp_wait<0>();
  __syncthreads();
  if (!active) return;
  bf16* stage = (bf16*)((char*)flash_smem + (ks - raw)) + (64 * wg + 16 * warp) * (HD + 8);
  store_rows<HD>(dqkv, width, kcol, w0, T, dk, scale, scale, stage);
  store_rows<HD>(dqkv, width, vcol, w0, T, dv, 1.0f, 1.0f, stage);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Launched only on sm_90 (see `attention.rs`); built as a trap elsewhere so that every
// architecture's module has the same entry points.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HOPPER_BODY(...) __VA_ARGS__
#else
#define HOPPER_BODY(...) __trap()
#endif

#define HOPPER_FORWARD_ENTRY_POINT(HD)                                                            \
  extern "C" __global__ void __launch_bounds__(256, 1)                                            \
      hopper_forward_##HD(bf16* out, float* lse, const bf16* qkv, const int* cu, int docs, int T, \
                          int nq, int nkv, int window, float scale) {                             \
    HOPPER_BODY(hopper_forward<HD>(out, lse, qkv, cu, docs, T, nq, nkv, window, scale));          \
  }

#define HOPPER_BACKWARD_ENTRY_POINTS(HD, DKV_BQ)                                                \
  extern "C" __global__ void __launch_bounds__(256, 1) hopper_backward_dq_##HD(                 \
      bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,       \
      const int* cu, int docs, int T, int nq, int nkv, int window, float scale) {               \
    HOPPER_BODY(hopper_backward_dq<HD>(dqkv, dout, qkv, lse, dsum, cu, docs, T, nq, nkv, window, \
                                       scale));                                                 \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(256, 1) hopper_backward_dkv_##HD(                \
      bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,       \
      const int* cu, int docs, int T, int nq, int nkv, int window, float scale) {               \
    HOPPER_BODY(hopper_backward_dkv<HD, DKV_BQ>(dqkv, dout, qkv, lse, dsum, cu, docs, T, nq,     \
                                                nkv, window, scale));                           \
  }

HOPPER_FORWARD_ENTRY_POINT(64)
HOPPER_FORWARD_ENTRY_POINT(128)
HOPPER_BACKWARD_ENTRY_POINTS(64, 64)
HOPPER_BACKWARD_ENTRY_POINTS(128, 64)


// ---- scalar kernels (any head_dim up to 256) ---------------------------------------------------
//
// Layout: 4 warps per block. Key/value (or query/dout) tiles of 32 tokens sit in shared memory
// transposed, [d][j] with rows padded to 34 halves (17 words), so that both "lane = token" dot
// products and "lane = dimension" accumulations hit 32 distinct banks. Scores are one key per
// lane; the output accumulators are one head dimension per lane (HD / 32 registers per row).
// HD is the head-dim bucket (32, 64, 128, 256); the actual hd ≤ HD is a runtime value and the
// tiles are zero-padded beyond it.

#define KT 32
#define KP 34

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
template <int HD, int QW, bool CAP>
__device__ __forceinline__ void attention_forward(bf16* out, float* lse, const bf16* qkv,
                                                  const int* cu, int docs, int T, int nq,
                                                  int nkv, int hd, int window, float scale,
                                                  float cap) {
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
      if constexpr (CAP) cap_score(s, scale, cap);
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
template <int HD, int QW, bool CAP>
__device__ __forceinline__ void attention_backward_dq(bf16* dqkv, const bf16* dout,
                                                      const bf16* qkv, const float* lse,
                                                      const float* dsum, const int* cu, int docs,
                                                      int T, int nq, int nkv, int hd, int window,
                                                      float scale, float cap) {
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
      float slope = 1.0f;
      if constexpr (CAP) slope = cap_score(s, scale, cap);
      const float p = vis ? expf(s * scale - L[r]) : 0.0f;
      const float ds = p * (dp - D[r]) * slope;
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
template <int HD, int KW, bool CAP>
__device__ __forceinline__ void attention_backward_dkv(bf16* dqkv, const bf16* dout,
                                                       const bf16* qkv, const float* lse,
                                                       const float* dsum, const int* cu,
                                                       int docs, int T, int nq, int nkv, int hd,
                                                       int window, float scale, float cap) {
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
        float slope = 1.0f;
        if constexpr (CAP) slope = cap_score(s, scale, cap);
        const float p = vis ? expf(s * scale - Ls[lane]) : 0.0f;
        const float ds = p * (dp - Ds[lane]) * slope;
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

// Each size twice: plain, and `_capped` with Gemma 2's soft-cap (the tensor-core kernels have
// no soft-cap: it would make them spill registers).
#define ATTENTION_ENTRY_POINTS_AS(NAME, HD, W, CAP)                                            \
  extern "C" __global__ void __launch_bounds__(128)                                            \
      attention_forward_##NAME(bf16* out, float* lse, const bf16* qkv, const int* cu, int docs, \
                               int T, int nq, int nkv, int hd, int window, float scale,        \
                               float cap) {                                                    \
    attention_forward<HD, W, CAP>(out, lse, qkv, cu, docs, T, nq, nkv, hd, window, scale,      \
                                  cap);                                                        \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_##NAME(              \
      bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,      \
      const int* cu, int docs, int T, int nq, int nkv, int hd, int window, float scale,        \
      float cap) {                                                                             \
    attention_backward_dq<HD, W, CAP>(dqkv, dout, qkv, lse, dsum, cu, docs, T, nq, nkv, hd,    \
                                      window, scale, cap);                                     \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(128) attention_backward_dkv_##NAME(             \
      bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,      \
      const int* cu, int docs, int T, int nq, int nkv, int hd, int window, float scale,        \
      float cap) {                                                                             \
    attention_backward_dkv<HD, W, CAP>(dqkv, dout, qkv, lse, dsum, cu, docs, T, nq, nkv, hd,   \
                                       window, scale, cap);                                    \
  }

#define ATTENTION_ENTRY_POINTS(HD, W)            \
  ATTENTION_ENTRY_POINTS_AS(HD, HD, W, false)    \
  ATTENTION_ENTRY_POINTS_AS(capped_##HD, HD, W, true)

// Rows per warp: 4, or 2 at head_dim 256 to stay within 48 KiB of static shared memory.
ATTENTION_ENTRY_POINTS(32, 4)
ATTENTION_ENTRY_POINTS(64, 4)
ATTENTION_ENTRY_POINTS(128, 4)
ATTENTION_ENTRY_POINTS(256, 2)

// ---- GPT-OSS's attention sinks -------------------------------------------------------------
//
// Applied to a finished attention (the CPU twin is attention_sinks_forward in
// backend/cpu/attention.rs): head h's softmax gets one more logit, sinks[h], with no value
// behind it, so lse' = log(exp(lse) + exp(sink)) and out *= exp(lse − lse'). The backward of
// everything else is attention_backward's, given the new out and lse.

// One warp per (token, head) row: out [T, nq, hd] (bf16) and lse [T, nq] in place, sinks [nq].
extern "C" __global__ void attention_sinks_forward(bf16* out, float* lse, const void* sinks,
                                                   int sinks_f32, long long rows, int nq,
                                                   int hd) {
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const float l = lse[row], s = ld(sinks, sinks_f32, row % nq);
  // log(exp(l) + exp(s)) around the larger of the two, as the CPU twin's `sink` forms it.
  const float m = fmaxf(l, s);
  const float nl = m + logf(expf(l - m) + expf(s - m));
  const float factor = expf(l - nl);
  bf16* o = out + row * hd;
  for (int d = lane; d < hd; d += 32) o[d] = f2bf(bf2f(o[d]) * factor);
  // Every lane has read lse[row] before it is overwritten.
  __syncwarp();
  if (lane == 0) lse[row] = nl;
}

// partials[c, h] = −Σ_{t in chunk c} exp(sinks[h] − lse[t, h]) (dout[t, h] · out[t, h]): the
// sink's probability times the row's D, the term a logit with no value contributes to dS. Grid
// (chunks, nq); warp w takes the chunk's tokens w, w + warps, ... in order, and the block adds
// its warps' sums in warp order, so the partial is deterministic. dout and out [T, nq, hd]
// (bf16), lse [T, nq], sinks [nq].
extern "C" __global__ void attention_sinks_backward(float* partials, const bf16* dout,
                                                    const bf16* out, const float* lse,
                                                    const void* sinks, int sinks_f32,
                                                    long long tokens, long long rows_per, int nq,
                                                    int hd) {
  __shared__ float red[32];
  const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const long long t0 = (long long)blockIdx.x * rows_per;
  const long long t1 = t0 + rows_per < tokens ? t0 + rows_per : tokens;
  const float s = ld(sinks, sinks_f32, h);
  float acc = 0.0f;
  for (long long t = t0 + warp; t < t1; t += warps) {
    const long long row = t * nq + h;
    float dot = 0.0f;
    for (int d = lane; d < hd; d += 32) dot += bf2f(dout[row * hd + d]) * bf2f(out[row * hd + d]);
    dot = warp_sum(dot);
    acc -= expf(s - lse[row]) * dot;
  }
  if (lane == 0) red[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < warps; ++w) sum += red[w];
    partials[(long long)blockIdx.x * nq + h] = sum;
  }
}
