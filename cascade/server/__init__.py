"""``cascade serve``: an OpenAI-compatible HTTP endpoint with Prometheus metrics."""

from cascade.server.app import app_from_env, create_app

__all__ = ["app_from_env", "create_app"]
