// Verification kernels for AMD (hipcc) and NVIDIA (nvcc). See verify_kernels.h for the layout and
// cascade/verify/reference.py for the reference they must match: the same float32 operations where rounding matters
// (u * q < p, max(p - q, 0)), argmax ties to the lowest index, and the drawn token by inverting float64 cumulative
// sums (cascade.sampling.sample_rows), summed here chunk by chunk: the two agree except where a draw falls within
// float64 rounding of a boundary between two tokens (about 1e-16 of the row's mass).
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

// The two rows a request may draw from, at vocabulary index v: p at its final position, and the residual
// max(p - q, 0), where q counts only if a draft was rejected.
struct Candidates {
  float p;
  float residual;
};

__device__ __forceinline__ Candidates candidates(const float* __restrict__ p_row, const float* __restrict__ q_row,
                                                 bool rejected, int64_t rejected_token, int64_t v) {
  const float pv = p_row[v];
  float qv = 0.0f;
  if (rejected) qv = q_row != nullptr ? q_row[v] : (v == rejected_token ? 1.0f : 0.0f);
  return {pv, fmaxf(pv - qv, 0.0f)};
}

__global__ void sampling_kernel(const int64_t* __restrict__ drafts,   // [num_tokens]
                                const int64_t* __restrict__ cu,       // [batch + 1]
                                const float* __restrict__ q,          // [num_tokens, vocab] or null
                                const float* __restrict__ p,          // [num_tokens + batch, vocab]
                                const float* __restrict__ uniforms,   // [num_tokens]
                                const float* __restrict__ finals,     // [batch]
                                int64_t vocab, int64_t max_depth, int64_t stride_q, int64_t stride_p,
                                int64_t* __restrict__ output,          // [batch, max_depth + 1]
                                int64_t* __restrict__ num_accepted) {  // [batch]
  __shared__ double prefix[kThreads + 1];
  __shared__ int64_t shared_accepted;
  __shared__ int64_t drawn;          // the first token past the threshold
  __shared__ int64_t last_weighted;  // the last token with weight
  const int64_t b = blockIdx.x;
  const int64_t start = cu[b];
  const int64_t n = cu[b + 1] - start;

  // Accept tests: at most max_depth of them, one thread (the vocabulary passes below are the costly part).
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
    drawn = INT64_MAX;
    last_weighted = 0;
  }
  __syncthreads();
  const int64_t k = shared_accepted;
  const bool rejected = k < n;
  const float* p_row = p + (start + b + k) * stride_p;  // the first rejection, or the bonus position
  const float* q_row = rejected && q != nullptr ? q + (start + k) * stride_q : nullptr;
  const int64_t rejected_token = rejected ? drafts[start + k] : -1;

  // Each thread sums a contiguous chunk of the vocabulary (the inversion needs sums in vocabulary order): both
  // candidate rows, and whether the residual has any mass.
  const int64_t chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * chunk;
  const int64_t lo = first < vocab ? first : vocab;
  const int64_t hi = lo + chunk < vocab ? lo + chunk : vocab;
  double sum_p = 0.0, sum_r = 0.0;
  int residual_mass = 0;
  for (int64_t v = lo; v < hi; ++v) {
    const Candidates c = candidates(p_row, q_row, rejected, rejected_token, v);
    sum_p += c.p;
    sum_r += c.residual;
    residual_mass |= c.residual > 0.0f;
  }
  // The reference falls back to p if rounding left the residual no mass.
  const bool any_mass = __syncthreads_or(residual_mass);  // (every thread reaches it)
  const bool from_residual = rejected && any_mass;
  prefix[threadIdx.x + 1] = from_residual ? sum_r : sum_p;
  __syncthreads();
  if (threadIdx.x == 0) {  // the chunks' cumulative sums, in order
    prefix[0] = 0.0;
    for (unsigned t = 1; t <= blockDim.x; ++t) prefix[t] += prefix[t - 1];
  }
  __syncthreads();
  const double threshold = static_cast<double>(finals[b]) * prefix[blockDim.x];  // below the total: u < 1
  // The chunk where the cumulative sum passes the threshold finds the token; the last token with weight stands in
  // should float64 rounding leave none.
  double cumulative = prefix[threadIdx.x];
  int64_t found = INT64_MAX, last = -1;
  for (int64_t v = lo; v < hi; ++v) {
    const Candidates c = candidates(p_row, q_row, rejected, rejected_token, v);
    const float w = from_residual ? c.residual : c.p;
    cumulative += w;
    if (w > 0.0f) last = v;
    if (cumulative > threshold && found == INT64_MAX) found = v;
  }
  if (found != INT64_MAX) atomicMin(reinterpret_cast<unsigned long long*>(&drawn), static_cast<unsigned long long>(found));
  if (last >= 0) atomicMax(reinterpret_cast<unsigned long long*>(&last_weighted), static_cast<unsigned long long>(last));
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t token = drawn != INT64_MAX ? drawn : last_weighted;
    int64_t* out = output + b * (max_depth + 1);
    for (int64_t j = 0; j <= max_depth; ++j) out[j] = j < k ? drafts[start + j] : (j == k ? token : kPlaceholder);
    num_accepted[b] = k;
  }
}

// ---- draft trees (cascade/verify/tree.py): one block per request walks its tree from the root --------------------

// Matching: follow the first child (lowest index) whose token is the verifier's own; one thread.
__global__ void tree_matching_kernel(const int64_t* __restrict__ tokens,   // [num_nodes]
                                     const int64_t* __restrict__ parents,  // [num_nodes], -1: a child of the context
                                     const int64_t* __restrict__ cu,       // [batch + 1]
                                     const int64_t* __restrict__ chosen,   // [num_nodes + batch]
                                     int64_t max_nodes,
                                     int64_t* __restrict__ path,           // [batch, max_nodes], -1 past the count
                                     int64_t* __restrict__ num,            // [batch]
                                     int64_t* __restrict__ final_token) {  // [batch]
  const int64_t b = blockIdx.x;
  const int64_t start = cu[b];
  const int64_t n = cu[b + 1] - start;
  int64_t node = -1, count = 0;
  while (true) {
    const int64_t want = chosen[start + b + 1 + node];
    int64_t follow = -1;
    for (int64_t c = 0; c < n && follow < 0; ++c)
      if (parents[start + c] == node && tokens[start + c] == want) follow = c;
    if (follow < 0) {
      final_token[b] = want;
      break;
    }
    path[b * max_nodes + count++] = follow;
    node = follow;
  }
  num[b] = count;
}

// The row node `c` was proposed from, at vocabulary index v: its q row where it was sampled, else one-hot at its token.
__device__ __forceinline__ float proposal(const float* __restrict__ q, int64_t stride_q, bool sampled, int64_t c,
                                          int64_t token, int64_t v) {
  if (sampled) return q[c * stride_q + v];
  return v == token ? 1.0f : 0.0f;
}

__device__ double block_sum(double mine, double* shared) {
  shared[threadIdx.x] = mine;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

// Sampling: recursive rejection over siblings with the residual kept unnormalised in `scratch` as r and its scale m
// (child x accepted when u * s(x) * m < r(x); a rejection sets r = max(r - m*s, 0), m = sum r in float64), then the
// token after the path drawn from r as sample_rows does. The accept tests run on thread 0; the passes over the
// vocabulary on every thread. The products are rounded apart (no fused multiply-add), as PyTorch computes them.
__global__ void tree_sampling_kernel(const int64_t* __restrict__ tokens,    // [num_nodes]
                                     const int64_t* __restrict__ parents,   // [num_nodes]
                                     const uint8_t* __restrict__ sampled,   // [num_nodes]: from its q row, else one-hot
                                     const int64_t* __restrict__ cu,        // [batch + 1]
                                     const float* __restrict__ q,           // [num_nodes, vocab] or null
                                     const float* __restrict__ p,           // [num_nodes + batch, vocab]
                                     const float* __restrict__ uniforms,    // [num_nodes]
                                     const float* __restrict__ finals,      // [batch]
                                     int64_t vocab, int64_t max_nodes, int64_t stride_q, int64_t stride_p,
                                     float* __restrict__ scratch,           // [batch, vocab]
                                     int64_t* __restrict__ path,            // [batch, max_nodes]
                                     int64_t* __restrict__ num,             // [batch]
                                     int64_t* __restrict__ final_token) {   // [batch]
  __shared__ double partial[kThreads];
  __shared__ double prefix[kThreads + 1];
  __shared__ int64_t node, follow, count, drawn, last_weighted;
  __shared__ float scale;
  __shared__ int accepted;
  const int64_t b = blockIdx.x;
  const int64_t start = cu[b];
  const int64_t n = cu[b + 1] - start;
  float* r = scratch + b * vocab;
  if (threadIdx.x == 0) {
    node = -1;
    count = 0;
  }
  __syncthreads();
  while (true) {
    const float* row = p + (start + b + 1 + node) * stride_p;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) r[v] = row[v];
    if (threadIdx.x == 0) {
      scale = 1.0f;
      follow = -1;
    }
    __syncthreads();
    for (int64_t c = 0; c < n && follow < 0; ++c) {
      if (parents[start + c] != node) continue;
      const int64_t x = tokens[start + c];
      const bool from_q = q != nullptr && sampled[start + c] != 0;
      if (threadIdx.x == 0) {
        const float s_x = proposal(q, stride_q, from_q, start + c, x, x);
        accepted = s_x > 0.0f && __fmul_rn(__fmul_rn(uniforms[start + c], s_x), scale) < r[x];
        if (accepted) follow = c;
      }
      __syncthreads();
      if (accepted) break;
      const float m = scale;
      double mine = 0.0;
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
        mine += fmaxf(__fsub_rn(r[v], __fmul_rn(m, proposal(q, stride_q, from_q, start + c, x, v))), 0.0f);
      const double total = block_sum(mine, partial);
      if (total > 0.0) {  // (rounding may leave no mass: r stands then)
        for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
          r[v] = fmaxf(__fsub_rn(r[v], __fmul_rn(m, proposal(q, stride_q, from_q, start + c, x, v))), 0.0f);
        if (threadIdx.x == 0) scale = static_cast<float>(total);
      }
      __syncthreads();
    }
    if (follow < 0) break;
    if (threadIdx.x == 0) {
      path[b * max_nodes + count++] = follow;
      node = follow;
    }
    __syncthreads();
  }
  // The token after the path: the first whose float64 cumulative weight in r exceeds u times r's total, each thread
  // summing a contiguous chunk (the inversion needs sums in vocabulary order).
  const int64_t chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int64_t first = static_cast<int64_t>(threadIdx.x) * chunk;
  const int64_t lo = first < vocab ? first : vocab;
  const int64_t hi = lo + chunk < vocab ? lo + chunk : vocab;
  double sum = 0.0;
  for (int64_t v = lo; v < hi; ++v) sum += r[v];
  prefix[threadIdx.x + 1] = sum;
  if (threadIdx.x == 0) {
    drawn = INT64_MAX;
    last_weighted = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefix[0] = 0.0;
    for (unsigned t = 1; t <= blockDim.x; ++t) prefix[t] += prefix[t - 1];
  }
  __syncthreads();
  const double threshold = static_cast<double>(finals[b]) * prefix[blockDim.x];
  double cumulative = prefix[threadIdx.x];
  int64_t found = INT64_MAX, last = -1;
  for (int64_t v = lo; v < hi; ++v) {
    cumulative += r[v];
    if (r[v] > 0.0f) last = v;
    if (cumulative > threshold && found == INT64_MAX) found = v;
  }
  if (found != INT64_MAX) atomicMin(reinterpret_cast<unsigned long long*>(&drawn), static_cast<unsigned long long>(found));
  if (last >= 0) atomicMax(reinterpret_cast<unsigned long long*>(&last_weighted), static_cast<unsigned long long>(last));
  __syncthreads();
  if (threadIdx.x == 0) {
    final_token[b] = drawn != INT64_MAX ? drawn : last_weighted;
    num[b] = count;
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
                    const float* target_probs, const float* uniforms, const float* final_uniforms, int64_t batch,
                    int64_t vocab, int64_t max_depth, int64_t stride_q, int64_t stride_p, int64_t* output,
                    int64_t* num_accepted, cascade_stream_t stream) {
  if (batch == 0) return 0;
  sampling_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(
      draft_token_ids, cu_num_draft, draft_probs, target_probs, uniforms, final_uniforms, vocab, max_depth, stride_q,
      stride_p, output, num_accepted);
  return last_error();
}

int launch_tree_matching(const int64_t* tokens, const int64_t* parents, const int64_t* cu_num_nodes,
                         const int64_t* chosen, int64_t batch, int64_t max_nodes, int64_t* path, int64_t* num,
                         int64_t* final_token, cascade_stream_t stream) {
  if (batch == 0) return 0;
  tree_matching_kernel<<<static_cast<unsigned>(batch), 1, 0, stream>>>(tokens, parents, cu_num_nodes, chosen,
                                                                       max_nodes, path, num, final_token);
  return last_error();
}

int launch_tree_sampling(const int64_t* tokens, const int64_t* parents, const uint8_t* sampled,
                         const int64_t* cu_num_nodes, const float* draft_probs, const float* target_probs,
                         const float* uniforms, const float* final_uniforms, int64_t batch, int64_t vocab,
                         int64_t max_nodes, int64_t stride_q, int64_t stride_p, float* scratch, int64_t* path,
                         int64_t* num, int64_t* final_token, cascade_stream_t stream) {
  if (batch == 0) return 0;
  tree_sampling_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(
      tokens, parents, sampled, cu_num_nodes, draft_probs, target_probs, uniforms, final_uniforms, vocab, max_nodes,
      stride_q, stride_p, scratch, path, num, final_token);
  return last_error();
}

}  // namespace cascade
