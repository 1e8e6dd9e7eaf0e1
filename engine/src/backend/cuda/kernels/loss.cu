// The cross-entropy half of the chunked LM head: the logits of a chunk of tokens ([C, V] in f32,
// made by a cuBLASLt GEMM) are reduced here one row per block. Reference: ForCausalLMLoss /
// fixed_cross_entropy in transformers' loss_utils.py (f32, ignore_index −100); the derivation
// is in the CPU twin (backend/cpu/loss.rs).

#define IGNORE_INDEX (-100)

// Gemma 2's final soft-cap: cap · tanh(z / cap) when cap > 0 (0: the logit as is); *slope gets
// the derivative 1 − tanh².
__device__ __forceinline__ float softcapped(float z, float cap, float* slope) {
  if (cap <= 0.0f) {
    *slope = 1.0f;
    return z;
  }
  const float t = tanhf(z / cap);
  *slope = 1.0f - t * t;
  return t * cap;
}

// lse = log Σ_v exp(z_v) of one row of logits, reduced by the whole block (every thread gets
// it): shared by the forward's row kernel and the fused one, so both give the same bits.
__device__ __forceinline__ float row_lse(const float* z, long long vocab, float cap, float* red) {
  float slope, mx = NEG_INF;
  for (long long v = threadIdx.x; v < vocab; v += blockDim.x)
    mx = fmaxf(mx, softcapped(z[v], cap, &slope));
  mx = block_max(mx, red);
  float sum = 0.0f;
  for (long long v = threadIdx.x; v < vocab; v += blockDim.x)
    sum += expf(softcapped(z[v], cap, &slope) - mx);
  sum = block_sum(sum, red);
  return mx + logf(sum);
}

// Writes the row's lse and loss (thread 0).
__device__ __forceinline__ void row_loss(float* losses, float* lse, const float* z, int y,
                                         long long row, float L, float cap) {
  if (threadIdx.x == 0) {
    float slope;
    lse[row] = L;
    losses[row] = y == IGNORE_INDEX ? 0.0f : L - softcapped(z[y], cap, &slope);
  }
}

// G_v = scale (softmax(z)_v − [v = y]) (times the soft-cap's slope), 0 on an ignored row,
// rounded to bf16: shared by the backward's row kernel and the fused one.
__device__ __forceinline__ void row_grad(bf16* gr, const float* z, int y, float L, float scale,
                                         long long vocab, float cap) {
  for (long long v = threadIdx.x; v < vocab; v += blockDim.x) {
    float gv = 0.0f;
    if (y != IGNORE_INDEX) {
      float slope;
      const float c = softcapped(z[v], cap, &slope);
      gv = (expf(c - L) * scale - (v == y ? scale : 0.0f)) * slope;
    }
    gr[v] = f2bf(gv);
  }
}

// lse[c] = log Σ_v exp(z_cv); losses[c] = lse[c] − z_{c, y_c}, or 0 where y_c is IGNORE.
// losses, lse [C] (f32), logits [C, V] (f32), targets [C]. One block per row.
extern "C" __global__ void cross_entropy_rows(float* losses, float* lse, const float* logits,
                                              const int* targets, long long vocab, float cap) {
  __shared__ float red[32];
  const long long row = blockIdx.x;
  const float* z = logits + row * vocab;
  const float L = row_lse(z, vocab, cap, red);
  row_loss(losses, lse, z, targets[row], row, L, cap);
}

// G_cv = scale (softmax(z_c)_v − [v = y_c]) (times the soft-cap's slope), 0 on ignored rows;
// written as the bf16 operand of the two backward GEMMs. grad [C, V] (bf16), logits [C, V]
// (f32), lse [C], targets [C].
extern "C" __global__ void cross_entropy_grad_rows(bf16* grad, const float* logits,
                                                   const float* lse, const int* targets,
                                                   float scale, long long vocab, float cap) {
  const long long row = blockIdx.x;
  row_grad(grad + row * vocab, logits + row * vocab, targets[row], lse[row], scale, vocab, cap);
}

// Both of the above from one read of the logits' row for its maximum and sum and one for G:
// losses, lse [C], grad [C, V] (bf16), logits [C, V] (f32), targets [C].
extern "C" __global__ void cross_entropy_loss_grad_rows(float* losses, float* lse, bf16* grad,
                                                        const float* logits, const int* targets,
                                                        float scale, long long vocab,
                                                        float cap) {
  __shared__ float red[32];
  const long long row = blockIdx.x;
  const float* z = logits + row * vocab;
  const int y = targets[row];
  const float L = row_lse(z, vocab, cap, red);
  row_loss(losses, lse, z, y, row, L, cap);
  row_grad(grad + row * vocab, z, y, L, scale, vocab, cap);
}
