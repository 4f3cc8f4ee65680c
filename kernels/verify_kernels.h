// The batched, ragged verification op (DESIGN.md, "Verification kernels"), free of PyTorch headers so that
// hipcc or nvcc alone compiles it. Layout as in cascade/verify/reference.py, the PyTorch reference these must match:
//   draft_token_ids  [num_tokens]                 int64, the drafts of all requests, request after request
//   cu_num_draft     [batch + 1]                  int64, request b's drafts are draft_token_ids[cu[b]:cu[b+1]]
//   draft_probs      [num_tokens, vocab]          float32 q rows, or null for one-hot (n-gram) drafts
//   target_probs     [num_tokens + batch, vocab]  float32 p rows; request b owns rows cu[b]+b .. cu[b+1]+b
//   uniforms         [num_tokens]                 float32 U[0, 1) draws for the accept tests
//   final_uniforms   [batch]                      float32 U[0, 1) draw for the recovered-or-bonus token
//   output           [batch, max_depth + 1]       int64, accepted drafts, the drawn token, then -1
//   num_accepted     [batch]                      int64
// Each launcher returns 0, or the runtime's error code after printing nothing (the caller formats it).
#pragma once

#include <stdint.h>

#include "compat.h"

namespace cascade {

// rows.argmax(-1) for [num_rows, vocab] float32 rows with row stride `stride`; ties go to the lowest index.
int launch_argmax_rows(const float* rows, int64_t num_rows, int64_t vocab, int64_t stride, int64_t* out,
                       cascade_stream_t stream);

// Greedy: accept while draft == target_argmax; output the target's tokens up to the first mismatch or bonus.
int launch_greedy_accept(const int64_t* draft_token_ids, const int64_t* cu_num_draft, const int64_t* target_argmax,
                         int64_t batch, int64_t max_depth, int64_t* output, int64_t* num_accepted,
                         cascade_stream_t stream);

// Sampling: accept y_j when u_j * q_j(y_j) < p_j(y_j) and q_j(y_j) > 0; then one token per request from the
// residual max(p - q, 0) at the first rejection (p itself if the residual has no mass) or from p at the bonus
// position, the first token whose float64 cumulative weight exceeds u times the row's total (u: the request's final
// uniform). draft_probs may be null (one-hot drafts).
int launch_sampling(const int64_t* draft_token_ids, const int64_t* cu_num_draft, const float* draft_probs,
                    const float* target_probs, const float* uniforms, const float* final_uniforms, int64_t batch,
                    int64_t vocab, int64_t max_depth, int64_t stride_q, int64_t stride_p, int64_t* output,
                    int64_t* num_accepted, cascade_stream_t stream);

// Draft trees (cascade/verify/tree.py's batched layout): request b's nodes are tokens/parents[cu[b]:cu[b+1]], each
// parent an index within the request (-1: a child of the context), and its 1 + nodes verifier rows start at
// cu[b] + b. Both write the accepted nodes to path [batch, max_nodes] (the caller fills it with -1 first), their count
// and the token after them.
// Matching: the first child whose token is chosen[] at its parent's row.
int launch_tree_matching(const int64_t* tokens, const int64_t* parents, const int64_t* cu_num_nodes,
                         const int64_t* chosen, int64_t batch, int64_t max_nodes, int64_t* path, int64_t* num,
                         int64_t* final_token, cascade_stream_t stream);

// Sampling: recursive rejection over siblings (draft_probs may be null: every node one-hot); scratch [batch, vocab]
// float32 holds each request's residual.
int launch_tree_sampling(const int64_t* tokens, const int64_t* parents, const uint8_t* sampled,
                         const int64_t* cu_num_nodes, const float* draft_probs, const float* target_probs,
                         const float* uniforms, const float* final_uniforms, int64_t batch, int64_t vocab,
                         int64_t max_nodes, int64_t stride_q, int64_t stride_p, float* scratch, int64_t* path,
                         int64_t* num, int64_t* final_token, cascade_stream_t stream);

}  // namespace cascade
