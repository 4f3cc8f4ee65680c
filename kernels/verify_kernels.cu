// Verification kernels for AMD (hipcc) and NVIDIA (nvcc). See verify_kernels.h for the layout and
// cascade/verify.py for the reference they must match bit for bit: the same float32 operations where rounding
// matters (u * q < p, max(p - q, 0), r / e with correctly rounded division) and argmax ties to the lowest index.
#include "verify_kernels.h"

namespace cascade {
namespace {

constexpr int kThreads = 256;  // one block per row or request; threads stride over the vocabulary
constexpr int64_t kPlaceholder = -1;
constexpr int64_t kNoIndex = INT64_MAX;

struct Best {
  float value;
  int64_t index;
};

// The larger value; on a tie the lower index, as torch.argmax (so the reduction order does not matter).
__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ Best block_argmax(Best mine, Best* shared) {
  shared[threadIdx.x] = mine;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] = better(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  Best result = shared[0];
  __syncthreads();  // shared is reused by the caller
  return result;
}

__global__ void argmax_rows_kernel(const float* __restrict__ rows,  // [num_rows, vocab]
                                   int64_t vocab, int64_t stride,
                                   int64_t* __restrict__ out) {  // [num_rows]
  __shared__ Best shared[kThreads];
  const float* row = rows + static_cast<int64_t>(blockIdx.x) * stride;
  Best best = {-INFINITY, kNoIndex};
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) best = better(best, Best{row[v], v});
  best = block_argmax(best, shared);
  if (threadIdx.x == 0) out[blockIdx.x] = best.index == kNoIndex ? 0 : best.index;
}

__global__ void greedy_accept_kernel(const int64_t* __restrict__ drafts,         // [num_tokens]
                                     const int64_t* __restrict__ cu,             // [batch + 1]
                                     const int64_t* __restrict__ target_argmax,  // [num_tokens + batch]
                                     int64_t max_depth,
                                     int64_t* __restrict__ output,          // [batch, max_depth + 1]
                                     int64_t* __restrict__ num_accepted) {  // [batch]
  const int64_t b = blockIdx.x;
  const int64_t start = cu[b];
  const int64_t n = cu[b + 1] - start;
  int64_t k = 0;
  while (k < n && drafts[start + k] == target_argmax[start + b + k]) ++k;
  int64_t* out = output + b * (max_depth + 1);
  for (int64_t j = 0; j <= max_depth; ++j) out[j] = j <= k ? target_argmax[start + b + j] : kPlaceholder;
  num_accepted[b] = k;
}

__global__ void sampling_kernel(const int64_t* __restrict__ drafts,   // [num_tokens]
                                const int64_t* __restrict__ cu,       // [batch + 1]
                                const float* __restrict__ q,          // [num_tokens, vocab] or null
                                const float* __restrict__ p,          // [num_tokens + batch, vocab]
                                const float* __restrict__ uniforms,   // [num_tokens]
                                const float* __restrict__ exps,       // [batch, vocab]
                                int64_t vocab, int64_t max_depth, int64_t stride_q, int64_t stride_p,
                                int64_t stride_e,
                                int64_t* __restrict__ output,          // [batch, max_depth + 1]
                                int64_t* __restrict__ num_accepted) {  // [batch]
  __shared__ Best shared[kThreads];
  __shared__ int64_t shared_accepted;
  const int64_t b = blockIdx.x;
  const int64_t start = cu[b];
  const int64_t n = cu[b + 1] - start;

  // Accept tests: at most max_depth of them, one thread (the vocabulary pass below is the costly part).
  if (threadIdx.x == 0) {
    int64_t k = 0;
    for (; k < n; ++k) {
      const int64_t token = drafts[start + k];
      const float pk = p[(start + b + k) * stride_p + token];
      const float qk = q != nullptr ? q[(start + k) * stride_q + token] : 1.0f;
      // Accept with probability min(1, p/q): u * q < p. A draft its drafter gave probability 0 is rejected.
      if (!(uniforms[start + k] * qk < pk && qk > 0.0f)) break;
    }
    shared_accepted = k;
  }
  __syncthreads();
  const int64_t k = shared_accepted;
  const bool rejected = k < n;
  const int64_t row = start + b + k;  // the first rejection, or the bonus position
  const int64_t rejected_index = start + k;
  const int64_t rejected_token = rejected ? drafts[rejected_index] : -1;

  // One pass: the exponential-race winners of the residual and of p, and whether the residual has mass.
  Best best_r = {-1.0f, kNoIndex};
  Best best_p = {-1.0f, kNoIndex};
  int residual_mass = 0;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float pv = p[row * stride_p + v];
    const float ev = exps[b * stride_e + v];
    float qv = 0.0f;
    if (rejected) qv = q != nullptr ? q[rejected_index * stride_q + v] : (v == rejected_token ? 1.0f : 0.0f);
    const float r = fmaxf(pv - qv, 0.0f);
    residual_mass |= r > 0.0f;
    best_r = better(best_r, Best{__fdiv_rn(r, ev), v});
    best_p = better(best_p, Best{__fdiv_rn(pv, ev), v});
  }
  residual_mass = __syncthreads_or(residual_mass);
  best_r = block_argmax(best_r, shared);
  best_p = block_argmax(best_p, shared);
  if (threadIdx.x == 0) {
    const int64_t drawn = rejected && residual_mass ? best_r.index : best_p.index;
    int64_t* out = output + b * (max_depth + 1);
    for (int64_t j = 0; j <= max_depth; ++j) out[j] = j < k ? drafts[start + j] : (j == k ? drawn : kPlaceholder);
    num_accepted[b] = k;
  }
}

int last_error() {
  const cascade_error_t error = cascade_get_last_error();
  return error == cascade_success ? 0 : static_cast<int>(error);
}

}  // namespace

int launch_argmax_rows(const float* rows, int64_t num_rows, int64_t vocab, int64_t stride, int64_t* out,
                       cascade_stream_t stream) {
  if (num_rows == 0) return 0;
  argmax_rows_kernel<<<static_cast<unsigned>(num_rows), kThreads, 0, stream>>>(rows, vocab, stride, out);
  return last_error();
}

int launch_greedy_accept(const int64_t* draft_token_ids, const int64_t* cu_num_draft, const int64_t* target_argmax,
                         int64_t batch, int64_t max_depth, int64_t* output, int64_t* num_accepted,
                         cascade_stream_t stream) {
  if (batch == 0) return 0;
  greedy_accept_kernel<<<static_cast<unsigned>(batch), 1, 0, stream>>>(draft_token_ids, cu_num_draft, target_argmax,
                                                                       max_depth, output, num_accepted);
  return last_error();
}

int launch_sampling(const int64_t* draft_token_ids, const int64_t* cu_num_draft, const float* draft_probs,
                    const float* target_probs, const float* uniforms, const float* exponentials, int64_t batch,
                    int64_t vocab, int64_t max_depth, int64_t stride_q, int64_t stride_p, int64_t stride_e,
                    int64_t* output, int64_t* num_accepted, cascade_stream_t stream) {
  if (batch == 0) return 0;
  sampling_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(
      draft_token_ids, cu_num_draft, draft_probs, target_probs, uniforms, exponentials, vocab, max_depth, stride_q,
      stride_p, stride_e, output, num_accepted);
  return last_error();
}

}  // namespace cascade
