"""Draft trees' verification (:mod:`cascade.verify.tree`) as Triton kernels: one program per request walks its tree
from the root, computing what the reference there computes from the same inputs (the random draws come in as
tensors) — matching follows the first child (in index order) whose token is the verifier's own; sampling tests each
child against the residual kept unnormalised in a scratch row (``u · s(x) · m < r(x)``, then ``r ← max(r − m·s, 0)``,
``m ← Σ r`` in float64), in the same float32 operations, and draws the token after the path as
:func:`cascade.sampling.sample_rows` does (float64 cumulative sums, block by block). The two agree except where a
draw, or a residual's mass summed in another order, falls within rounding of a boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cascade.verify.triton_kernels import VOCAB_BLOCK


@triton.jit
def _tree_matching_kernel(
    tokens_ptr,  # [num_nodes] int64
    parents_ptr,  # [num_nodes] int64: each node's parent within its request, -1 for a child of the context
    cu_ptr,  # [batch + 1] int64
    chosen_ptr,  # [num_nodes + batch] int64: the verifier's own token at each row (row 0 of a request after its context)
    path_ptr,  # [batch, max_nodes] int64: the accepted nodes
    num_ptr,  # [batch] int64
    final_ptr,  # [batch] int64: the verifier's token after the accepted path
    max_nodes,
    BLOCK_N: tl.constexpr,  # a power of two >= max_nodes
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n
    parents = tl.load(parents_ptr + start + offs, mask=valid, other=-2)
    tokens = tl.load(tokens_ptr + start + offs, mask=valid, other=-1)
    node = tl.zeros([], tl.int32) - 1
    count = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    final = tl.zeros([], tl.int64)
    for _ in range(0, n + 1):  # a path has at most n nodes, and one more level finds no child
        want = tl.load(chosen_ptr + start + b + 1 + node)
        # the first child (lowest index: spine child, then branches as given) whose token is the verifier's
        follow = tl.min(tl.where(valid & (parents == node) & (tokens == want), offs, BLOCK_N), axis=0)
        live = done == 0
        found = live & (follow < BLOCK_N)
        tl.store(path_ptr + b * max_nodes + count, follow.to(tl.int64), mask=found)
        count = tl.where(found, count + 1, count)
        node = tl.where(found, follow, node)
        final = tl.where(live & (follow >= BLOCK_N), want, final)
        done = tl.where(live & (follow >= BLOCK_N), 1, done)
    tl.store(num_ptr + b, count.to(tl.int64))
    tl.store(final_ptr + b, final)


@triton.jit
def _tree_sampling_kernel(
    tokens_ptr,  # [num_nodes] int64
    parents_ptr,  # [num_nodes] int64
    sampled_ptr,  # [num_nodes] int32: 1 where the node was sampled from its q row, 0 for a deterministic candidate
    cu_ptr,  # [batch + 1] int64
    q_ptr,  # [num_nodes, vocab] float32 (unused without HAS_Q)
    p_ptr,  # [num_nodes + batch, vocab] float32
    uniforms_ptr,  # [num_nodes] float32: node n's accept test
    final_uniforms_ptr,  # [batch] float32
    scratch_ptr,  # [batch, vocab] float32: the request's residual row
    path_ptr,  # [batch, max_nodes] int64
    num_ptr,  # [batch] int64
    final_ptr,  # [batch] int64
    vocab,
    max_nodes,
    stride_q,
    stride_p,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    residual = scratch_ptr + b * vocab
    node = tl.zeros([], tl.int32) - 1
    count = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    final = tl.zeros([], tl.int64)
    for _ in range(0, n + 1):
        if done == 0:
            row = start + b + 1 + node  # the verifier's row after the node: r starts as it, with scale m = 1
            for vstart in range(0, vocab, BLOCK_V):
                voffs = vstart + tl.arange(0, BLOCK_V)
                vmask = voffs < vocab
                tl.store(residual + voffs, tl.load(p_ptr + row * stride_p + voffs, mask=vmask, other=0.0), mask=vmask)
            m = tl.full([], 1.0, tl.float32)
            follow = tl.zeros([], tl.int32) - 1
            for c in range(0, n):  # the node's children in index order, until one is accepted
                parent = tl.load(parents_ptr + start + c)
                if (follow < 0) & (parent == node):
                    x = tl.load(tokens_ptr + start + c)
                    sampled = tl.load(sampled_ptr + start + c)
                    s_x = tl.full([], 1.0, tl.float32)
                    if HAS_Q:
                        s_x = tl.where(sampled != 0, tl.load(q_ptr + (start + c) * stride_q + x), 1.0)
                    u = tl.load(uniforms_ptr + start + c)
                    if (s_x > 0.0) & (u * s_x * m < tl.load(residual + x)):
                        follow = c
                    else:  # r <- max(r - m*s, 0), m <- its sum (kept where rounding leaves no mass)
                        total = tl.zeros([], tl.float64)
                        for vstart in range(0, vocab, BLOCK_V):
                            voffs = vstart + tl.arange(0, BLOCK_V)
                            vmask = voffs < vocab
                            r = tl.load(residual + voffs, mask=vmask, other=0.0)
                            s = _tree_proposal(q_ptr, start + c, x, sampled, voffs, vmask, stride_q, HAS_Q)
                            total += tl.sum(tl.maximum(r - m * s, 0.0).to(tl.float64), axis=0)
                        if total > 0.0:
                            for vstart in range(0, vocab, BLOCK_V):
                                voffs = vstart + tl.arange(0, BLOCK_V)
                                vmask = voffs < vocab
                                r = tl.load(residual + voffs, mask=vmask, other=0.0)
                                s = _tree_proposal(q_ptr, start + c, x, sampled, voffs, vmask, stride_q, HAS_Q)
                                tl.store(residual + voffs, tl.maximum(r - m * s, 0.0), mask=vmask)
                            m = total.to(tl.float32)
            if follow >= 0:
                tl.store(path_ptr + b * max_nodes + count, follow.to(tl.int64))
                count += 1
                node = follow
            else:  # no child accepted: the token after the path is drawn from the residual (as sample_rows does)
                total = tl.zeros([], tl.float64)
                for vstart in range(0, vocab, BLOCK_V):
                    voffs = vstart + tl.arange(0, BLOCK_V)
                    total += tl.sum(tl.load(residual + voffs, mask=voffs < vocab, other=0.0).to(tl.float64), axis=0)
                threshold = tl.load(final_uniforms_ptr + b).to(tl.float64) * total
                carry = tl.zeros([], tl.float64)
                drawn = vocab
                last = 0
                for vstart in range(0, vocab, BLOCK_V):
                    voffs = vstart + tl.arange(0, BLOCK_V)
                    w = tl.load(residual + voffs, mask=voffs < vocab, other=0.0).to(tl.float64)
                    cumulative = carry + tl.cumsum(w, axis=0)
                    drawn = tl.minimum(drawn, tl.min(tl.where((cumulative > threshold) & (voffs < vocab), voffs, vocab),
                                                     axis=0))
                    last = tl.maximum(last, tl.max(tl.where(w > 0.0, voffs, 0), axis=0))
                    carry += tl.sum(w, axis=0)
                final = tl.where(drawn < vocab, drawn, last).to(tl.int64)
                done = tl.full([], 1, tl.int32)
    tl.store(num_ptr + b, count.to(tl.int64))
    tl.store(final_ptr + b, final)


@triton.jit
def _tree_proposal(q_ptr, node, token, sampled, voffs, vmask, stride_q, HAS_Q: tl.constexpr):
    """One block of the row a node was proposed from: its q row where it was sampled, else one-hot at its token."""
    one_hot = tl.where(voffs == token, 1.0, 0.0)
    if HAS_Q:
        with_q = vmask & ((tl.zeros(voffs.shape, tl.int32) + sampled) != 0)
        q = tl.load(q_ptr + node * stride_q + voffs, mask=with_q, other=0.0)
        return tl.where(with_q, q, one_hot)
    return one_hot


def tree_matching(
    tokens: torch.Tensor,  # [num_nodes] int64 (at least one element: the dispatch pads an empty batch's)
    parents: torch.Tensor,  # [num_nodes] int64
    cu_num_nodes: torch.Tensor,  # [batch + 1] int64
    chosen: torch.Tensor,  # [num_nodes + batch] int64
    max_nodes: int,  # the widest tree's nodes (at least 1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy and coupled trees: (accepted nodes [batch, max_nodes], their count [batch], the token after [batch])."""
    path, num, final = _tree_outputs(cu_num_nodes.numel() - 1, max_nodes, chosen.device)
    if num.numel():
        _tree_matching_kernel[(num.numel(),)](
            tokens, parents, cu_num_nodes.to(torch.int64).contiguous(), chosen.contiguous(), path, num, final,
            max_nodes, BLOCK_N=triton.next_power_of_2(max_nodes),
        )
    return path, num, final


def tree_sampling(
    tokens: torch.Tensor,  # [num_nodes] int64
    parents: torch.Tensor,  # [num_nodes] int64
    sampled: torch.Tensor,  # [num_nodes] bool
    cu_num_nodes: torch.Tensor,  # [batch + 1] int64
    q: torch.Tensor | None,  # [num_nodes, vocab] float32
    p: torch.Tensor,  # [num_nodes + batch, vocab] float32
    uniforms: torch.Tensor,  # [num_nodes] float32
    final_uniforms: torch.Tensor,  # [batch] float32
    max_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled trees, by recursive rejection over siblings: as :func:`tree_matching` returns."""
    path, num, final = _tree_outputs(cu_num_nodes.numel() - 1, max_nodes, p.device)
    if num.numel():
        p = p.contiguous()
        has_q = q is not None and q.numel() > 0
        q = q.contiguous() if has_q else p  # a placeholder pointer when unused
        scratch = torch.empty_like(p[: num.numel()])  # [batch, vocab]: each request's residual row
        _tree_sampling_kernel[(num.numel(),)](
            tokens, parents, sampled.to(torch.int32), cu_num_nodes.to(torch.int64).contiguous(), q, p, uniforms,
            final_uniforms.contiguous(), scratch, path, num, final, p.shape[1], max_nodes, q.stride(0), p.stride(0),
            HAS_Q=has_q, BLOCK_V=VOCAB_BLOCK,
        )
    return path, num, final


def _tree_outputs(batch: int, max_nodes: int, device: torch.device):
    path = torch.full((batch, max_nodes), -1, dtype=torch.int64, device=device)
    return path, torch.empty(batch, dtype=torch.int64, device=device), torch.empty_like(path[:, 0])
