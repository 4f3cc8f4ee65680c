"""A stage that lives in a Ray actor, behind the same ``Scorer`` interface as a local one.

Per sequence the driver mirrors the context the actor holds, computes the longest common prefix with the new
context itself, and sends only ``keep`` and the tokens after it. When the actor dies, the call that noticed fails
with :class:`StageUnavailable` (the engine fails that request), the mirrors of every stage in that actor are
dropped (the restarted actor holds nothing), and the next call waits until Ray has restarted the actor and its
models are loaded again.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from cascade.stages.base import StageUnavailable
from cascade.stages.hf import common_prefix_length

log = logging.getLogger("cascade.distributed")


@dataclass(slots=True)
class Transfer:
    """What crossed the process boundary for one stage, as pickled bytes (Ray's wire format for these)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    call_seconds: float = 0.0  # seen by the driver, transport included
    stage_seconds: float = 0.0  # spent in the stage's forward passes inside the actor

    def to_dict(self) -> dict:
        return {
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "call_seconds": round(self.call_seconds, 6),
            "stage_seconds": round(self.stage_seconds, 6),
        }


class Host:
    """The driver's side of one actor, shared by the stages co-located in it: when the actor dies, every one of
    them has lost its caches, and all of them wait for the same restart."""

    def __init__(self, actor, label: str, *, actor_name: str | None = None, recovery_timeout_s: float = 300.0):
        self.actor = actor
        self.label = label  # the stages it hosts, joined by "+"
        self.actor_name = actor_name  # its name in the Ray namespace (for `ray.get_actor` and the state API)
        self.recovery_timeout_s = recovery_timeout_s
        self.stages: list[RemoteStage] = []
        self.recovering = False

    def call(self, method: str, *args):
        if self.recovering:
            self._wait_until_back()
        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except (RayActorError, ActorUnavailableError) as e:
            for stage in self.stages:
                stage._mirror.clear()  # whatever the actor held is gone
            self.recovering = True
            log.error("actor %s died (%s); Ray is restarting it", self.label, type(e).__name__)
            names = ", ".join(repr(s.name) for s in self.stages)
            raise StageUnavailable(f"stage {names} became unavailable (its actor died); retry the request") from e

    def notify(self, method: str, *args) -> None:
        """A call whose result nobody waits for (calls from one caller still run in order)."""
        if not self.recovering:
            getattr(self.actor, method).remote(*args)

    def health(self, timeout: float = 10.0) -> bool:
        try:
            return bool(ray.get(self.actor.health.remote(), timeout=timeout))
        except (RayActorError, ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False

    def _wait_until_back(self) -> None:
        deadline = time.monotonic() + self.recovery_timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise StageUnavailable(f"actor {self.label} did not come back within {self.recovery_timeout_s} s")
            time.sleep(0.2)
        self.recovering = False
        for stage in self.stages:  # the restarted actor ran __init__ again: restore what was set afterwards
            self.call("set_vocab_size", stage.name, stage.vocab_size)
        log.warning("actor %s is back", self.label)


class RemoteStage:
    """A model stage in a Ray actor; implements ``cascade.stages.base.Scorer``."""

    def __init__(self, name: str, host: Host, info: dict):
        self.name = name
        self.host = host
        self.vocab_size = int(info["vocab_size"])
        self.max_context = int(info["max_context"])
        self.device = info["device"]
        self.transfer = Transfer()
        self._mirror: dict[int, list[int]] = {}  # seq_id -> the context the actor holds for it
        host.stages.append(self)

    def score(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        return self._forward(seq_ids, contexts, num_positions, greedy=False)

    def argmax(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        return self._forward(seq_ids, contexts, num_positions, greedy=True)

    def greedy_draft(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int], eos_token_id: int | None
    ) -> list[list[int]]:
        keeps, news = self._suffixes(seq_ids, contexts, [0] * len(seq_ids))
        args = (list(seq_ids), keeps, news, list(depths), eos_token_id)
        started = time.perf_counter()
        drafts, stage_seconds = self.host.call("greedy_draft", self.name, *args)
        self._account(started, stage_seconds, args, sum(8 * len(d) for d in drafts))
        for seq_id, context, tokens in zip(seq_ids, contexts, drafts):
            self._mirror[seq_id] = [*context, *tokens[:-1]]
        return drafts

    def release(self, seq_id: int) -> None:
        if self._mirror.pop(seq_id, None) is not None:
            self.host.notify("release", self.name, [seq_id])

    def num_cached_sequences(self) -> int:
        return len(self._mirror)

    def set_vocab_size(self, vocab_size: int) -> None:
        self.host.call("set_vocab_size", self.name, vocab_size)
        self.vocab_size = vocab_size

    def _account(self, started: float, stage_seconds: float, args: tuple, bytes_received: int) -> None:
        t = self.transfer
        t.calls += 1
        t.call_seconds += time.perf_counter() - started
        t.stage_seconds += stage_seconds
        t.bytes_sent += len(pickle.dumps(args, protocol=5))
        t.bytes_received += bytes_received

    def _suffixes(self, seq_ids, contexts, num_positions) -> tuple[list[int], list[list[int]]]:
        """Per sequence, how much of the actor's context to keep and the tokens after it. Positions whose logits
        are asked for are always recomputed, as in HFStage."""
        keeps, news = [], []
        for seq_id, context, n in zip(seq_ids, contexts, num_positions):
            keep = min(common_prefix_length(self._mirror.get(seq_id, ()), context), len(context) - max(n, 1))
            keeps.append(max(keep, 0))
            news.append(list(context[keeps[-1] :]))
        return keeps, news

    def _forward(self, seq_ids, contexts, num_positions, *, greedy: bool) -> list[torch.Tensor]:
        keeps, news = self._suffixes(seq_ids, contexts, num_positions)
        args = (list(seq_ids), keeps, news, list(num_positions), greedy)
        started = time.perf_counter()
        raw, stage_seconds = self.host.call("forward", self.name, *args)
        if greedy:
            out = [torch.tensor(ids, dtype=torch.long) for ids in raw]  # [num_positions[b]]
            received = sum(8 * len(ids) for ids in raw)
        else:
            out = [torch.tensor(rows) for rows in raw]  # [num_positions[b], vocab]; a copy: Ray hands out read-only buffers
            received = sum(rows.nbytes for rows in raw)
        self._account(started, stage_seconds, args, received)
        for seq_id, context in zip(seq_ids, contexts):
            self._mirror[seq_id] = list(context)
        return out
