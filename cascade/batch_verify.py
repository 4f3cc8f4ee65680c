"""Verification of a batch of rounds: the drafts of every request a stage verifies in one step, through the
``Verifier`` dispatch point (``cascade.ops``) in ``cascade.verify``'s ragged layout, with one host synchronisation.
Each request draws its random numbers from its own generator, in the same order whatever else is in the batch, so
what it samples does not depend on the batch.

Device-resident: the verifying stage's rows stay on its device (a GPU), where they are warped and verified; the
drafts' rows move there from the drafter's device when it differs, the random numbers (drawn on the host from each
request's generator, so a seed means the same on any device) go up, and only token ids and acceptance counts come
back. On the CPU every move is a no-op."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cascade.ops import Verifier
from cascade.sampling import SamplingParams, sample_rows, verification_draws, warp_grouped


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: list[int]  # [depth]
    probs: torch.Tensor | None  # [depth, vocab]: the distribution each token was drawn from; None: one-hot (greedy
    # decoding, or the n-gram drafter)

    @staticmethod
    def empty() -> Draft:
        return Draft([], None)

    def prefix(self, n: int) -> Draft:
        """The first ``n`` tokens with their rows (a prefix of a draft is a draft of the same distribution)."""
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n])

    def after(self, n: int) -> Draft:
        """The tokens after the first ``n``, with their rows."""
        return Draft(self.tokens[n:], None if self.probs is None else self.probs[n:])


@dataclass(frozen=True, slots=True)
class Verdict:
    tokens: list[int]  # [accepted + 1]: the accepted drafts, then the recovered or bonus token
    rows: torch.Tensor | None  # [accepted + 1, vocab]: the p row each token was drawn from (None when greedy)
    accepted: int
    expected: float | None  # Σ(1 − TV(p, q)) over the drafted positions, when sampling (for the controller)


def verify_greedy_batch(verifier: Verifier, drafts: Sequence[list[int]], argmax: Sequence[torch.Tensor]) -> list[Verdict]:
    """``argmax[b]``: the verifying stage's greedy tokens at request b's ``len(drafts[b]) + 1`` positions."""
    target = torch.cat(list(argmax))  # [num_tokens + batch], on the verifying stage's device
    draft_ids, cu, max_depth = _flatten(drafts, target.device)
    output, num_accepted = verifier.greedy(draft_ids, cu, target, max_depth)
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
    p = warp_grouped(logits, params)  # [positions[b], vocab] each, on the verifying stage's device
    vocab, device = p[0].shape[-1], p[0].device
    verdicts: list[Verdict | None] = [None] * len(drafts)
    # An empty draft (a drafter's token, the target alone) is a plain sample of its one row, with one draw from
    # the request's generator.
    plain = [b for b, d in enumerate(drafts) if not d.tokens]
    if plain:
        uniforms = torch.cat([torch.rand(1, generator=generators[b]) for b in plain])  # [plain]
        tokens = sample_rows(torch.cat([p[b] for b in plain]), uniforms.to(device)).tolist()
        for b, token in zip(plain, tokens):
            verdicts[b] = Verdict([token], p[b], 0, None)
    drafted = [b for b, d in enumerate(drafts) if d.tokens]
    if drafted:
        group = [drafts[b] for b in drafted]
        draft_ids, cu, max_depth = _flatten([d.tokens for d in group], device)
        q = None
        if any(d.probs is not None for d in group):
            q = torch.cat([_rows_of(d, vocab, device) for d in group])  # [num_tokens, vocab]
        uniforms, finals = verification_draws([len(d.tokens) for d in group], [generators[b] for b in drafted])
        target_p = torch.cat([p[b] for b in drafted])
        output, num_accepted = verifier.sampling(
            draft_ids, cu, q, target_p, uniforms.to(device), finals.to(device), max_depth
        )
        watched = [i for i, b in enumerate(drafted) if observe[b]]
        expected = dict(zip(watched, expected_acceptance([p[drafted[i]] for i in watched], [group[i] for i in watched])))
        accepted, output = num_accepted.tolist(), output.tolist()  # the one host synchronisation of the pass
        for i, (b, row, a) in enumerate(zip(drafted, output, accepted)):
            verdicts[b] = Verdict(row[: a + 1], p[b][: a + 1], a, expected.get(i))
    return verdicts


def _flatten(drafts: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ragged layout of ``cascade.verify``: draft_token_ids [num_tokens], cu_num_draft_tokens [batch + 1]."""
    lengths = [len(d) for d in drafts]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=device)  # [batch + 1]
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=device)  # [num_tokens]
    return ids, cu, max(lengths)


def _rows_of(draft: Draft, vocab: int, device: torch.device) -> torch.Tensor:
    """The draft's q rows [depth, vocab] on ``device``: its own (moved from the drafter's device), or one-hot rows
    for a one-hot draft."""
    if draft.probs is not None:
        return draft.probs.to(device)
    return torch.nn.functional.one_hot(torch.tensor(draft.tokens, dtype=torch.long, device=device), vocab).float()


def expected_acceptance(p: Sequence[torch.Tensor], drafts: Sequence[Draft]) -> list[float]:
    """Per draft, Σ_j (1 − TV(p_j, q_j)) = Σ_j Σ_x min(p_j(x), q_j(x)): the expected number of accepted positions
    if each were tested, observed without sampling noise. ``p[b]``: the verifying stage's rows [≥ depth, vocab] on
    its device; a one-hot draft's sum is its tokens' probabilities. Computed there for the whole batch (the drafts
    with rows, then the one-hot ones, each in one call), with one copy of the sums."""
    if not drafts:
        return []
    device = p[0].device
    sums = torch.zeros(len(drafts), device=device)  # [drafts]
    for one_hot in (False, True):
        members = [b for b, d in enumerate(drafts) if (d.probs is None) == one_hot]
        if not members:
            continue
        lengths = [len(drafts[b].tokens) for b in members]
        rows = torch.cat([p[b][:n] for b, n in zip(members, lengths)])  # [Σ depth, vocab]
        if one_hot:
            ids = torch.tensor([t for b in members for t in drafts[b].tokens], dtype=torch.long, device=device)
            per_row = rows.gather(1, ids[:, None]).squeeze(1)  # [Σ depth]
        else:
            per_row = torch.minimum(rows, torch.cat([drafts[b].probs.to(device) for b in members])).sum(dim=1)
        owner = torch.repeat_interleave(torch.tensor(members, device=device), torch.tensor(lengths, device=device))
        sums.index_add_(0, owner, per_row)
    return sums.tolist()
