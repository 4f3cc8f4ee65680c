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
from dataclasses import dataclass

import torch

from cascade.sampling import BROKEN_ROW, SamplingParams, coupled_sample, finite_rows, sample_rows, warp_grouped
from cascade.verify.records import Draft
from cascade.verify.tree import Branch


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
    return [(tokens, rows) for tokens, rows, _ in _draft(stage, seq_ids, contexts, depths, eos_token_ids, sampling, 0)]


def draft_tree(
    stage, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
    eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None], siblings: int,
) -> list[Draft]:
    """:func:`draft_tokens`'s drafts, each with, beside each of its tokens, the ``siblings`` tokens the stage scored
    likeliest after it (by logit) as one-token branches (:mod:`cascade.verify.tree`): deterministic candidates given
    the rows the draft was drawn with, which the verifier tries when it rejects the draft's token there. They cost
    the drafter nothing: its rows were computed for the draft."""
    out = []
    for tokens, rows, others in _draft(stage, seq_ids, contexts, depths, eos_token_ids, sampling, siblings):
        branches = tuple(Branch(j, (token,)) for j, alternatives in enumerate(others) for token in alternatives)
        out.append(Draft(tokens, rows, branches))
    return out


def _draft(
    stage, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
    eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None], siblings: int,
) -> list[tuple[list[int], torch.Tensor | None, list[list[int]]]]:
    """The drafts, and per draft token its ``siblings`` likeliest alternatives."""
    tokens: list[list[int]] = [[] for _ in seq_ids]
    rows: list[list[torch.Tensor]] = [[] for _ in seq_ids]
    others: list[list[list[int]]] = [[] for _ in seq_ids]
    active = [b for b, k in enumerate(depths) if k > 0]
    while active:
        ids = [seq_ids[b] for b in active]
        contexts_now = [[*contexts[b], *tokens[b]] for b in active]
        ranked: list[list[int]] = [[] for _ in active]
        if not siblings and all(sampling[b] is None for b in active):
            chosen = [int(t[0]) for t in stage.argmax(ids, contexts_now, [1] * len(active))]
            chosen = [None if t == BROKEN_ROW else t for t in chosen]
        else:
            logits = stage.score(ids, contexts_now, [1] * len(active))  # [1, vocab] each
            chosen, drawn_from = _choose(logits, [sampling[b] for b in active], [len(c) for c in contexts_now],
                                         [len(tokens[b]) for b in active])
            for b, row in zip(active, drawn_from):
                if row is not None:
                    rows[b].append(row)
            if siblings:  # [active, siblings + 1]: enough to leave ``siblings`` once the chosen token is taken out
                ranked = torch.cat(logits).topk(siblings + 1, dim=-1).indices.tolist()
        broken = {b for b, token in zip(active, chosen) if token is None}
        for b, token, order in zip(active, chosen, ranked):
            if token is not None:
                tokens[b].append(token)
                if siblings:
                    others[b].append([t for t in order if t != token][:siblings])
        active = [b for b in active if b not in broken and len(tokens[b]) < depths[b] and tokens[b][-1] not in eos_token_ids]
    return [(t, (r[0] if len(r) == 1 else torch.cat(r)) if r else None, o) for t, r, o in zip(tokens, rows, others)]


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
