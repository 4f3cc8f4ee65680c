"""An emulated accelerator: a stage computes its tokens with its real model, then its pass lasts as long as the
roofline of the model it stands for says on the device it stands on (DESIGN.md, "Emulated accelerators").

Waiting is a ``time.sleep``, which releases the CPU (and Python's GIL) as a host waits on a GPU stream, so stages on
different emulated devices overlap for real. Time is stretched by ``time_scale`` ``s``: a pass modelled at ``t``
seconds lasts ``s · t`` wall seconds, so the real compute standing in for it is a small share of it (a figure counts
only while that share stays under 25%); every figure the engine reports divides wall time by ``s``
(:class:`cascade.clock.Clock`). Host work is not stretched, so it weighs ``1/s`` of its real share; the device
counts the wall seconds its passes took on each thread, so the engine can tell host time from device time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cascade.emulation.profiles import DeviceProfile, Link, ModelShape, device, model
from cascade.emulation.roofline import Row, pass_seconds, transfer_seconds

_on_thread = threading.local()  # wall seconds this thread spent in emulated passes (device_seconds_on_this_thread)


def device_seconds_on_this_thread() -> float:
    """Wall seconds the calling thread has spent inside emulated passes and transfers, in total."""
    return getattr(_on_thread, "seconds", 0.0)


def charge_device_seconds(seconds: float) -> None:
    """Count ``seconds`` of emulated passes made elsewhere on the calling thread's behalf (a Ray actor's passes, which
    the driver's thread waited for: not host time)."""
    _on_thread.seconds = device_seconds_on_this_thread() + seconds


@dataclass(frozen=True, slots=True)
class EmulationSpec:
    """What a stage stands for (or, as a cost profile, is): ``model`` on ``gpus`` devices of ``device``, weights in
    ``dtype``; picklable, so a Ray actor builds its own :class:`EmulatedDevice` from it."""

    device: str
    model: str
    gpus: int = 1
    dtype: str = "bf16"
    time_scale: float = 1.0


PRIOR_CONTEXT = 512  # tokens of context the cost prior assumes for every position (the batch's split is unknown)


class PassModel:
    """The roofline of the model a stage stands for (or really is) on its device: a pass's modelled seconds, and the
    cost curve the adaptive controller starts from before it has measured the stage (``prior``)."""

    def __init__(self, spec: EmulationSpec):
        if spec.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {spec.gpus!r}")
        self.spec = spec
        self.profile: DeviceProfile = device(spec.device)
        self.shape: ModelShape = model(spec.model)

    @property
    def link(self) -> Link:
        return self.profile.peer

    def modelled(self, rows: Sequence[Row]) -> float:
        """Emulated seconds of one pass over ``rows`` (unscaled)."""
        return pass_seconds(self.shape, self.profile, rows, gpus=self.spec.gpus, dtype=self.spec.dtype)

    def prior(self, tokens: int) -> float:
        """c(t) before any measurement: a pass over ``tokens`` new positions after ``PRIOR_CONTEXT`` cached ones."""
        return self.modelled([Row(tokens, PRIOR_CONTEXT, tokens)])


class EmulatedDevice(PassModel):
    """The clock of one emulated stage: after each real pass, :meth:`wait_out` sleeps out the rest of its modelled
    time, stretched by the time scale."""

    def __init__(self, spec: EmulationSpec):
        if spec.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {spec.time_scale!r}")
        super().__init__(spec)
        self.real_seconds = 0.0  # wall seconds the real passes computed
        self.modelled_seconds = 0.0  # emulated seconds of those passes (unscaled)
        self.overruns = 0  # passes whose real compute outlasted their stretched time
        self.passes = 0
        self._lock = threading.Lock()

    def wait_out(self, started: float, rows: Sequence[Row], sent_bytes: float = 0.0) -> float:
        """The pass that began at ``started`` (``time.perf_counter``) over ``rows``, whose result of ``sent_bytes``
        goes over the device's link, lasts its modelled time stretched by the scale: sleep out the rest. Returns the
        pass's emulated seconds."""
        emulated = self.modelled(rows) + transfer_seconds(sent_bytes, self.link)
        real = time.perf_counter() - started
        target = self.spec.time_scale * emulated
        if target > real:
            time.sleep(target - real)
        with self._lock:
            self.real_seconds += real
            self.modelled_seconds += emulated
            self.passes += 1
            self.overruns += real > target
        _on_thread.seconds = device_seconds_on_this_thread() + max(target, real)
        return emulated

    def report(self) -> dict:
        """Passes, their real and emulated seconds, and the share of each stretched pass the real compute took."""
        stretched = self.spec.time_scale * self.modelled_seconds
        return {
            "device": self.spec.device, "model": self.spec.model, "gpus": self.spec.gpus, "dtype": self.spec.dtype,
            "time_scale": self.spec.time_scale, "passes": self.passes, "overruns": self.overruns,
            "real_seconds": round(self.real_seconds, 6), "emulated_seconds": round(self.modelled_seconds, 6),
            "real_share": round(self.real_seconds / stretched, 4) if stretched > 0 else 0.0,
        }
