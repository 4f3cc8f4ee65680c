"""The interfaces the engine talks to, whether a stage lives in this process or elsewhere.

Both are batch-first: each call carries every sequence of a step that needs the stage, and a model stage runs them
as one batched forward pass. A sequence is identified by a ``seq_id`` that the engine picks and releases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from cascade.stages.draft import DraftSampling


class StageUnavailable(RuntimeError):
    """A stage cannot serve right now (its Ray actor died and is being restarted). The request that hit it fails;
    later requests wait for the stage to come back. The server answers HTTP 503."""


@runtime_checkable
class LookupStage(Protocol):
    """A model-free bottom stage (the n-gram drafter): looks draft tokens up in the context alone, with no forward
    pass (its drafts are one-hot distributions). Model stages draft too (:meth:`ModelStage.draft`)."""

    name: str

    def propose(self, contexts: Sequence[Sequence[int]], depths: Sequence[int]) -> list[list[int]]:
        """Up to ``depths[b]`` draft tokens continuing ``contexts[b]``; an empty list when there is nothing."""
        ...


@runtime_checkable
class ModelStage(Protocol):
    """A model stage: next-token logits for the last positions of a context, which verify the drafts of the stage
    below, and its own drafts for the stage above (:meth:`draft`)."""

    name: str
    vocab_size: int  # width of the logits rows it returns (the target's vocabulary)
    max_context: int  # longest context (in tokens) the model accepts
    new_tokens: int  # positions its forward passes have computed so far (a sequence's first pass computes its
    # whole context, a rejection recomputes what differs): what a pass really cost, for the controller's cost model

    def score(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        """Logits ``[num_positions[b], vocab]`` for sequence b: row j predicts the token after
        ``contexts[b][: len - num_positions[b] + 1 + j]``. The stage may cache per ``seq_id``; ``num_positions[b]``
        of 0 only brings the cache up to ``contexts[b]`` (a prefill chunk)."""
        ...

    def argmax(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        """``score(...)[b].argmax(-1)``: the greedy tokens ``[num_positions[b]]``, all a greedy round needs (a
        remote stage ships token ids instead of logits rows); ``cascade.sampling.BROKEN_ROW`` where a row is not
        finite (NaN, +inf), so that its request fails alone."""
        ...

    def draft(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
        eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None],
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ``depths[b]`` tokens continuing ``contexts[b]``, drawn as ``sampling[b]`` says (None: greedy), one
        batched forward pass per token, a sequence stopping after any of ``eos_token_ids``; with the distributions
        independent samples were drawn from. In one call: a remote stage drafts without a round trip per token.
        ``cascade.stages.draft.draft_tokens`` implements it on ``score`` and ``argmax``."""
        ...

    def adopt(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Start caching a new sequence whose context begins with ``prompt``; returns how many of its tokens are
        cached already (kept from a released sequence that began alike), which no forward pass need compute."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget whatever is cached for ``seq_id`` (the stage may keep its keys and values for a new sequence that
        begins alike)."""
        ...

    def num_cached_sequences(self) -> int:
        """How many sequences the stage holds a cache for (released ones excluded): a leak shows here."""
        ...

    def cached_tokens(self, seq_id: int) -> int:
        """How many tokens of ``seq_id``'s context the stage holds (0 for none): its next pass for the sequence
        reads the rest (the controller prices a check that makes the drafters catch up)."""
        ...
