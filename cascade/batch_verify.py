"""Verification of a batch of rounds: the drafts of every request a stage verifies in one step, through the
``Verifier`` dispatch point (``cascade.ops``) in ``cascade.verify``'s ragged layout, with one host synchronisation.
Each request draws its random numbers from its own generator, in the same order whatever else is in the batch, so
what it samples does not depend on the batch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cascade.ops import Verifier
from cascade.sampling import SamplingParams, exponentials, sample_rows, warp


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: list[int]  # [depth]
    probs: torch.Tensor | None  # [depth, vocab]: the distribution each token was drawn from; None: one-hot (greedy
    # decoding, or the n-gram drafter)

    @staticmethod
    def empty() -> Draft:
        return Draft([], None)


@dataclass(frozen=True, slots=True)
class Verdict:
    tokens: list[int]  # [accepted + 1]: the accepted drafts, then the recovered or bonus token
    rows: torch.Tensor | None  # [accepted + 1, vocab]: the p row each token was drawn from (None when greedy)
    accepted: int
    expected: float | None  # Σ(1 − TV(p, q)) over the drafted positions, when sampling (for the controller)


def verify_greedy_batch(verifier: Verifier, drafts: Sequence[list[int]], argmax: Sequence[torch.Tensor]) -> list[Verdict]:
    """``argmax[b]``: the verifying stage's greedy tokens at request b's ``len(drafts[b]) + 1`` positions."""
    draft_ids, cu, max_depth = _flatten(drafts)
    output, num_accepted = verifier.greedy(draft_ids, cu, torch.cat(argmax), max_depth)
    accepted, output = num_accepted.tolist(), output.tolist()  # the one host synchronisation of the pass
    return [Verdict(row[: a + 1], None, a, None) for row, a in zip(output, accepted)]


def verify_sampling_batch(
    verifier: Verifier,
    drafts: Sequence[Draft],
    logits: Sequence[torch.Tensor],  # [len(drafts[b]) + 1, vocab] each
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    observe: Sequence[bool],  # per request: compute the expected acceptance for its controller
) -> list[Verdict]:
    p = _warp_grouped(logits, params)  # [positions[b], vocab] each
    vocab = p[0].shape[-1]
    verdicts: list[Verdict | None] = [None] * len(drafts)
    # An empty draft (a drafter's token, the target alone) is a plain sample of its one row, with one draw from
    # the request's generator.
    plain = [b for b, d in enumerate(drafts) if not d.tokens]
    if plain:
        uniforms = torch.cat([torch.rand(1, generator=generators[b]) for b in plain])  # [plain]
        tokens = sample_rows(torch.cat([p[b] for b in plain]), uniforms).tolist()
        for b, token in zip(plain, tokens):
            verdicts[b] = Verdict([token], p[b], 0, None)
    drafted = [b for b, d in enumerate(drafts) if d.tokens]
    if drafted:
        group = [drafts[b] for b in drafted]
        draft_ids, cu, max_depth = _flatten([d.tokens for d in group])
        q = None
        if any(d.probs is not None for d in group):
            q = torch.cat([_rows_of(d, vocab) for d in group])  # [num_tokens, vocab]
        uniforms = torch.cat([torch.rand(len(drafts[b].tokens), generator=generators[b]) for b in drafted])
        races = torch.cat([exponentials(1, vocab, generators[b]) for b in drafted])  # [batch, vocab]
        target_p = torch.cat([p[b] for b in drafted])
        output, num_accepted = verifier.sampling(draft_ids, cu, q, target_p, uniforms, races, max_depth)
        accepted, output = num_accepted.tolist(), output.tolist()  # the one host synchronisation of the pass
        for b, row, a in zip(drafted, output, accepted):
            draft, rows = drafts[b], p[b]
            n = len(draft.tokens)
            expected = expected_acceptance(rows[:n], draft.probs, torch.tensor(draft.tokens)) if observe[b] else None
            verdicts[b] = Verdict(row[: a + 1], rows[: a + 1], a, expected)
    return verdicts


def _flatten(drafts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ragged layout of ``cascade.verify``: draft_token_ids [num_tokens], cu_num_draft_tokens [batch + 1]."""
    lengths = [len(d) for d in drafts]
    cu = torch.tensor([0, *itertools.accumulate(lengths)])  # [batch + 1]
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long)  # [num_tokens]
    return ids, cu, max(lengths)


def _rows_of(draft: Draft, vocab: int) -> torch.Tensor:
    """The draft's q rows [depth, vocab]: its own, or one-hot rows for a one-hot draft."""
    if draft.probs is not None:
        return draft.probs
    return torch.nn.functional.one_hot(torch.tensor(draft.tokens, dtype=torch.long), vocab).float()


def _warp_grouped(logits: Sequence[torch.Tensor], params: Sequence[SamplingParams]) -> list[torch.Tensor]:
    """``warp`` of each request's rows, one call per distinct sampling setting in the batch."""
    out: list[torch.Tensor | None] = [None] * len(logits)
    for setting in dict.fromkeys(params):
        members = [b for b, p in enumerate(params) if p == setting]
        warped = warp(torch.cat([logits[b] for b in members]), setting)  # [Σ positions, vocab]
        for b, rows in zip(members, warped.split([logits[b].shape[0] for b in members])):
            out[b] = rows
    return out


def expected_acceptance(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor) -> float:
    """Σ_j (1 − TV(p_j, q_j)) = Σ_j Σ_x min(p_j(x), q_j(x)): the expected number of accepted positions if each
    were tested, observed without sampling noise. p, q: [n, vocab]; q None means one-hot drafts."""
    if q is None:
        return float(p.gather(1, draft_ids[:, None]).sum())
    return float(torch.minimum(p, q).sum())
