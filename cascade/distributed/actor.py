"""The Ray actor that hosts model stages: one per GPU, or several small stages co-located in one.

The actor keeps, per (stage, sequence), the context it last scored; the driver sends only how much of it to
keep and the new tokens after that (``keep``, ``new``), so a round ships a handful of token ids instead of the
whole context. Greedy rounds return token ids; only sampling rounds return logits rows. The calls of a round
arrive over the actor's channel (``cascade.distributed.channel``), the rest as Ray calls; a lock keeps the two
from touching the stages at once.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cascade.allocator import keep_freed_memory
from cascade.distributed.channel import ChannelServer
from cascade.emulation import EmulatedDevice, EmulationSpec
from cascade.stages.draft import DraftSampling
from cascade.stages.hf import HFStage, choose_forward
from cascade.stages.loading import load_model


@dataclass(frozen=True)
class ModelFromPath:
    """Loads a model inside the actor (so a restarted actor reloads it): a directory or hub id."""

    name: str
    path: str
    device: str = "auto"
    dtype: str = "auto"
    forward: str = "auto"  # the stage config's ``forward``, resolved once the model is loaded
    max_sequences: int = 4  # sequences the engine runs at once (KV-cache slots allocated up front)
    reserved_context: int = 0  # positions each slot holds from the start (batching.reserved_context)
    reuse_prefixes: bool = True  # batching.reuse_prefixes
    emulate: EmulationSpec | None = None  # the device and model the stage stands for (None: it runs as it is)

    def __call__(self):
        return load_model(self.name, self.path, device=self.device, dtype=self.dtype)


@dataclass(frozen=True)
class ModelObject:
    """Ships an in-memory model to the actor (tests, notebooks); a restart re-creates it from the same bytes."""

    model: torch.nn.Module
    forward: str = "transformers"

    def __call__(self):
        return self.model


def _stage(name: str, loader: Callable[[], torch.nn.Module]) -> HFStage:
    model = loader()
    forward = getattr(loader, "forward", "transformers")  # a plain callable gets transformers' forward
    max_sequences = getattr(loader, "max_sequences", 4)
    reserved = getattr(loader, "reserved_context", 0)
    spec = getattr(loader, "emulate", None)
    return HFStage(name, model, forward=choose_forward(model, forward), max_sequences=max_sequences,
                   reserved_context=reserved, reuse_prefixes=getattr(loader, "reuse_prefixes", True),
                   emulation=EmulatedDevice(spec) if spec is not None else None)


class StaleContext(RuntimeError):
    """The driver assumed the actor still holds a context it no longer has (it was restarted)."""


def _locked(method):
    @functools.wraps(method)
    def run(self, *args):
        with self._lock:
            return method(self, *args)

    return run


_CHANNEL_METHODS = frozenset(
    {"forward", "draft", "release", "retain", "set_vocab_size", "num_cached_sequences", "emulation_report"}
)


class StageHost:
    """Model stages living in one Ray actor. Every method takes the stage ``name``, since stages may share it.

    One thread of the actor, its channel's, does all of its torch work, the models' loading included: OpenMP keeps
    a team of threads per calling thread, a Ray worker's environment sets a new team's size to the actor's CPU
    share, and once a process has more OpenMP threads than cores they stop waiting actively between parallel
    regions — each of which then costs a small model's forward pass about as much as its work."""

    def __init__(self, loaders: dict[str, Callable[[], torch.nn.Module]], num_threads: int):
        import ray

        # Co-located actors on one machine must not each start a thread per core.
        self._threads = max(1, num_threads)
        self.stages: dict[str, HFStage] = {}
        self._contexts: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.RLock()  # the channel's thread and Ray's both call in

        def setup() -> None:
            keep_freed_memory()  # the actor's process runs its stages' passes (cascade.allocator)
            torch.set_num_threads(self._threads)
            self.stages.update({name: _stage(name, loader) for name, loader in loaders.items()})

        self._channel = ChannelServer(self._dispatch, ChannelServer.endpoints_for(ray.util.get_node_ip_address()), setup)

    def open_channel(self, driver_node_id: str) -> tuple[str, bytes]:
        """The address of this actor's channel for a driver on that node, and its secret."""
        import ray

        ipc, tcp = self._channel.endpoints
        return (ipc if driver_node_id == ray.get_runtime_context().get_node_id() else tcp), self._channel.secret

    def channel_endpoints(self) -> list[str]:
        return self._channel.endpoints

    def _dispatch(self, method: str, args: tuple):
        if method not in _CHANNEL_METHODS:
            raise ValueError(f"{method!r} is not a channel method")
        return getattr(self, method)(*args)

    def info(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "torch_threads": self._threads,
            "stages": {
                name: {"vocab_size": s.vocab_size, "max_context": s.max_context, "device": str(s.device)}
                for name, s in self.stages.items()
            },
        }

    @_locked
    def set_vocab_size(self, name: str, vocab_size: int) -> None:
        self.stages[name].vocab_size = vocab_size

    @_locked
    def forward(
        self,
        name: str,
        seq_ids: Sequence[int],
        keeps: Sequence[int],  # [batch]: tokens of the previous context to keep
        news: Sequence[Sequence[int]],  # [batch][*]: tokens after them
        num_positions: Sequence[int],  # [batch]
        greedy: bool,
        vocab_size: int,  # the width of the rows to return (the target's vocabulary): sent with every call, so a
        # restarted actor needs nothing re-sent
    ) -> tuple[list, float]:
        """Greedy: argmax ids ``[num_positions[b]]`` per sequence (a list); else logits ``[num_positions[b],
        vocab]`` (a float32 numpy array, which Ray ships with less overhead than a tensor). Also the seconds the
        stage itself spent, so the driver can tell transport from compute."""
        contexts = [self._context(name, s, keep, new) for s, keep, new in zip(seq_ids, keeps, news)]
        for seq_id, context in zip(seq_ids, contexts):
            self._contexts[(name, seq_id)] = context
        stage = self.stages[name]
        stage.vocab_size = vocab_size
        started = time.perf_counter()
        if greedy:
            out = [ids.tolist() for ids in stage.argmax(seq_ids, contexts, num_positions)]
        else:
            out = [logits.float().cpu().numpy() for logits in stage.score(seq_ids, contexts, num_positions)]
        return out, time.perf_counter() - started

    @_locked
    def draft(
        self,
        name: str,
        seq_ids: Sequence[int],
        keeps: Sequence[int],  # [batch]
        news: Sequence[Sequence[int]],  # [batch][*]
        depths: Sequence[int],  # [batch]
        eos_token_ids: Sequence[int],
        sampling: Sequence[DraftSampling | None],
        vocab_size: int,
    ) -> tuple[list[tuple[list[int], object]], float]:
        """The whole autoregressive draft of every sequence in one call (no round trip per token): its tokens and,
        for an independent sample, the float32 rows (a numpy array) they were drawn from."""
        contexts = [self._context(name, s, keep, new) for s, keep, new in zip(seq_ids, keeps, news)]
        stage = self.stages[name]
        stage.vocab_size = vocab_size
        started = time.perf_counter()
        drafts = stage.draft(seq_ids, contexts, depths, eos_token_ids, sampling)
        for seq_id, context, (tokens, _) in zip(seq_ids, contexts, drafts):
            self._contexts[(name, seq_id)] = context + tokens[:-1]  # the last token was produced, not fed
        out = [(tokens, None if rows is None else rows.float().cpu().numpy()) for tokens, rows in drafts]
        return out, time.perf_counter() - started

    def _context(self, name: str, seq_id: int, keep: int, new: Sequence[int]) -> list[int]:
        previous = self._contexts.get((name, seq_id), [])
        if keep > len(previous):
            raise StaleContext(f"stage {name!r}: sequence {seq_id} has {len(previous)} cached tokens, not {keep}")
        return previous[:keep] + list(new)

    @_locked
    def release(self, name: str, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.stages[name].release(seq_id)
            self._contexts.pop((name, seq_id), None)

    @_locked
    def retain(self, name: str, seq_ids: Sequence[int]) -> None:
        """Release every sequence of stage ``name`` but these (the driver's view, after it lost track)."""
        keep = set(seq_ids)
        self.release(name, [s for (n, s) in list(self._contexts) if n == name and s not in keep])

    @_locked
    def num_cached_sequences(self, name: str) -> int:
        return self.stages[name].num_cached_sequences()

    @_locked
    def emulation_report(self, name: str) -> dict | None:
        """The emulated device's passes and real-compute share (None: the stage is not emulated)."""
        emulation = self.stages[name].emulation
        return emulation.report() if emulation is not None else None
