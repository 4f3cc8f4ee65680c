"""Model stages as Ray actors (``runtime.backend: ray``): the engine and the server run unchanged."""

from cascade.distributed.actor import ModelFromPath, ModelObject, StageHost
from cascade.distributed.cluster import PlacementError, RayDeployment, launch
from cascade.distributed.remote import RemoteStage
from cascade.stages.base import StageUnavailable

__all__ = [
    "ModelFromPath",
    "ModelObject",
    "PlacementError",
    "RayDeployment",
    "RemoteStage",
    "StageHost",
    "StageUnavailable",
    "launch",
]
