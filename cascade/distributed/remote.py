"""A stage that lives in a Ray actor, behind the same ``ModelStage`` interface as a local one.

Per sequence the driver mirrors the context the actor holds, computes the longest common prefix with the new
context itself, and sends only ``keep`` and the tokens after it. When the actor dies, the call that noticed fails
with :class:`StageUnavailable` (the engine fails that request), the mirrors of every stage in that actor are
dropped (the restarted actor holds nothing), and the next call waits until Ray has restarted the actor and its
models are loaded again. An actor that does not answer within ``call_timeout_s`` is treated the same way (it is
killed, so Ray restarts it). An actor that restarted between calls (idle) is noticed by the call that finds its
contexts gone: the mirrors are dropped and the call repeated with whole contexts (every call carries what the
actor needs besides, such as the vocabulary width) — a forward pass is a function of its context, so the request goes on exactly as it would have.

The calls of a round travel over the actor's channel (``cascade.distributed.channel``: ZeroMQ, 0.1–0.3 ms a round
trip here where a Ray call costs 1–2 ms); Ray carries the rest and watches the actor while a channel call waits, so
a death is noticed at once and a restart (a new process with a new channel) is told from a slow answer.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from cascade.distributed.actor import StaleContext
from cascade.distributed.channel import Channel, ChannelTimeout
from cascade.stages.base import StageUnavailable
from cascade.stages.draft import DraftSampling
from cascade.stages.hf import tokens_to_keep

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

    def __init__(
        self, actor, label: str, *, actor_name: str | None = None, recovery_timeout_s: float = 300.0,
        call_timeout_s: float = 60.0,
    ):
        self.actor = actor
        self.label = label  # the stages it hosts, joined by "+"
        self.actor_name = actor_name  # its name in the Ray namespace (for `ray.get_actor` and the state API)
        self.recovery_timeout_s = recovery_timeout_s
        self.call_timeout_s = call_timeout_s
        self.stages: list[RemoteStage] = []
        self.recovering = False
        self._channel: Channel | None = None
        self._killed: str | None = None  # the channel of an actor this driver killed: back means a new process
        self._lock = threading.RLock()  # one call at a time: the pipelined mode calls from two threads, and the
        # stages an actor hosts together (a target co-located with a drafter) take turns on its channel

    def call(self, method: str, *args):
        """The actor's ``method(*args)`` over its channel. Raises :class:`StageUnavailable` when the actor died or
        hangs, and :class:`StaleContext` (once the driver has caught up) when it restarted since the last call."""
        with self._lock:
            return self._call(method, args)

    def _call(self, method: str, args: tuple):
        if self.recovering:
            self._wait_until_back()
        try:
            channel = self._open_channel()
            return channel.call(method, args, self.call_timeout_s, lambda: self._check(channel))
        except (RayActorError, ActorUnavailableError) as e:
            self._lost(f"{type(e).__name__}; Ray is restarting it")
            raise StageUnavailable(f"stage {self._names()} became unavailable (its actor died); retry the request") from e
        except (ray.exceptions.GetTimeoutError, ChannelTimeout):
            self._killed = self._channel.address if self._channel is not None else None
            self._lost(f"no answer to {method} within {self.call_timeout_s} s; restarting it")
            ray.kill(self.actor, no_restart=False)  # a hung actor holds its GPU and its queue: start it afresh
            raise StageUnavailable(
                f"stage {self._names()} did not answer within {self.call_timeout_s} s (runtime.ray.call_timeout_s); "
                "its actor is being restarted; retry the request"
            ) from None
        except StaleContext:
            log.warning("actor %s restarted since the last call; re-establishing its state", self.label)
            self._close_channel()
            for stage in self.stages:
                stage._mirror.clear()
            self._restore()
            raise

    def _open_channel(self) -> Channel:
        if self._channel is None:
            driver_node = ray.get_runtime_context().get_node_id()
            address, secret = ray.get(self.actor.open_channel.remote(driver_node), timeout=self.call_timeout_s)
            self._channel = Channel(address, secret)
        return self._channel

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _check(self, channel: Channel) -> None:
        """While a channel call waits: a dead actor raises Ray's error; one that restarted since the channel was
        opened (its channel is another, or none) raises :class:`StaleContext`; a busy one answers nothing yet."""
        try:
            endpoints = ray.get(self.actor.channel_endpoints.remote(), timeout=5.0)
        except ray.exceptions.GetTimeoutError:
            return
        if channel.address not in endpoints:
            raise StaleContext(f"actor {self.label} restarted: it no longer serves {channel.address}")

    def _names(self) -> str:
        return ", ".join(repr(s.name) for s in self.stages)

    def _lost(self, why: str) -> None:
        self._close_channel()
        for stage in self.stages:
            stage._mirror.clear()  # whatever the actor held is gone
        self.recovering = True
        log.error("actor %s lost: %s", self.label, why)

    def notify(self, method: str, *args) -> None:
        """A call whose result nobody waits for (calls from one caller still run in order)."""
        if not self.recovering:
            getattr(self.actor, method).remote(*args)

    def _back(self) -> bool:
        """The actor answers; after this driver killed it, only a new process counts (the old one may still
        answer while Ray stops it)."""
        try:
            endpoints = ray.get(self.actor.channel_endpoints.remote(), timeout=10.0)
        except (RayActorError, ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False
        return self._killed is None or self._killed not in endpoints

    def _wait_until_back(self) -> None:
        deadline = time.monotonic() + self.recovery_timeout_s
        while not self._back():
            if time.monotonic() > deadline:
                raise StageUnavailable(f"actor {self.label} did not come back within {self.recovery_timeout_s} s")
            time.sleep(0.2)
        self.recovering = False
        self._killed = None
        self._restore()
        log.warning("actor %s is back", self.label)

    def _restore(self) -> None:
        """No sequence the driver no longer tracks stays cached (releases are not sent while the actor is away, and
        an actor that only seemed lost kept its caches)."""
        for stage in self.stages:
            self.call("retain", stage.name, list(stage._mirror))


class RemoteStage:
    """A model stage in a Ray actor; implements ``cascade.stages.base.ModelStage``."""

    def __init__(self, name: str, host: Host, info: dict):
        self.name = name
        self.host = host
        self.vocab_size = int(info["vocab_size"])
        self.max_context = int(info["max_context"])
        self.device = info["device"]
        self.transfer = Transfer()
        self.new_tokens = 0
        self.cost_prior = None  # c(t) from the roofline of what the stage is or emulates (set by the driver), or None
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

    def draft(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
        eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None],
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        def build():
            keeps, news = self._suffixes(seq_ids, contexts, [0] * len(seq_ids))
            return list(seq_ids), keeps, news, list(depths), list(eos_token_ids), list(sampling), self.vocab_size

        started = time.perf_counter()
        raw, stage_seconds, sent = self._call("draft", build)
        drafts = [(tokens, None if rows is None else torch.tensor(rows)) for tokens, rows in raw]  # a copy: Ray and
        # ZeroMQ hand out read-only buffers
        received = sum(8 * len(tokens) + (0 if rows is None else rows.nbytes) for tokens, rows in raw)
        self._account(started, stage_seconds, sent, received)
        self.new_tokens += sum(len(new) for new in sent[2]) + sum(max(len(t) - 1, 0) for t, _ in drafts)
        for seq_id, context, (tokens, _) in zip(seq_ids, contexts, drafts):
            self._mirror[seq_id] = [*context, *tokens[:-1]]
        return drafts

    def adopt(self, seq_id: int, prompt: Sequence[int]) -> int:
        """0, without a round trip: the actor's stage reuses a retired slot's prefix itself, on the first chunk it
        is sent (``HFStage``), so only the driver's prefill budget does not count what it reuses."""
        return 0

    def release(self, seq_id: int) -> None:
        if self._mirror.pop(seq_id, None) is not None:
            self.host.notify("release", self.name, [seq_id])

    def num_cached_sequences(self) -> int:
        return len(self._mirror)

    def cached_tokens(self, seq_id: int) -> int:
        return len(self._mirror.get(seq_id, ()))

    def set_vocab_size(self, vocab_size: int) -> None:
        self.host.call("set_vocab_size", self.name, vocab_size)
        self.vocab_size = vocab_size

    def emulation_report(self) -> dict | None:
        """The actor's emulated device: its passes and the share of their time real compute took (None: real)."""
        return self.host.call("emulation_report", self.name)

    def _account(self, started: float, stage_seconds: float, args: tuple, bytes_received: int) -> None:
        t = self.transfer
        t.calls += 1
        t.call_seconds += time.perf_counter() - started
        t.stage_seconds += stage_seconds
        t.bytes_sent += len(pickle.dumps(args, protocol=5))
        t.bytes_received += bytes_received

    def _suffixes(self, seq_ids, contexts, num_positions) -> tuple[list[int], list[list[int]]]:
        """Per sequence, how much of the actor's context to keep and the tokens after it. Positions whose logits
        are always recomputed (``tokens_to_keep``, the rule of HFStage)."""
        keeps, news = [], []
        for seq_id, context, n in zip(seq_ids, contexts, num_positions):
            keeps.append(tokens_to_keep(self._mirror.get(seq_id, ()), context, n))
            news.append(list(context[keeps[-1] :]))
        return keeps, news

    def _call(self, method: str, build: Callable[[], tuple]) -> tuple:
        """``method`` with the arguments ``build()`` makes from the mirrors; once more, with whole contexts, when
        the actor turns out to have restarted since the last call. Returns its two results and the arguments."""
        sent = build()
        try:
            return *self.host.call(method, self.name, *sent), sent
        except StaleContext:  # the host dropped every mirror: build() now sends whole contexts
            sent = build()
            return *self.host.call(method, self.name, *sent), sent

    def _forward(self, seq_ids, contexts, num_positions, *, greedy: bool) -> list[torch.Tensor]:
        def build():
            keeps, news = self._suffixes(seq_ids, contexts, num_positions)
            return list(seq_ids), keeps, news, list(num_positions), greedy, self.vocab_size

        started = time.perf_counter()
        raw, stage_seconds, sent = self._call("forward", build)
        self.new_tokens += sum(len(new) for new in sent[2])
        if greedy:
            out = [torch.tensor(ids, dtype=torch.long) for ids in raw]  # [num_positions[b]]
            received = sum(8 * len(ids) for ids in raw)
        else:
            out = [torch.tensor(rows) for rows in raw]  # [num_positions[b], vocab]; a copy: Ray hands out read-only buffers
            received = sum(rows.nbytes for rows in raw)
        self._account(started, stage_seconds, sent, received)
        for seq_id, context in zip(seq_ids, contexts):
            self._mirror[seq_id] = list(context)
        return out
