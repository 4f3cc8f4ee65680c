"""Draft trees: a chain with branches, verified exactly in one pass of the verifying stage (DESIGN.md, "Trees").

A tree here is a draft's chain (the *spine*, ``Draft.tokens``) with *branches*: each an alternative to the spine from
one position on (:class:`Branch` ``at`` j: its first token competes with spine token j as a child of spine token
j - 1, or of the context's last token for j = 0; its later tokens continue it as a chain). That covers the trees
this engine proposes — the drafter's next-likeliest token beside each of its draft tokens, an n-gram drafter's other
continuations — and keeps every piece of chain code (``Draft.tokens`` is still the path tried first).

Flattened for the verifying stage's one pass, the tree is its nodes in order — the spine, then each branch — each
with its parent's index (-1: the context's last token) and its depth (its distance from the context). The pass gives
``1 + nodes`` rows: row 0 after the context, row 1 + n after node n.

Verification walks from the root; at each node it tests the node's children in order (spine child first, then
branches in the order given) and follows the first it accepts:

- Matching (greedy, and coupled sampling): a child is accepted iff its token is the verifier's own token at the
  parent's row (its argmax, or its sample with the request's shared noise at that depth's absolute position). The
  committed path is the longest root path the verifier's tokens follow, then the verifier's token after it.
- Sampling (recursive rejection over siblings; SpecInfer, Miao et al. 2024; DESIGN.md's three cases). The parent's
  row gives the target distribution ``r = p``. Child x, proposed from a distribution ``s`` (its draft row ``q`` when
  it was sampled from the drafter; one-hot when it is a deterministic candidate: a top-k alternative or an n-gram
  continuation), is accepted with probability ``min(1, r(x) / s(x))``; on rejection the next sibling is tested
  against the residual ``r ← normalize(max(0, r − s))``. When no child is accepted the token is drawn from the last
  ``r`` (recovered; the bonus when the node has no children). Why it is exact: each test is a speculative-sampling
  step from ``r`` with proposal ``s`` — the token it outputs (x if accepted, otherwise a draw from the residual) is
  distributed as ``r`` — and replacing "a draw from the residual" by the next sibling's test against it keeps that
  true, whatever ``s`` is, provided each proposal is independent of the acceptance coins that came before (a
  sampled child is drawn by the drafter beforehand; a deterministic candidate is a function of the drafter's rows and
  of which siblings came before it). So the committed token at each depth follows the verifier's ``p`` given the
  committed prefix, by induction down the path. Dropping the residual update (testing every sibling against ``p``)
  over-produces the siblings' tokens: tests/test_tree.py plants that bug and sees it fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cascade.sampling import sample_rows

ROOT = -1  # the parent of a node that continues the context itself


@dataclass(frozen=True, slots=True)
class Branch:
    """An alternative to a draft's spine from position ``at`` on: ``tokens[0]`` competes with spine token ``at``
    (after those spine tokens before it), and the rest continue it as a chain."""

    at: int  # 0 <= at <= len(spine): the spine position it forks at
    tokens: tuple[int, ...]  # [length >= 1]
    probs: torch.Tensor | None = None  # [length, vocab]: the rows they were sampled from; None: deterministic
    # candidates (one-hot proposals)


@dataclass(frozen=True, slots=True)
class Flat:
    """A tree's nodes in the order the verifying stage scores them: the spine, then each branch."""

    tokens: list[int]  # [nodes]
    parents: list[int]  # [nodes]: each node's parent node, ROOT for a child of the context
    depths: list[int]  # [nodes]: 0 for a child of the context


def flatten(spine: Sequence[int], branches: Sequence[Branch]) -> Flat:
    """The nodes of the spine and its branches, spine first."""
    tokens, parents, depths = list(spine), [j - 1 for j in range(len(spine))], list(range(len(spine)))
    for branch in branches:
        assert 0 <= branch.at <= len(spine) and branch.tokens, branch
        parent = branch.at - 1
        for i, token in enumerate(branch.tokens):
            tokens.append(token)
            parents.append(parent)
            depths.append(branch.at + i)
            parent = len(tokens) - 1
    return Flat(tokens, parents, depths)


def children(flat: Flat) -> dict[int, list[int]]:
    """Each node's children in the order they are tested (spine child first, then branches as given)."""
    kids: dict[int, list[int]] = {ROOT: []}
    for node, parent in enumerate(flat.parents):
        kids.setdefault(parent, []).append(node)
        kids.setdefault(node, [])
    return kids


def spine_length(flat: Flat) -> int:
    """How many of the nodes are the spine (node j's parent is j - 1)."""
    n = 0
    while n < len(flat.parents) and flat.parents[n] == n - 1:
        n += 1
    return n


def verify_tree_matching(flat: Flat, chosen: Sequence[int]) -> tuple[list[int], list[int]]:
    """``chosen``: the verifier's own token at each of the ``1 + nodes`` rows. Returns the committed tokens (the
    accepted path, then the verifier's token after it) and the accepted nodes."""
    kids = children(flat)
    node, path = ROOT, []
    while True:
        want = chosen[node + 1]
        follow = next((c for c in kids[node] if flat.tokens[c] == want), None)
        if follow is None:
            return [flat.tokens[n] for n in path] + [want], path
        path.append(follow)
        node = follow


def verify_tree_sampling(
    flat: Flat,
    p: torch.Tensor,  # [1 + nodes, vocab]: the verifier's warped rows, row 0 after the context
    q: torch.Tensor | None,  # [nodes, vocab]: the row each node was sampled from (all-zero: a deterministic
    # candidate, tested as one-hot); None: every node is deterministic
    generator: torch.Generator,
) -> tuple[list[int], list[int]]:
    """Recursive rejection sampling down the tree (the module docstring states the rule and why it is exact). Draws
    one uniform from ``generator`` per child tested, then one for the token drawn at the end. Returns the committed
    tokens and the accepted nodes."""
    kids = children(flat)
    node, path = ROOT, []
    while True:
        r = p[node + 1]  # [vocab]
        follow = None
        for child in kids[node]:
            x = flat.tokens[child]
            s = _proposal(q, child, x, r)
            u = float(torch.rand((), generator=generator))
            s_x, r_x = float(s[x]), float(r[x])
            if s_x > 0 and u * s_x < r_x:
                follow = child
                break
            residual = (r - s).clamp_(min=0)
            mass = float(residual.sum())
            if mass > 0:  # (rounding may leave no mass: r is what the residual approximates then)
                r = residual / mass
        if follow is None:
            final = int(sample_rows(r[None], torch.rand(1, generator=generator))[0])
            return [flat.tokens[n] for n in path] + [final], path
        path.append(follow)
        node = follow


def _proposal(q: torch.Tensor | None, child: int, token: int, like: torch.Tensor) -> torch.Tensor:
    """The distribution ``child``'s token was proposed from: its q row, or one-hot for a deterministic candidate."""
    if q is not None and bool(q[child].any()):
        return q[child]
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token], device=like.device), 1.0)
