"""The one thread that does a server's PyTorch work: loading the models and running the engine's steps.

Why one thread for both: PyTorch's CPU kernels parallelise with OpenMP, whose thread team belongs to the thread that
starts a parallel region. When the models are loaded in one thread (the main thread, creating its team) and stepped
in another (creating a second team), the two teams together oversubscribe the cores and OpenMP stops spinning
between regions: on 2 cores every matrix product of the engine thread then took ~1.7x as long and a one-client
decode ~3x (measured with the demo target, 64-token completions: 150 against 410 tokens/s). Loading and stepping
in the same thread keeps one team.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class EngineThread:
    """Runs callables one after the other in one daemon thread: :meth:`call` waits for a result, :meth:`submit`
    does not (the scheduler's loop runs until it returns)."""

    def __init__(self, name: str = "cascade-engine"):
        self._tasks: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task, answer = self._tasks.get()
            if task is None:
                return
            try:
                result = (True, task())
            except BaseException as error:  # handed to the caller, who raises it
                result = (False, error)
            if answer is not None:
                answer.put(result)

    def call(self, task: Callable[[], T]) -> T:
        answer: queue.Queue = queue.Queue(maxsize=1)
        self._tasks.put((task, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value

    def submit(self, task: Callable[[], object]) -> None:
        self._tasks.put((task, None))

    def stop(self, timeout: float) -> None:
        """Let the thread end once the running task returns."""
        self._tasks.put((None, None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
