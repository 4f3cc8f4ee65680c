"""The engine's clock: wall seconds, or emulated seconds when the stages stand for faster devices.

With emulated accelerators (:mod:`cascade.emulation`) a pass modelled at ``t`` seconds lasts ``time_scale · t`` wall
seconds, so every time the engine records — pass costs for the controller, request latencies, the server's metrics —
reads ``time.perf_counter() / time_scale``. At scale 1 (no emulation) it is the wall clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Clock:
    """Seconds since an arbitrary origin, wall time divided by ``scale``."""

    scale: float = 1.0

    def __call__(self) -> float:
        return time.perf_counter() / self.scale
