"""Runs a cascade for many HTTP requests at once without blocking the event loop.

One worker thread owns the engine (stages are not thread-safe) and steps the running requests in turn, one
round of the target each, so that concurrent requests make progress together. The event loop hands requests
over with :meth:`Scheduler.submit` and receives their output as events on an ``asyncio.Queue``; a request
whose client went away is cancelled with :meth:`Job.cancel` and its caches are freed before its next round.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from cascade.api import Cascade, GenerationResult
from cascade.server.metrics import Metrics

log = logging.getLogger("cascade.server")


class QueueFull(Exception):
    """The waiting queue is at its limit; the client should retry later (HTTP 503)."""


@dataclass(frozen=True, slots=True)
class Delta:
    index: int  # the choice this belongs to
    text: str  # text that became final this round (may be empty while a stop string or UTF-8 is pending)


@dataclass(frozen=True, slots=True)
class Finished:
    index: int
    result: GenerationResult


@dataclass(frozen=True, slots=True)
class Failed:
    index: int
    error: Exception


Event = Delta | Finished | Failed


@dataclass(slots=True, eq=False)
class Job:
    """One choice of one HTTP request: a prompt, its options, and where its events go."""

    index: int
    prompt_ids: list[int]
    options: dict  # keyword arguments of Cascade.start: max_tokens, temperature, top_k, top_p, seed, stop
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # of Event, shared by the choices of one HTTP request
    counts_prompt: bool = True  # False for choices 2..n of a prompt: `usage` counts a prompt once
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Worker-side state:
    request: object = None
    tracker: object = None
    last_output: float = 0.0
    produced: int = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class Scheduler:
    """Round-robin over at most ``max_running`` requests; up to ``max_waiting`` more wait in a FIFO queue."""

    def __init__(self, cascade: Cascade, metrics: Metrics, *, max_running: int = 16, max_waiting: int = 256):
        self.cascade = cascade
        self.metrics = metrics
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="cascade-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, jobs: list[Job]) -> None:
        """Queue all choices of one HTTP request, or none of them."""
        with self._wakeup:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            self._waiting.extend(jobs)
            self.metrics.waiting.set(len(self._waiting))
            self._wakeup.notify()

    # ---- worker thread ----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopping and not self._waiting and not self._running:
                    self._wakeup.wait()
                if self._stopping:
                    break
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                self.metrics.waiting.set(len(self._waiting))
                self.metrics.running.set(len(self._running))
            for job in list(self._running):
                if not self._advance(job):
                    self._running.remove(job)
            self.metrics.running.set(len(self._running))
        for job in self._running + list(self._waiting):  # shutting down: nobody is left to serve them
            self._abort(job)
            job.emit(Failed(job.index, RuntimeError("the server is shutting down")))

    def _advance(self, job: Job) -> bool:
        """One round of ``job``; False when it is done (finished, cancelled or failed)."""
        try:
            if job.cancelled.is_set():
                self._abort(job)
                return False
            if job.request is None:
                job.request, job.tracker = self.cascade.start(job.prompt_ids, **job.options)
            request = job.request
            before = len(request.generated)
            delta = self.cascade.step(request, job.tracker)
            self._observe_tokens(job, len(request.generated) - before)
            if delta or request.finished:
                job.emit(Delta(job.index, delta))
            if request.finished:
                result = self.cascade.result(request, job.tracker)
                self._observe_finish(job, result.finish_reason, len(result.token_ids))
                job.emit(Finished(job.index, result))
                return False
            return True
        except Exception as error:  # one request's failure must not take down the others
            log.exception("request failed inside the engine")
            self.metrics.request_failures.inc()
            self._abort(job, count=False)
            job.emit(Failed(job.index, error))
            return False

    def _abort(self, job: Job, *, count: bool = True) -> None:
        if job.request is not None and not job.request.finished:
            self.cascade.engine.finish(job.request, "abort")  # frees the stages' caches for this sequence
        if count:
            self._observe_finish(job, "abort", len(job.request.generated) if job.request is not None else 0)

    def _observe_tokens(self, job: Job, count: int) -> None:
        """TTFT when the first round lands; after that, each round's interval divided over its tokens."""
        if count <= 0:
            return
        now = time.perf_counter()
        if job.produced == 0:
            self.metrics.ttft.observe(now - job.arrived)
        else:
            per_token = (now - job.last_output) / count
            for _ in range(count):
                self.metrics.itl.observe(per_token)
        job.produced += count
        job.last_output = now

    def _observe_finish(self, job: Job, reason: str, generated: int) -> None:
        self.metrics.e2e.observe(time.perf_counter() - job.arrived)
        if job.counts_prompt:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self.metrics.generation_tokens.inc(generated)
        self.metrics.request_success.labels(finished_reason=reason).inc()
