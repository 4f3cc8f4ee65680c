"""A model stage's whole draft in one call: ``depth`` tokens, one batched forward pass per token.

The bottom model of a chain drafts autoregressively, and each of its tokens is drawn the way its request draws:
the argmax (greedy), a sample with the request's shared noise (coupled: seeded requests, DESIGN.md "Randomness"),
or a sample by inverting the warped distribution's CDF with a fresh uniform the engine drew from the request's
generator (independent). Doing the whole draft inside the stage makes a remote stage's draft one call, not one per
token, and returns what verification needs: the token ids, and for independent samples the distributions ``q``
they were drawn from (``[len(tokens), vocab]``, on the stage's device; none for greedy and coupled drafts, which
are verified by comparing ids).

Exactness: token j of a draft is an exact sample of the stage's warped distribution given the context and the
draft's tokens before it, with randomness used for nothing else — the same draw as the one-token rounds it
replaces, so the verification above sees drafts distributed as the ``q`` it is given.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cascade.sampling import BROKEN_ROW, SamplingParams, coupled_sample, finite_rows, sample_rows, warp_grouped
from cascade.verify.records import Draft
from cascade.verify.tree import ROOT, Branch, Flat


@dataclass(frozen=True, slots=True)
class DraftSampling:
    """How one sequence's draft tokens are drawn (None in its place: greedy)."""

    params: SamplingParams
    seed: int | None = None  # coupled: the request's shared noise, keyed by absolute position
    uniforms: tuple[float, ...] = ()  # independent: one U[0, 1) per draft token


def draft_tokens(
    stage, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
    eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None],
) -> list[tuple[list[int], torch.Tensor | None]]:
    """Up to ``depths[b]`` tokens of ``stage`` (a ``ModelStage``) continuing ``contexts[b]``, drawn as ``sampling[b]``
    says; a sequence leaves the batch at its depth or after any of ``eos_token_ids``. Returns per sequence its
    tokens and, for an independent sample, the rows ``q`` they were drawn from. A sequence whose logits row is not
    finite (NaN, +inf) stops drafting there: a shorter draft is still a draft, and its request goes on."""
    tokens: list[list[int]] = [[] for _ in seq_ids]
    rows: list[list[torch.Tensor]] = [[] for _ in seq_ids]
    active = [b for b, k in enumerate(depths) if k > 0]
    while active:
        ids = [seq_ids[b] for b in active]
        contexts_now = [[*contexts[b], *tokens[b]] for b in active]
        if all(sampling[b] is None for b in active):
            chosen = [int(t[0]) for t in stage.argmax(ids, contexts_now, [1] * len(active))]
            chosen = [None if t == BROKEN_ROW else t for t in chosen]
        else:
            logits = stage.score(ids, contexts_now, [1] * len(active))  # [1, vocab] each
            chosen, drawn_from = _choose(logits, [sampling[b] for b in active], [len(c) for c in contexts_now],
                                         [len(tokens[b]) for b in active])
            for b, row in zip(active, drawn_from):
                if row is not None:
                    rows[b].append(row)
        for b, token in zip(active, chosen):
            if token is not None:
                tokens[b].append(token)
        active = [b for b, token in zip(active, chosen)
                  if token is not None and len(tokens[b]) < depths[b] and tokens[b][-1] not in eos_token_ids]
    return [(t, _stacked(r)) for t, r in zip(tokens, rows)]


def draft_tree(
    stage, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
    eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None], siblings: int,
) -> list[Draft]:
    """:func:`draft_tokens`'s drafts grown into trees (:mod:`cascade.verify.tree`): beside a draft of depth d, up to
    ``siblings`` × d branch nodes, placed best-first by the stage's own confidence (EAGLE-2's rule, Li et al. 2024,
    with every branch forking from the draft). At each draft position the ``siblings`` tokens the stage scored
    likeliest after the one it drew are candidate branches, and a branch continues, one token a pass, with the stage's
    argmax after its last token. A node's value is the stage's probability of its path (the draft's tokens before the
    fork, then the branch's); after each pass the ``siblings`` × d most valuable nodes stay. Every pass after the
    first is one tree pass of the stage (``score_tree``) over the nodes the last one added, the earlier ones cached:
    a tree takes as many passes as a chain, each over a few more positions. Branch tokens are deterministic given the
    stage's rows (one-hot proposals), as exact verification of a tree needs (:mod:`cascade.verify.tree`). A stage
    without tree passes (transformers' forward) proposes one-token branches."""
    deep = getattr(stage, "scores_trees", False)
    grown = [_Tree(siblings * depth) for depth in depths]
    active = [b for b, k in enumerate(depths) if k > 0]
    while active:
        ids, trees = [seq_ids[b] for b in active], [grown[b].flat() if deep else None for b in active]
        if deep:  # the rows of the nodes the last pass added (the first pass: the row after the context)
            asked = [len(tree.tokens) - grown[b].scored if tree else 1 for b, tree in zip(active, trees)]
            logits = stage.score_tree(ids, [contexts[b] for b in active], asked, trees)
        else:
            logits = stage.score(ids, [[*contexts[b], *grown[b].spine_tokens()] for b in active], [1] * len(active))
        fronts = [rows[grown[b].front_row() if tree else 0][None] for b, tree, rows in zip(active, trees, logits)]
        chosen, drawn_from = _choose(fronts, [sampling[b] for b in active],
                                     [len(contexts[b]) + len(grown[b].spine) for b in active],
                                     [len(grown[b].spine) for b in active])
        # The stage's confidence in one host transfer: each row's likeliest tokens and their probabilities, and the
        # drawn token's probability
        probs = torch.cat(logits).float().softmax(-1)
        firsts = [0, *itertools.accumulate(len(rows) for rows in logits)][:-1]
        front_rows = [first + (grown[b].front_row() if tree else 0) for b, tree, first in zip(active, trees, firsts)]
        drawn = probs[front_rows, [0 if token is None else token for token in chosen]]  # [active]
        top = probs.topk(siblings + 1, dim=-1)  # [rows, siblings + 1] each
        width = top.indices.numel()  # (token ids are exact in float64)
        sent = torch.cat([top.indices.flatten().double(), top.values.flatten().double(), drawn.double()]).tolist()
        ranked = [list(zip(map(int, sent[i : i + siblings + 1]), sent[width + i : width + i + siblings + 1]))
                  for i in range(0, width, siblings + 1)]
        drawn = sent[2 * width :]
        for i, (b, token, row, first, rows) in enumerate(zip(active, chosen, drawn_from, firsts, logits)):
            tree = grown[b]
            if trees[i] is not None:
                tree.scored_rows(ranked[first : first + len(rows)])
            if token is None:  # a broken row: the draft stops here, its branches as they are
                tree.stopped = True
                continue
            tree.grow(token, row, drawn[i], ranked[front_rows[i]], siblings, depths[b], eos_token_ids, deep)
        active = [b for b in active if not grown[b].stopped and len(grown[b].spine) < depths[b]
                  and grown[b].nodes[grown[b].spine[-1]].token not in eos_token_ids]
    return [tree.draft() for tree in grown]


@dataclass(slots=True)
class _Node:
    token: int
    parent: int  # its parent node (ROOT: the context's last token)
    depth: int
    value: float  # the stage's probability of its path
    ranked: list[tuple[int, float]] | None = None  # once scored: the stage's likeliest tokens after it


@dataclass(slots=True)
class _Tree:
    """One sequence's draft tree while it is drafted: every node in the order it was made (the stage caches them in
    that order), the draft (spine) among them, and the branches now kept, best-first."""

    budget: int  # the most branch nodes
    nodes: list[_Node] = field(default_factory=list)
    spine: list[int] = field(default_factory=list)  # the draft's nodes
    branches: list[list[int]] = field(default_factory=list)  # each a chain of nodes forking from the spine
    rows: list[torch.Tensor] = field(default_factory=list)  # independent samples: the rows they were drawn from
    scored: int = 0  # the first nodes have their rows
    stopped: bool = False

    def flat(self) -> Flat | None:
        """Every node made so far, as the stage scores them (None before the first)."""
        if not self.nodes:
            return None
        return Flat([n.token for n in self.nodes], [n.parent for n in self.nodes], [n.depth for n in self.nodes])

    @property
    def value(self) -> float:
        """The stage's probability of the draft so far."""
        return self.nodes[self.spine[-1]].value if self.spine else 1.0

    def spine_tokens(self) -> list[int]:
        return [self.nodes[n].token for n in self.spine]

    def front_row(self) -> int:
        """The row, among a tree pass's (the nodes not scored before), after the draft's last token."""
        return self.spine[-1] - self.scored

    def scored_rows(self, ranked: list[list[tuple[int, float]]]) -> None:
        for node, likeliest in zip(self.nodes[self.scored :], ranked, strict=True):
            node.ranked = likeliest
        self.scored = len(self.nodes)

    def grow(self, token: int, row: torch.Tensor | None, p_token: float, ranked: list[tuple[int, float]],
             siblings: int, depth: int, eos_token_ids: Sequence[int], deep: bool) -> None:
        """A pass's result: the draft's next ``token`` (probability ``p_token``, drawn from ``row`` when sampled
        independently) and the tokens the stage ranked likeliest there; the branches grow by their argmax and the
        most valuable nodes within the budget stay."""
        position, fork = len(self.spine), self.spine[-1] if self.spine else ROOT
        # candidates: each branch with its next token (when its last node was scored), and the new forks
        chains = []  # [(kept nodes, (token, value) of a new one or None)]
        for branch in self.branches:
            last = self.nodes[branch[-1]]
            more = None
            if last.ranked and last.depth + 1 < depth and last.token not in eos_token_ids:
                more = (last.ranked[0][0], last.value * last.ranked[0][1])
            chains.append((branch, more))
        chains += [([], (t, self.value * p)) for t, p in ranked if t != token][:siblings]
        entries = []  # (-value, depth, chain, length with it)
        for c, (branch, more) in enumerate(chains):
            entries += [(-self.nodes[n].value, self.nodes[n].depth, c, k + 1) for k, n in enumerate(branch)]
            if more is not None:
                at = self.nodes[branch[-1]].depth + 1 if branch else position
                entries.append((-more[1], at, c, len(branch) + 1))
        keep = [0] * len(chains)  # a node's value is at most its parent's, and at a tie the shallower ranks first
        for _, _, c, length in sorted(entries)[: self.budget]:
            keep[c] = max(keep[c], length)
        self.spine.append(self._add(token, fork, position, self.value * p_token))
        if row is not None:
            self.rows.append(row)
        self.branches = []
        for (branch, more), length in zip(chains, keep):
            if length > len(branch):
                parent = branch[-1] if branch else fork
                branch = [*branch, self._add(more[0], parent, self.nodes[parent].depth + 1 if branch else position,
                                             more[1])]
                if not deep:
                    self.nodes[branch[-1]].ranked = []  # never scored: a one-token branch
            if length:
                self.branches.append(branch[:length])

    def _add(self, token: int, parent: int, depth: int, value: float) -> int:
        self.nodes.append(_Node(token, parent, depth, value))
        return len(self.nodes) - 1

    def draft(self) -> Draft:
        """The tree as a draft: the spine with its branches, the likeliest first at each fork."""
        branches = sorted(self.branches, key=lambda b: (self.nodes[b[0]].depth, -self.nodes[b[0]].value))
        return Draft(self.spine_tokens(), _stacked(self.rows), tuple(
            Branch(self.nodes[b[0]].depth, tuple(self.nodes[n].token for n in b)) for b in branches))


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """A draft's rows ``q`` ([1, vocab] each) as one [len, vocab] tensor; None for a draft without them."""
    return (rows[0] if len(rows) == 1 else torch.cat(rows)) if rows else None


def _choose(
    logits: list[torch.Tensor], sampling: list[DraftSampling | None], positions: list[int], drawn: list[int]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One token per row of ``logits`` ([1, vocab] each, on the stage's device), and for each independent sample
    the row ``q`` it was drawn from ([1, vocab]; None for the others); None in place of the token of a row that is
    not finite (:func:`~cascade.sampling.finite_rows`). Only token ids and the rows' health come back to the host,
    together."""
    chosen: list[torch.Tensor | None] = [None] * len(logits)
    drawn_from: list[torch.Tensor | None] = [None] * len(logits)
    independent, coupled = [], []
    for i, (row, how) in enumerate(zip(logits, sampling)):
        if how is None:
            chosen[i] = row.argmax(-1)
        elif how.seed is not None:
            coupled.append(i)
        else:
            independent.append(i)
    for i, tokens in zip(coupled, coupled_sample([logits[i] for i in coupled], [sampling[i].params for i in coupled],
                                                 [sampling[i].seed for i in coupled], [positions[i] for i in coupled])):
        chosen[i] = tokens
    if independent:
        q = warp_grouped([logits[i] for i in independent], [sampling[i].params for i in independent])
        uniforms = torch.tensor([sampling[i].uniforms[drawn[i]] for i in independent])
        sampled = sample_rows(torch.cat(q), uniforms.to(q[0].device))  # [independent]
        for n, i in enumerate(independent):
            chosen[i], drawn_from[i] = sampled[n : n + 1], q[n]
    healthy = finite_rows(torch.cat(logits))  # [rows]: a broken row's token (drawn from NaNs) is dropped
    ids, ok = torch.stack([torch.cat(chosen), healthy.long()]).tolist()  # the one host synchronisation
    return [token if good else None for token, good in zip(ids, ok)], drawn_from
