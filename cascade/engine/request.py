"""A request in flight, as the engine holds it: its tokens, its randomness, its own acceptance and its statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cascade.controller import Plan, RequestAcceptance
from cascade.penalties import Penalties, TokenLogprob
from cascade.sampling import SamplingParams
from cascade.stats import RequestStats
from cascade.verify import Draft


def out_of_vocabulary(ids, vocab_size: int, what: str) -> str | None:
    """Why token ids ``what`` (``prompt token ids``, ``stop_token_ids``) are refused, or None: every id must lie in
    ``[0, vocab_size)``, the target's vocabulary. The one rule for the engine, the Python API and the server."""
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    return f"{what} must be in [0, {vocab_size}), got {bad[:5]}" if bad else None


@dataclass(slots=True, eq=False)
class Request:
    """One generation in flight: its tokens, its randomness, its own acceptance and its statistics."""

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator
    stats: RequestStats
    acceptance: RequestAcceptance | None  # what the adaptive controller keeps of it (None: the fixed plan)
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS, or a stop string found by the caller), "length", "abort" or "error"
    started: float = field(default_factory=time.perf_counter)
    ignore_eos: bool = False  # the target's EOS does not end it (it runs to max_tokens)
    min_tokens: int = 0  # the target's EOS is masked out until this many tokens are generated
    seed: int = 0  # its generator's seed; with ``coupled``, the key of its shared noise
    coupled: bool = False  # sampled with shared noise (seeded): its text is a function of seed, prompt and target
    prefilled: int = 0  # prompt tokens in the target's cache, or computed by this step's rounds (CascadeEngine._prefill)
    width: int = 1  # positions the target verified in this request's last round (its share of a step's tokens)
    ahead: Ahead | None = None  # the pipelined mode's drafts for its next round, made while the target verified
    failure: str | None = None  # why it failed alone (a fault in its own rows): it ends with finish_reason "error"
    penalties: Penalties | None = None  # the target's repetition/presence/frequency penalties (None: none)
    logprobs: int | None = None  # None: no log-probabilities; k: each token's, with its k most likely alternatives
    scope: str | None = None  # whose earlier requests a drafter that learns across requests may draft from (the
    # OpenAI ``user``; None: the server's shared scope)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token (with ``logprobs``)
    round_logprobs: list[TokenLogprob] = field(default_factory=list)  # the target's last round's, before commit
    # How its drafts are verified: ``greedy`` and ``coupled`` compare token ids, ``sampling`` is rejection sampling
    # against the drafts' distributions (fixed with its parameters; read several times per request and step)
    regime: str = field(init=False)

    def __post_init__(self) -> None:
        self.regime = "greedy" if self.params.greedy else "coupled" if self.coupled else "sampling"

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated  # a new list: where only its length matters, use ``length``

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def keep(self, count: int) -> None:
        """Keep only the first ``count`` generated tokens (a stop token or string ended it there)."""
        del self.generated[count:]
        del self.token_logprobs[count:]

    @property
    def target_rows(self) -> bool:
        """Whether the target's verifying pass must give this request's full rows (not only their argmax)."""
        return self.logprobs is not None or self.penalties is not None or not self.params.greedy

    @property
    def takes_trees(self) -> bool:
        """Whether its drafts for the target may be trees: the target's rows are its plain distribution (no penalties,
        logprobs or ``min_tokens``), which a tree's verification uses as computed (cascade.engine.passes)."""
        return self.penalties is None and self.logprobs is None and not self.min_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decoding(self) -> bool:
        """Prefilled: the target's next forward pass feeds the last prompt token (or later ones) and asks for
        logits."""
        return self.prefilled >= len(self.prompt) - 1


@dataclass(frozen=True, slots=True)
class Ahead:
    """Drafts for the target drafted while it verified the request's last round (the pipelined mode): valid for
    the round that starts when the request's context has ``at`` tokens, drafted by ``plan``'s chain below the target."""

    at: int
    plan: Plan
    draft: Draft
    rejected: bool = False  # drafted for an outcome where the target rejected a token of the draft it verified
