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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cascade.sampling import BROKEN_ROW, SamplingParams, coupled_sample, finite_rows, sample_rows, warp_grouped
from cascade.verify.records import Draft
from cascade.verify.tree import Branch, Flat, flatten


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
    return [(t, (r[0] if len(r) == 1 else torch.cat(r)) if r else None) for t, r in zip(tokens, rows)]


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
    first scores the tree so far in one tree pass of the stage (``score_tree``), so a tree takes as many passes as a
    chain, each over the positions the tree holds. Branch tokens are deterministic given the stage's rows (one-hot
    proposals), as exact verification of a tree needs (:mod:`cascade.verify.tree`)."""
    deep = getattr(stage, "scores_trees", False)  # else (transformers' forward) branches stay one token long
    grown = [_Tree(siblings * depth) for depth in depths]
    active = [b for b, k in enumerate(depths) if k > 0]
    while active:
        trees = [grown[b].flat() if deep else None for b in active]
        scored = [list(contexts[b]) if tree else [*contexts[b], *grown[b].tokens] for b, tree in zip(active, trees)]
        positions = [1 + len(tree.tokens) if tree else 1 for tree in trees]
        ids = [seq_ids[b] for b in active]
        logits = stage.score_tree(ids, scored, positions, trees) if deep else stage.score(ids, scored, positions)
        # row 0 follows the context; row 1 + n follows node n (the draft's last token is node len - 1)
        fronts = [rows[len(grown[b].tokens) if tree else 0][None] for b, tree, rows in zip(active, trees, logits)]
        chosen, drawn_from = _choose(fronts, [sampling[b] for b in active],
                                     [len(contexts[b]) + len(grown[b].tokens) for b in active],
                                     [len(grown[b].tokens) for b in active])
        ends = [grown[b].ends() if tree else [] for b, tree in zip(active, trees)]
        probs = torch.cat([rows[[0 if tree is None else len(grown[b].tokens), *[1 + n for n in end]]]
                           for b, tree, rows, end in zip(active, trees, logits, ends)]).float().softmax(-1)
        firsts = [0]
        for end in ends:
            firsts.append(firsts[-1] + 1 + len(end))
        drawn = probs[firsts[:-1], [0 if token is None else token for token in chosen]]
        top = probs.topk(siblings + 1, dim=-1)
        top_ids, top_p, drawn = top.indices.tolist(), top.values.tolist(), drawn.tolist()  # one host transfer
        for i, (b, token, row) in enumerate(zip(active, chosen, drawn_from)):
            tree, first = grown[b], firsts[i]
            if token is None:  # a broken row: the draft stops here, its branches as they are
                tree.stopped = True
                continue
            others = [(t, p) for t, p in zip(top_ids[first], top_p[first]) if t != token][:siblings]
            extensions = [(top_ids[first + 1 + n][0], top_p[first + 1 + n][0]) for n in range(len(ends[i]))]
            extensions += [None] * (len(tree.branches) - len(extensions))
            tree.grow(token, row, drawn[i], others, extensions, depths[b], eos_token_ids)
        active = [b for b in active if not grown[b].stopped and len(grown[b].tokens) < depths[b]
                  and grown[b].tokens[-1] not in eos_token_ids]
    return [tree.draft() for tree in grown]


@dataclass(slots=True)
class _Branch:
    at: int  # the draft position it forks at
    tokens: list[int]
    values: list[float]  # the stage's probability of the path to each of its tokens


@dataclass(slots=True)
class _Tree:
    """One sequence's draft tree while it is drafted: the draft (spine) and its branches, best-first."""

    budget: int  # the most branch nodes
    tokens: list[int] = field(default_factory=list)  # the draft
    rows: list[torch.Tensor] = field(default_factory=list)  # independent samples: the rows they were drawn from
    value: float = 1.0  # the stage's probability of the draft so far
    branches: list[_Branch] = field(default_factory=list)
    stopped: bool = False

    def flat(self) -> Flat | None:
        """The tree as the stage scores it (None while it is a chain)."""
        return flatten(self.tokens, self._as_branches()) if self.branches else None

    def ends(self) -> list[int]:
        """The node index of each branch's last token, in the order :meth:`flat` lays them out."""
        out, node = [], len(self.tokens)
        for branch in self.branches:
            node += len(branch.tokens)
            out.append(node - 1)
        return out

    def grow(self, token: int, row: torch.Tensor | None, p_token: float, others: list[tuple[int, float]],
             extensions: list[tuple[int, float] | None], depth: int, eos_token_ids: Sequence[int]) -> None:
        """A pass's result: the draft's next ``token`` (probability ``p_token``, drawn from ``row`` when sampled
        independently), the ``others`` the stage ranked next there, and each branch's argmax with its probability
        (None: not scored); the most valuable nodes within the budget stay."""
        position = len(self.tokens)
        candidates = [
            _Branch(b.at, [*b.tokens, more[0]], [*b.values, b.values[-1] * more[1]])
            if more is not None and b.at + len(b.tokens) < depth and b.tokens[-1] not in eos_token_ids else b
            for b, more in zip(self.branches, extensions, strict=True)
        ] + [_Branch(position, [t], [self.value * p]) for t, p in others]
        self.tokens.append(token)
        if row is not None:
            self.rows.append(row)
        self.value *= p_token
        # Best-first within the budget: a node is kept with its ancestors (its value is at most its parent's; at a tie
        # the shallower node ranks first, so a kept node's parent is always kept).
        ranked = sorted(((-v, b.at + k, n, k) for n, b in enumerate(candidates) for k, v in enumerate(b.values)))
        keep = [0] * len(candidates)
        for _, _, n, k in ranked[: self.budget]:
            keep[n] = max(keep[n], k + 1)
        self.branches = [_Branch(b.at, b.tokens[:n], b.values[:n]) for b, n in zip(candidates, keep) if n]

    def _as_branches(self) -> list[Branch]:
        return [Branch(b.at, tuple(b.tokens)) for b in self.branches]

    def draft(self) -> Draft:
        """The tree as a draft: the spine with its branches, the likeliest first at each fork."""
        branches = sorted(self.branches, key=lambda b: (b.at, -b.values[0]))
        rows = (self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)) if self.rows else None
        return Draft(self.tokens, rows, tuple(Branch(b.at, tuple(b.tokens)) for b in branches))


def _choose(
    logits: list[torch.Tensor], sampling: list[DraftSampling | None], positions: list[int], drawn: list[int]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One token per row of ``logits`` ([1, vocab] each, on the stage's device), and for each independent sample
    the row ``q`` it was drawn from ([1, vocab]; None for the others); None in place of the token of a row that is
    not finite (:func:`~cascade.sampling.finite_rows`). Only token ids and the rows' health come back to the host,
    together."""
    chosen: list[torch.Tensor | None] = [None] * len(logits)
    drawn_from: list[torch.Tensor | None] = [None] * len(logits)
    independent = []
    for i, (row, how) in enumerate(zip(logits, sampling)):
        if how is None:
            chosen[i] = row.argmax(-1)
        elif how.seed is not None:
            chosen[i] = coupled_sample(row, how.params, how.seed, positions[i])
        else:
            independent.append(i)
    if independent:
        q = warp_grouped([logits[i] for i in independent], [sampling[i].params for i in independent])
        uniforms = torch.tensor([sampling[i].uniforms[drawn[i]] for i in independent])
        sampled = sample_rows(torch.cat(q), uniforms.to(q[0].device))  # [independent]
        for n, i in enumerate(independent):
            chosen[i], drawn_from[i] = sampled[n : n + 1], q[n]
    healthy = finite_rows(torch.cat(logits))  # [rows]: a broken row's token (drawn from NaNs) is dropped
    ids, ok = torch.stack([torch.cat(chosen), healthy.long()]).tolist()  # the one host synchronisation
    return [token if good else None for token, good in zip(ids, ok)], drawn_from
