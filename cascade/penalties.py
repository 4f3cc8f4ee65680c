"""Repetition, presence and frequency penalties, and the target's log-probabilities of the tokens it commits.

Both are the target's alone and both need each row's own history, which a verifying pass knows exactly: row j of a
pass over ``context`` ending in a draft of length d predicts the token after ``context[: len(context) − d + j]``.

Lossless: a penalty rewrites the target's logits row by row before anything else (temperature, min_tokens' EOS
mask, greedy argmax or sampling), so the target's distribution *is* the penalised one, and verification — greedy
ids or rejection sampling — makes the committed tokens follow it exactly. The drafters do not penalise: a draft is
only a proposal, and one the penalty makes unlikely is rejected like any other. Semantics as vLLM's (and
transformers' ``repetition_penalty``): the repetition penalty divides a positive logit (multiplies a negative one)
of every token in the prompt or the output so far; presence and frequency penalties (OpenAI's) subtract, from the
logit of every token in the output so far, the presence penalty once and the frequency penalty per occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
# What the arithmetic can carry: a logit divided by 5e-324 is inf, and the row could not be sampled.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0


@dataclass(frozen=True, slots=True)
class Penalties:
    repetition: float = 1.0  # in [0.01, 10]; 1 is none, above 1 discourages repeating prompt or output tokens
    presence: float = 0.0  # in [-2, 2]; subtracted once from each token the output has
    frequency: float = 0.0  # in [-2, 2]; subtracted per occurrence in the output

    def __post_init__(self) -> None:
        if not MIN_REPETITION_PENALTY <= self.repetition <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], got "
                             f"{self.repetition!r}")
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0

    def apply(self, logits: torch.Tensor, history: Sequence[int], prompt_length: int, draft: Sequence[int]
              ) -> torch.Tensor:
        """``logits`` [rows, vocab] of one verifying pass, penalised: row j follows ``history`` (the prompt's
        ``prompt_length`` tokens, then the output before the draft) plus ``draft[:j]``. A new tensor."""
        rows, vocab = logits.shape
        device = logits.device
        output = torch.tensor(list(history[prompt_length:]), dtype=torch.long, device=device)
        counts = torch.bincount(output, minlength=vocab)[None, :vocab].repeat(rows, 1).float()  # [rows, vocab]
        if rows > 1 and draft:
            steps = torch.zeros(rows, vocab, device=device)
            later = torch.arange(1, rows, device=device)
            steps[later, torch.tensor(list(draft[: rows - 1]), dtype=torch.long, device=device)] = 1.0
            counts += steps.cumsum(0)  # row j has seen draft[:j] as well
        logits = logits.float()
        if self.repetition != 1.0:
            seen = counts > 0
            if prompt_length:
                in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
                in_prompt[torch.tensor(list(history[:prompt_length]), dtype=torch.long, device=device)] = True
                seen |= in_prompt
            penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(seen, penalised, logits)
        if self.frequency != 0.0 or self.presence != 0.0:
            logits = logits - self.frequency * counts - self.presence * (counts > 0).float()
        return logits


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The target's log-probability of one committed token — its model distribution, before penalties,
    temperature and filtering (vLLM's default) — and of the ``top`` most likely tokens at that position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Per committed token j, its log-probability under row j of ``logits`` [rows ≥ len(tokens), vocab] (the
    target's raw rows), with the ``top`` most likely alternatives. One transfer to the host."""
    n = len(tokens)
    if n == 0:
        return []
    lp = logits[:n].float().log_softmax(-1)  # [n, vocab]
    chosen = lp[torch.arange(n, device=lp.device), torch.tensor(list(tokens), device=lp.device)].tolist()
    if top:
        values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * n
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alternatives)]
