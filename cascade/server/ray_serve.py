"""The server as a Ray Serve application, for KubeRay's RayService (``import_path: cascade.server.ray_serve:app``).

The replica builds the same ASGI app as ``cascade serve`` from the environment (``CASCADE_CONFIG``,
``CASCADE_API_KEY``, ``CASCADE_MAX_RUNNING``, ``CASCADE_MAX_WAITING``); with ``runtime.backend: ray`` in that
config its model stages become actors of the same cluster, each on its own GPU.
"""

from __future__ import annotations

from ray import serve

from cascade.server.app import app_from_env


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=512)
@serve.ingress(app_from_env)  # a builder: the app (and its models) is created on the replica, not here
class CascadeServer:
    """One replica: the HTTP routes and the engine thread."""


app = CascadeServer.bind()
