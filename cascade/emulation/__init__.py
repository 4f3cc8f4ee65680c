"""Time-faithful emulation of separate accelerators (DESIGN.md, "Emulated accelerators"): device and model profiles
as data, the pass-time roofline as pure functions, the emulated device a stage waits on, and the planner that
predicts a chain's throughput from the same functions (``cascade plan``)."""

from cascade.emulation.device import EmulatedDevice, EmulationSpec, PassModel, device_seconds_on_this_thread
from cascade.emulation.profiles import DEVICES, MODELS, NIC, DeviceProfile, Link, ModelShape, device, model
from cascade.emulation.roofline import PassCost, Row, pass_cost, pass_seconds, transfer_seconds, uniform_rows

__all__ = [
    "DEVICES", "MODELS", "NIC", "DeviceProfile", "EmulatedDevice", "EmulationSpec", "Link", "ModelShape", "PassCost", "PassModel",
    "Row", "device", "device_seconds_on_this_thread", "model", "pass_cost", "pass_seconds", "transfer_seconds",
    "uniform_rows",
]
