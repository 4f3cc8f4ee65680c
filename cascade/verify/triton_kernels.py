"""The verification op as Triton kernels (CUDA and ROCm; the CPU through ``TRITON_INTERPRET=1`` in tests).

They compute what the PyTorch reference in :mod:`cascade.verify.reference` computes, given the same inputs (the random draws
come in as tensors): the same float32 operations where rounding matters (``u * q < p``, ``max(p - q, 0)``), argmax
ties broken towards the lowest index, as ``torch.argmax`` does, and the drawn token by the inversion
:func:`cascade.sampling.sample_rows` defines (float64 cumulative sums, summed here block by block: the two agree
except where a draw falls within float64 rounding of a boundary between two tokens).

One program per request. Greedy: one program per target row computes its argmax, then one program per request
compares. Sampling: the accept tests of a request's drafts are a vector op; then one pass over the vocabulary sums
both candidate rows for the drawn token (the residual and p) and notes whether the residual has any mass, and a
second pass over the chosen one finds where its cumulative sum passes the threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascade.verify.reference import PLACEHOLDER_TOKEN_ID

VOCAB_BLOCK = 1024  # vocabulary elements per step of a program's loop
PLACEHOLDER = tl.constexpr(PLACEHOLDER_TOKEN_ID)


@triton.jit
def _argmax_rows_kernel(
    rows_ptr,  # [num_rows, vocab] float32
    out_ptr,  # [num_rows] int64
    vocab,
    stride_row,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    best_val = -float("inf")
    best_idx = 0
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(rows_ptr + row * stride_row + offs, mask=offs < vocab, other=-float("inf"))
        block_max = tl.max(x, axis=0)
        block_idx = tl.argmax(x, axis=0, tie_break_left=True) + start
        better = block_max > best_val  # strict: an equal value in a later block loses, as in torch.argmax
        best_idx = tl.where(better, block_idx, best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _greedy_accept_kernel(
    draft_ptr,  # [num_tokens] int64
    cu_ptr,  # [batch + 1] int64
    target_argmax_ptr,  # [num_tokens + batch] int64
    out_ptr,  # [batch, max_depth + 1] int64
    num_accepted_ptr,  # [batch] int64
    max_depth,
    BLOCK_D: tl.constexpr,  # a power of two > max_depth
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    offs = tl.arange(0, BLOCK_D)
    valid = offs < n
    drafts = tl.load(draft_ptr + start + offs, mask=valid, other=-1)
    target = tl.load(target_argmax_ptr + start + b + offs, mask=offs <= n, other=PLACEHOLDER)
    accepted = valid & (drafts == target)
    num_accepted = tl.min(tl.where(accepted, BLOCK_D, offs), axis=0)  # the first position not accepted
    out = tl.where(offs <= num_accepted, target, PLACEHOLDER)
    tl.store(out_ptr + b * (max_depth + 1) + offs, out, mask=offs <= max_depth)
    tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))


@triton.jit
def _candidates(target_probs_ptr, draft_probs_ptr, final_row, rejected_index, rejected_token, use_q, voffs, vocab,
                stride_p, stride_q, HAS_DRAFT_PROBS: tl.constexpr):
    """One block of the two rows a request may draw from: p at its final position, and the residual max(p - q, 0)
    (q counts only where a draft was rejected)."""
    vmask = voffs < vocab
    pv = tl.load(target_probs_ptr + final_row * stride_p + voffs, mask=vmask, other=0.0)
    with_q = vmask & ((tl.zeros(voffs.shape, tl.int32) + use_q) > 0)
    if HAS_DRAFT_PROBS:
        qv = tl.load(draft_probs_ptr + rejected_index * stride_q + voffs, mask=with_q, other=0.0)
    else:
        qv = tl.where(with_q & (voffs == rejected_token), 1.0, 0.0)
    return pv, tl.maximum(pv - qv, 0.0)


@triton.jit
def _sampling_kernel(
    draft_ptr,  # [num_tokens] int64
    cu_ptr,  # [batch + 1] int64
    draft_probs_ptr,  # [num_tokens, vocab] float32 (unused without HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_tokens + batch, vocab] float32
    uniforms_ptr,  # [num_tokens] float32
    final_uniforms_ptr,  # [batch] float32
    out_ptr,  # [batch, max_depth + 1] int64
    num_accepted_ptr,  # [batch] int64
    vocab,
    max_depth,
    stride_q,
    stride_p,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    offs = tl.arange(0, BLOCK_D)
    valid = offs < n
    tokens = tl.load(draft_ptr + start + offs, mask=valid, other=0)
    p = tl.load(target_probs_ptr + (start + b + offs) * stride_p + tokens, mask=valid, other=0.0)
    if HAS_DRAFT_PROBS:
        q = tl.load(draft_probs_ptr + (start + offs) * stride_q + tokens, mask=valid, other=0.0)
    else:
        q = tl.where(valid, 1.0, 0.0)  # one-hot drafts (the n-gram drafter)
    u = tl.load(uniforms_ptr + start + offs, mask=valid, other=1.0)
    # Accept with probability min(1, p/q), i.e. when u * q < p; a draft with q == 0 is rejected.
    accepted = valid & (u * q < p) & (q > 0.0)
    num_accepted = tl.min(tl.where(accepted, BLOCK_D, offs), axis=0)
    rejected = num_accepted < n
    final_row = start + b + num_accepted
    rejected_index = start + num_accepted  # the rejected draft's flat index (meaningful only when rejected)
    rejected_token = tl.sum(tl.where(offs == num_accepted, tokens, 0), axis=0)  # 0 when nothing was rejected

    # First pass: the totals of the residual max(p - q, 0) and of p, and whether the residual has any mass.
    use_q = rejected.to(tl.int32)  # q matters only if a draft was rejected
    total_r = tl.zeros([], tl.float64)
    total_p = tl.zeros([], tl.float64)
    residual_mass = 0
    for vstart in range(0, vocab, BLOCK_V):
        voffs = vstart + tl.arange(0, BLOCK_V)
        pv, r = _candidates(target_probs_ptr, draft_probs_ptr, final_row, rejected_index, rejected_token, use_q,
                            voffs, vocab, stride_p, stride_q, HAS_DRAFT_PROBS)
        total_r += tl.sum(r.to(tl.float64), axis=0)
        total_p += tl.sum(pv.to(tl.float64), axis=0)
        residual_mass = tl.maximum(residual_mass, tl.max((r > 0.0).to(tl.int32), axis=0))
    # The reference falls back to p if rounding left the residual no mass.
    from_residual = rejected & (residual_mass > 0)
    total = tl.where(from_residual, total_r, total_p)
    threshold = tl.load(final_uniforms_ptr + b).to(tl.float64) * total
    # Second pass: the first token whose cumulative weight exceeds the threshold (below the total, so one does);
    # the last token with weight stands in should float64 rounding between the passes leave none.
    carry = tl.zeros([], tl.float64)
    drawn = vocab
    last = 0
    for vstart in range(0, vocab, BLOCK_V):
        voffs = vstart + tl.arange(0, BLOCK_V)
        pv, r = _candidates(target_probs_ptr, draft_probs_ptr, final_row, rejected_index, rejected_token, use_q,
                            voffs, vocab, stride_p, stride_q, HAS_DRAFT_PROBS)
        w = tl.where(from_residual, r, pv).to(tl.float64)
        cumulative = carry + tl.cumsum(w, axis=0)
        drawn = tl.minimum(drawn, tl.min(tl.where((cumulative > threshold) & (voffs < vocab), voffs, vocab), axis=0))
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, voffs, 0), axis=0))
        carry += tl.sum(w, axis=0)
    final_token = tl.where(drawn < vocab, drawn, last).to(tl.int64)

    out = tl.where(offs < num_accepted, tokens, PLACEHOLDER)
    out = tl.where(offs == num_accepted, final_token, out)
    tl.store(out_ptr + b * (max_depth + 1) + offs, out, mask=offs <= max_depth)
    tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))


def _block_d(max_depth: int) -> int:
    return triton.next_power_of_2(max_depth + 1)


def argmax_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows.argmax(-1)`` for a [num_rows, vocab] float32 tensor: [num_rows] int64."""
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    if rows.shape[0]:
        _argmax_rows_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK_V=VOCAB_BLOCK)
    return out


def matching(
    draft_token_ids: torch.Tensor,  # [num_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
    target_argmax: torch.Tensor,  # [num_tokens + batch] int64
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = cu_num_draft_tokens.numel() - 1
    device = target_argmax.device
    output = torch.empty(batch, max_depth + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    drafts = draft_token_ids if draft_token_ids.numel() else torch.full((1,), -1, dtype=torch.int64, device=device)
    _greedy_accept_kernel[(batch,)](
        drafts, cu_num_draft_tokens.to(torch.int64).contiguous(), target_argmax.contiguous(), output, num_accepted,
        max_depth, BLOCK_D=_block_d(max_depth),
    )
    return output, num_accepted


def matching_from_rows(
    draft_token_ids: torch.Tensor,  # [num_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
    target_logits: torch.Tensor,  # [num_tokens + batch, vocab] float32
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification from the target's rows: the argmax kernel, then the compare kernel."""
    return matching(draft_token_ids, cu_num_draft_tokens, argmax_rows(target_logits), max_depth)


def sampling(
    draft_token_ids: torch.Tensor,  # [num_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab] float32, or None for one-hot drafts
    target_probs: torch.Tensor,  # [num_tokens + batch, vocab] float32
    uniforms: torch.Tensor,  # [num_tokens] float32
    final_uniforms: torch.Tensor,  # [batch] float32
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = cu_num_draft_tokens.numel() - 1
    device = target_probs.device
    target_probs = target_probs.contiguous()
    has_q = draft_probs is not None and draft_probs.numel() > 0
    q = draft_probs.contiguous() if has_q else target_probs  # a placeholder pointer when unused
    drafts = draft_token_ids if draft_token_ids.numel() else torch.full((1,), -1, dtype=torch.int64, device=device)
    u = uniforms if uniforms.numel() else torch.ones(1, device=device)
    output = torch.empty(batch, max_depth + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    _sampling_kernel[(batch,)](
        drafts, cu_num_draft_tokens.to(torch.int64).contiguous(), q, target_probs, u, final_uniforms.contiguous(),
        output, num_accepted, target_probs.shape[1], max_depth, q.stride(0), target_probs.stride(0),
        HAS_DRAFT_PROBS=has_q, BLOCK_D=_block_d(max_depth), BLOCK_V=VOCAB_BLOCK,
    )
    return output, num_accepted

