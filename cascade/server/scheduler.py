"""Runs a cascade for many HTTP requests at once without blocking the event loop.

One worker thread owns the engine (stages are not thread-safe) and runs its batched steps: every running request
advances by one round of the target per step, their forward passes batched together (``cascade.engine``). The
event loop hands requests over with :meth:`Scheduler.submit` and receives their output as events on a bounded
:class:`Events` queue; a request whose client went away is cancelled with :meth:`Job.cancel` and leaves the batch,
its caches freed, before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from cascade.api import Cascade, Generation, GenerationResult
from cascade.penalties import TokenLogprob
from cascade.server.metrics import Metrics
from cascade.server.worker import EngineThread

log = logging.getLogger("cascade.server")


class QueueFull(Exception):
    """The waiting queue is at its limit; the client should retry later (HTTP 503)."""


class GenerationFailed(RuntimeError):
    """One request failed alone (its own rows were not finite); the message says why, with no internals."""


class EngineUnavailable(RuntimeError):
    """The engine thread has stopped, or one step has run longer than ``step_timeout_s`` (a hung stage): new
    requests are refused and the ones in flight fail (HTTP 503) instead of waiting for ever."""


@dataclass(frozen=True, slots=True)
class Delta:
    index: int  # the choice this belongs to
    text: str  # text that became final this round (may be empty while a stop string or UTF-8 is pending)
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens that became final this round (when asked for)
    tokens: int = 0  # the choice's tokens committed so far (text may lag them: a pending stop string, UTF-8)


@dataclass(frozen=True, slots=True)
class Finished:
    index: int
    result: GenerationResult


@dataclass(frozen=True, slots=True)
class Failed:
    index: int
    error: Exception


Event = Delta | Finished | Failed


class Events:
    """The events of one HTTP request's choices, bounded whatever its reader does: a delta arriving while the
    choice's previous delta is still unread is merged into it (its text and log-probabilities appended), so a slow
    reader gets fewer, larger chunks, and the queue holds at most a delta and an end per choice. Filled on the event
    loop (:meth:`Job.emit` hands over from the engine thread), read there with :meth:`get`."""

    def __init__(self) -> None:
        self._items: deque[Event] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, event: Event) -> None:
        if isinstance(event, Delta):
            for k in range(len(self._items) - 1, -1, -1):  # the choice's unread delta, unless an end came after it
                pending = self._items[k]
                if pending.index != event.index:
                    continue
                if isinstance(pending, Delta):
                    self._items[k] = Delta(event.index, pending.text + event.text, pending.logprobs + event.logprobs,
                                          event.tokens)
                    return
                break
        self._items.append(event)
        self._ready.set()

    async def get(self) -> Event:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


@dataclass(slots=True, eq=False)
class Job:
    """One choice of one HTTP request: a prompt, its options, and where its events go."""

    index: int
    prompt_ids: list[int]
    options: dict  # keyword arguments of Cascade.start: max_tokens, temperature, top_k, top_p, seed, stop
    loop: asyncio.AbstractEventLoop
    events: Events  # shared by the choices of one HTTP request
    counts_prompt: bool = True  # False for choices 2..n of a prompt: `usage` counts a prompt once
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Worker-side state:
    generation: Generation | None = None
    last_output: float = 0.0
    produced: int = 0
    logprobs_sent: int = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class Scheduler:
    """Continuous batching: the engine runs at most ``max_running`` requests together (``batching.max_running``
    of the config), one batched step at a time; up to ``max_waiting`` more wait in its queue."""

    def __init__(
        self, cascade: Cascade, metrics: Metrics, *, max_waiting: int = 256, worker: EngineThread | None = None,
        step_timeout_s: float = 120.0,
    ):
        self.cascade = cascade
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # when the running step began (None between steps)
        self._incoming: deque[Job] = deque()  # handed over by the event loop, not yet given to the engine
        self._starting = 0  # taken from _incoming by the engine thread and being given to the engine
        self._jobs: dict[Generation, Job] = {}  # queued in or run by the engine
        self._wakeup = threading.Condition()
        self._stopping = False
        self._worker = worker or EngineThread()  # best the thread that loaded the models (cascade.server.worker)
        self._running_loop = threading.Event()

    @property
    def max_running(self) -> int:
        return self.cascade.max_running

    def start(self) -> None:
        self._running_loop.set()
        self._worker.submit(self._loop)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._worker.stop(timeout)

    @property
    def alive(self) -> bool:
        return self._running_loop.is_set() and self._worker.alive

    def trouble(self) -> str | None:
        """Why the engine cannot serve now (None when it can)."""
        if not self.alive:
            return "the engine has stopped"
        started = self._step_started
        if started is not None and time.perf_counter() - started > self.step_timeout_s:
            return f"an engine step has run for {time.perf_counter() - started:.0f} s (step timeout {self.step_timeout_s:g} s)"
        return None

    def fail_in_flight(self, reason: str) -> int:
        """Called from the event loop while :meth:`trouble` says why: every request queued or running gets an
        error now (and is cancelled, so that a step that comes back drops it). Returns how many."""
        failed = 0
        for job in list(self._jobs.values()) + list(self._incoming):
            if not job.cancelled.is_set():
                job.cancel()
                job.emit(Failed(job.index, EngineUnavailable(reason)))
                failed += 1
        return failed

    def submit(self, jobs: list[Job]) -> None:
        """Queue all choices of one HTTP request, or none of them."""
        trouble = self.trouble()
        if trouble is not None:
            raise EngineUnavailable(trouble)
        with self._wakeup:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            waiting, running = self.cascade.queue_depths()
            queued = len(self._incoming) + self._starting + waiting
            free = max(0, self.max_running - running)
            if queued + len(jobs) > self.max_waiting + free:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            self._incoming.extend(jobs)
            self._wakeup.notify()

    # ---- worker thread ----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            self._running_loop.clear()

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopping and not self._incoming and not self._jobs:
                    self._wakeup.wait()
                if self._stopping:
                    break
                incoming, self._incoming = list(self._incoming), deque()
                self._starting = len(incoming)  # still counted as queued until the engine holds them
            for job in incoming:
                self._start(job)
                with self._wakeup:
                    self._starting -= 1
            for job in [j for j in self._jobs.values() if j.cancelled.is_set()]:
                self._abort(job)
            self._publish_queue()
            if self._jobs:
                self._step()
        for job in list(self._jobs.values()) + list(self._incoming):  # shutting down: nobody is left to serve them
            self._abort(job)
            job.emit(Failed(job.index, RuntimeError("the server is shutting down")))

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._observe_finish(job, "abort", 0)
            return
        try:
            job.generation = self.cascade.start(job.prompt_ids, **job.options)
        except ValueError as error:  # validated by the route already; a last line of defence
            self.metrics.request_failures.inc()
            job.emit(Failed(job.index, error))
            return
        except Exception as error:  # a fault of this job's alone: it fails, the loop and the other jobs go on
            log.exception("starting a request failed")
            self.metrics.request_failures.inc()
            if job.generation is not None:
                self.cascade.abort(job.generation)
            job.emit(Failed(job.index, error))
            return
        self._jobs[job.generation] = job

    def _step(self) -> None:
        """One batched engine step; every job that progressed gets its text, a finished one its result."""
        self._step_started = time.perf_counter()
        try:
            progressed = self.cascade.step()
        except Exception as error:  # a stage failed mid-step: every request in the batch has lost its state
            log.exception("engine step failed; failing the %d requests it held", len(self._jobs))
            for job in list(self._jobs.values()):
                self.metrics.request_failures.inc()
                del self._jobs[job.generation]
                job.emit(Failed(job.index, error))
            return
        finally:
            self._step_started = None
        for generation, delta in progressed:
            job = self._jobs.get(generation)
            if job is None:
                continue
            try:
                self._deliver(job, generation, delta)
            except Exception as error:  # this job's own fault (its result, its events): it alone fails
                log.exception("delivering a request's output failed")
                self._jobs.pop(generation, None)
                self.cascade.abort(generation)  # frees its KV slots if it was still running
                self.metrics.request_failures.inc()
                job.emit(Failed(job.index, error))
        self._publish_queue()

    def _deliver(self, job: Job, generation: Generation, delta: str) -> None:
        """A step's text for one job, and its result when it is finished."""
        request = generation.request
        self._observe_tokens(job, len(request.generated) - job.produced)
        logprobs = ()
        if request.logprobs is not None and (generation.finished or not generation.tracker.stop):
            # (with stop strings they wait for the end: a token committed now may still be cut with the stop)
            logprobs = tuple(request.token_logprobs[job.logprobs_sent :])
            job.logprobs_sent += len(logprobs)
        if delta or logprobs or generation.finished:
            job.emit(Delta(job.index, delta, logprobs, job.produced))
        if generation.finished:
            del self._jobs[generation]
            result = self.cascade.result(generation)
            if result.finish_reason == "error":
                self.metrics.request_failures.inc()
                job.emit(Failed(job.index, GenerationFailed(result.error)))
                return
            self._observe_finish(job, result.finish_reason, len(result.token_ids))
            job.emit(Finished(job.index, result))

    def _publish_queue(self) -> None:
        waiting, running = self.cascade.queue_depths()
        self.metrics.waiting.set(waiting + len(self._incoming))
        self.metrics.running.set(running)

    def _abort(self, job: Job) -> None:
        generated = 0
        if job.generation is not None:
            self._jobs.pop(job.generation, None)
            generated = len(job.generation.request.generated)
            self.cascade.abort(job.generation)  # leaves the batch; frees the stages' caches for this sequence
        self._observe_finish(job, "abort", generated)

    def _observe_tokens(self, job: Job, count: int) -> None:
        """TTFT when the first tokens land; after that, each step's interval divided over its tokens. Latencies are
        in the engine's seconds: wall seconds over the emulated stages' time scale (1 without emulation)."""
        if count <= 0:
            return
        now = time.perf_counter()
        scale = self.cascade.clock.scale
        if job.produced == 0:
            self.metrics.ttft.observe((now - job.arrived) / scale)
        else:
            per_token = (now - job.last_output) / count / scale
            for _ in range(count):
                self.metrics.itl.observe(per_token)
        job.produced += count
        job.last_output = now

    def _observe_finish(self, job: Job, reason: str, generated: int) -> None:
        self.metrics.e2e.observe((time.perf_counter() - job.arrived) / self.cascade.clock.scale)
        if job.counts_prompt:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self.metrics.generation_tokens.inc(generated)
        self.metrics.request_success.labels(finished_reason=reason).inc()
