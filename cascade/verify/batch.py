"""Verification of a batch of rounds: the drafts of every request a stage verifies in one step, through the
``Verifier`` dispatch point (:mod:`cascade.verify.dispatch`) in the reference's ragged layout
(:mod:`cascade.verify.reference`), with one host synchronisation. One function per regime: :func:`verify_matching`
(a draft is kept while it equals the verifier's own token: greedy, and coupled sampling with a seed) and
:func:`verify_sampling` (rejection sampling against the verifier's warped rows).
Each request draws its random numbers from its own generator, in the same order whatever else is in the batch, so
what it samples does not depend on the batch.

Device-resident: the verifying stage's rows stay on its device (a GPU), where they are warped and verified; the
drafts' rows move there from the drafter's device when it differs, the random numbers (drawn on the host from each
request's generator, so a seed means the same on any device) go up, and only token ids and acceptance counts come
back. On the CPU every move is a no-op."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from cascade.sampling import SamplingParams, sample_rows, warp_grouped
from cascade.verify.dispatch import Verifier
from cascade.verify.records import Draft, Verdict


def verify_matching(verifier: Verifier, drafts: Sequence[list[int]], chosen: Sequence[torch.Tensor]) -> list[Verdict]:
    """``chosen[b]``: the verifying stage's own tokens at request b's ``len(drafts[b]) + 1`` positions (its argmax
    when greedy; its sample with the request's shared noise when coupled). Each draft is kept up to its first token
    that differs, which is replaced by the verifier's; a draft kept whole earns the verifier's next token."""
    target = torch.cat(list(chosen))  # [num_tokens + batch], on the verifying stage's device
    draft_ids, cu, max_depth = _flatten(drafts, target.device)
    output, num_accepted = verifier.matching(draft_ids, cu, target, max_depth)
    accepted, output = num_accepted.tolist(), output.tolist()  # the one host synchronisation of the pass
    return [Verdict(row[: a + 1], None, a, None) for row, a in zip(output, accepted)]


def verify_sampling(
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


def verification_draws(counts: Sequence[int], generators: Sequence[torch.Generator | None]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers of a batch of drafted rounds, request b drawing from ``generators[b]``: ``counts[b]``
    acceptance uniforms U[0, 1), then one more for the token drawn after them (:func:`sample_rows` of the residual
    or of the bonus row) — the same numbers, in the same order, as ``torch.rand(counts[b] + 1)``, so what a request
    samples does not depend on the rest of the batch. Returns (uniforms [Σ counts], finals [batch]).

    One uniform per drawn token, not a vocabulary's worth of exponentials for a race: drawn on the host from each
    request's generator, a race row cost 0.7 ms of a 22 ms step at 64 sampled requests on the demo family's 4,096
    tokens (the CPU's generator makes ~2 ns a number), and would be 150 k numbers per request, copied to the GPU,
    for a vocabulary of 150 k."""
    draws = torch.empty(sum(counts) + len(counts))  # [Σ (counts + 1)]
    for generator, part in zip(generators, draws.split([n + 1 for n in counts])):
        torch.rand(part.shape[0], generator=generator, out=part)
    last = torch.tensor(list(itertools.accumulate(n + 1 for n in counts)), dtype=torch.long) - 1  # [batch]
    keep = torch.ones(draws.shape[0], dtype=torch.bool)
    keep[last] = False
    return draws[keep], draws[last]


def _flatten(drafts: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ragged layout of :mod:`cascade.verify.reference`: draft_token_ids [num_tokens], cu_num_draft_tokens [batch + 1]."""
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
