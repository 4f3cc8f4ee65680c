"""Draft trees: a chain with branches, verified exactly in one pass of the verifying stage (DESIGN.md, "Trees").

A tree here is a draft's chain (the *spine*, ``Draft.tokens``) with *branches*: each an alternative to the spine from
one position on (:class:`Branch` ``at`` j: its first token competes with spine token j as a child of spine token
j - 1, or of the context's last token for j = 0; its later tokens continue it as a chain). That covers the trees
this engine proposes — the drafter's next-likeliest token beside each of its draft tokens, an n-gram drafter's other
continuations — and keeps every piece of chain code (``Draft.tokens`` is still the path tried first).

Flattened for the verifying stage's one pass, the tree is its nodes in order — the spine, then each branch — each
with its parent's index (-1: the context's last token) and its depth (its distance from the context). The pass gives
``1 + nodes`` rows: row 0 after the context, row 1 + n after node n.

A step's trees are verified together through the ``Verifier`` dispatch (:func:`verify_trees_matching`,
:func:`verify_trees_sampling`): laid out like the chains' ragged batch — every request's node tokens and parents (each
within its request) flat, ``cu_num_nodes`` [batch + 1], the verifier's rows ``[num_nodes + batch, vocab]`` with request
b's ``1 + nodes`` rows from ``cu[b] + b`` — by the reference below (matching one request at a time; sampling with every
request's walk advanced together, one tensor operation per sibling tested across the batch: the rule of
:func:`verify_tree_sampling`, walked per tree, is what tests check it against) or by the Triton kernels
(:mod:`cascade.verify.triton_trees`), one program per request.

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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cascade.sampling import sample_rows

if TYPE_CHECKING:
    from cascade.verify.dispatch import Verifier

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


def tree_draws(nodes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers a tree's verification by sampling uses, drawn before it starts (so every implementation
    reads the same ones): a uniform per node, used when that node is tested, and one for the token drawn at the end.
    Each is independent of everything the test it serves depends on, which is all the exactness argument needs."""
    return torch.rand(nodes, generator=generator), torch.rand(1, generator=generator)


def verify_tree_sampling(
    flat: Flat,
    p: torch.Tensor,  # [1 + nodes, vocab]: the verifier's warped rows, row 0 after the context
    q: torch.Tensor | None,  # [nodes, vocab]: the row each node was sampled from (all-zero: a deterministic
    # candidate, tested as one-hot); None: every node is deterministic
    uniforms: torch.Tensor,  # [nodes]: node n's accept test reads uniforms[n] (tree_draws)
    final: torch.Tensor,  # [1]: the draw of the token after the accepted path
) -> tuple[list[int], list[int]]:
    """Recursive rejection sampling down the tree (the module docstring states the rule and why it is exact).
    Returns the committed tokens and the accepted nodes.

    The residual is kept unnormalised, as a row ``r`` and its scale ``m`` (the distribution is ``r / m``; at each
    node ``r`` starts as the verifier's row with ``m = 1``): child x is accepted when ``u · s(x) · m < r(x)``, and a
    rejection sets ``r ← max(r − m·s, 0)``, ``m ← Σ r`` (float64 sum, kept as float32), which is the normalised rule
    multiplied through by ``m`` — the form the kernels compute, in the same float32 operations."""
    kids = children(flat)
    node, path = ROOT, []
    while True:
        r, m = p[node + 1], torch.ones((), dtype=p.dtype, device=p.device)  # [vocab], its scale
        follow = None
        for child in kids[node]:
            x = flat.tokens[child]
            s = _proposal(q, child, x, r)
            if s[x] > 0 and uniforms[child].to(p.dtype) * s[x] * m < r[x]:
                follow = child
                break
            residual = (r - m * s).clamp_(min=0)
            mass = residual.double().sum().to(p.dtype)
            if mass > 0:  # (rounding may leave no mass: r is what the residual approximates then)
                r, m = residual, mass
        if follow is None:
            drawn = int(sample_rows(r[None], final.to(torch.float64))[0])
            return [flat.tokens[n] for n in path] + [drawn], path
        path.append(follow)
        node = follow


def _proposal(q: torch.Tensor | None, child: int, token: int, like: torch.Tensor) -> torch.Tensor:
    """The distribution ``child``'s token was proposed from: its q row, or one-hot for a deterministic candidate."""
    if q is not None and bool(q[child].any()):
        return q[child]
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token], device=like.device), 1.0)


Walk = tuple[list[int], list[int]]  # the committed tokens, and the accepted nodes


def verify_trees_matching(verifier: Verifier, trees: Sequence[Flat], chosen: Sequence[torch.Tensor]) -> list[Walk]:
    """Every tree of a step by matching (greedy, coupled); ``chosen[b]``: the verifier's own token at each of tree
    b's ``1 + nodes`` rows, on its device."""
    tokens, parents, cu = _layout(trees, chosen[0].device)
    return _walks(trees, *verifier.tree_matching(tokens, parents, cu, torch.cat(list(chosen))))


def verify_trees_sampling(
    verifier: Verifier,
    trees: Sequence[Flat],
    p: Sequence[torch.Tensor],  # [1 + nodes, vocab] each: the verifier's warped rows
    q: Sequence[torch.Tensor | None],  # [nodes, vocab] each (zero rows: deterministic candidates), or None
    generators: Sequence[torch.Generator],
) -> list[Walk]:
    """Every tree of a step by recursive rejection over siblings, request b drawing from ``generators[b]``
    (:func:`tree_draws`, the same numbers whatever else is in the batch)."""
    device = p[0].device
    tokens, parents, cu = _layout(trees, device)
    draws = [tree_draws(len(tree.tokens), g) for tree, g in zip(trees, generators)]
    uniforms, finals = (torch.cat([d[i] for d in draws]).to(device) for i in (0, 1))
    rows = None
    if any(part is not None for part in q):
        rows = torch.cat([part if part is not None else rows_b.new_zeros(len(tree.tokens), rows_b.shape[-1])
                          for part, rows_b, tree in zip(q, p, trees)])  # [num_nodes, vocab]
    sampled = rows.any(-1) if rows is not None else torch.zeros(tokens.shape, dtype=torch.bool, device=device)
    return _walks(trees, *verifier.tree_sampling(tokens, parents, sampled, cu, rows, torch.cat(list(p)), uniforms,
                                                 finals))


def _layout(trees: Sequence[Flat], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's trees flat: node tokens [num_nodes], parents [num_nodes], cu_num_nodes [batch + 1]."""
    tokens = torch.tensor([t for tree in trees for t in tree.tokens], dtype=torch.long, device=device)
    parents = torch.tensor([n for tree in trees for n in tree.parents], dtype=torch.long, device=device)
    cu = torch.tensor([0, *itertools.accumulate(len(tree.tokens) for tree in trees)], dtype=torch.long, device=device)
    return tokens, parents, cu


def _walks(trees: Sequence[Flat], path: torch.Tensor, num: torch.Tensor, final: torch.Tensor) -> list[Walk]:
    path, num, final = path.tolist(), num.tolist(), final.tolist()  # the one host synchronisation
    return [([tree.tokens[n] for n in row[:k]] + [token], row[:k]) for tree, row, k, token in zip(trees, path, num, final)]


def reference_matching(tokens: torch.Tensor, parents: torch.Tensor, cu_num_nodes: torch.Tensor,
                       chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batched layout's matching, one request at a time (:func:`verify_tree_matching`): the accepted nodes
    [batch, max_nodes] (-1 after them), their count [batch] and the token after them [batch]."""
    return _one_by_one(tokens, parents, cu_num_nodes, lambda b, s, e, flat: verify_tree_matching(
        flat, chosen[s + b: e + b + 1].tolist()))


def reference_sampling(tokens: torch.Tensor, parents: torch.Tensor, sampled: torch.Tensor, cu_num_nodes: torch.Tensor,
                       q: torch.Tensor | None, p: torch.Tensor, uniforms: torch.Tensor, final_uniforms: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batched layout's recursive rejection (:func:`verify_tree_sampling`'s rule and float32 operations), every
    request's walk advanced together: each pass of the loop tests one child of every request still walking, with one
    set of tensor operations over those requests (a request's tests are sequential, the requests are not). Returns
    as :func:`reference_matching`."""
    cu, batch = cu_num_nodes.tolist(), cu_num_nodes.numel() - 1
    device, dtype = p.device, p.dtype
    flat_tokens, flat_parents, drawn = tokens.tolist(), parents.tolist(), sampled.tolist()
    kids = [children(Flat(flat_tokens[s:e], flat_parents[s:e], [])) for s, e in zip(cu, cu[1:])]
    uniforms = uniforms.to(dtype)
    node, tried, paths = [ROOT] * batch, [0] * batch, [[] for _ in range(batch)]
    r = p[torch.tensor([cu[b] + b for b in range(batch)], dtype=torch.long, device=device)]  # [batch, vocab]
    m = torch.ones(batch, dtype=dtype, device=device)
    walking = [b for b in range(batch) if kids[b][ROOT]]

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    while walking:
        tested = [kids[b][node[b]][tried[b]] for b in walking]  # the child each tests now (within its tree)
        at = [cu[b] + c for b, c in zip(walking, tested)]  # its index in the flat layout
        rows, x = index(walking), index([flat_tokens[i] for i in at])
        is_drawn = [bool(drawn[i]) for i in at]
        r_x, m_now = r[rows, x], m[rows]
        s_x = torch.ones_like(r_x)  # a deterministic candidate's proposal: one-hot at x
        drawn_at = [j for j, d in enumerate(is_drawn) if d]
        if drawn_at:
            s_x[drawn_at] = q[index([at[j] for j in drawn_at]), x[drawn_at]].to(dtype)
        accept = ((s_x > 0) & (uniforms[at] * s_x * m_now < r_x)).tolist()  # (one-hot: u · 1 · m, the same product)
        # Rejected: r ← max(r − m·s, 0) and m ← Σ r where that leaves mass (rounding may leave none: r stays).
        sampled_out = [j for j in drawn_at if not accept[j]]
        if sampled_out:
            j = index(sampled_out)
            residual = (r[rows[j]] - m_now[j, None] * q[index([at[i] for i in sampled_out])].to(dtype)).clamp_(min=0)
            mass = residual.double().sum(-1).to(dtype)
            keep = mass > 0
            r[rows[j][keep]], m[rows[j][keep]] = residual[keep], mass[keep]
        fixed_out = [j for j, d in enumerate(is_drawn) if not d and not accept[j]]
        if fixed_out:  # one-hot s: the same operations change r[x] alone, so they are done in place
            j = index(fixed_out)
            r[rows[j], x[j]] = (r_x[j] - m_now[j]).clamp_(min=0)
            mass = r[rows[j]].double().sum(-1).to(dtype)
            keep = mass > 0
            r[rows[j][~keep], x[j][~keep]] = r_x[j][~keep]
            m[rows[j][keep]] = mass[keep]
        still, followed = [], []
        for b, child, took in zip(walking, tested, accept):
            if took:
                paths[b].append(child)
                node[b], tried[b] = child, 0
                followed.append(b)
                if kids[b][child]:
                    still.append(b)
            else:
                tried[b] += 1
                if tried[b] < len(kids[b][node[b]]):
                    still.append(b)
        if followed:  # an accepted child: its own row starts afresh
            moved = index(followed)
            r[moved] = p[index([cu[b] + b + 1 + node[b] for b in followed])]
            m[moved] = 1.0
        walking = still
    final = sample_rows(r, final_uniforms.to(torch.float64)).tolist() if batch else []
    return _packed(cu, paths, final, device)


def _one_by_one(tokens, parents, cu_num_nodes, walk):
    cu, paths, finals = cu_num_nodes.tolist(), [], []
    for b, (s, e) in enumerate(zip(cu, cu[1:])):
        flat = Flat(tokens[s:e].tolist(), parents[s:e].tolist(), [0] * (e - s))  # (depths: not needed to verify)
        committed, nodes = walk(b, s, e, flat)
        paths.append(nodes)
        finals.append(committed[-1])
    return _packed(cu, paths, finals, cu_num_nodes.device)


def _packed(cu: list[int], paths: list[list[int]], finals: list[int], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's accepted nodes and drawn token as the batched layout returns them: the nodes [batch, widest
    tree] (-1 after them), their count [batch], the token after them [batch]."""
    width = max([e - s for s, e in zip(cu, cu[1:])] + [1])
    path = torch.full((len(paths), width), -1, dtype=torch.long)
    for b, nodes in enumerate(paths):
        path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
    num = torch.tensor([len(nodes) for nodes in paths], dtype=torch.long)
    return path.to(device), num.to(device), torch.tensor(finals, dtype=torch.long).to(device)
