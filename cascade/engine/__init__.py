"""The cascade engine: every stage drafts for the next, the target has the last word, all requests at once.

- :mod:`~cascade.engine.core`: :class:`CascadeEngine` — requests join, are prefilled in chunks and advance together,
  one round of the target per step;
- :mod:`~cascade.engine.rounds`: a request's round as a generator, the driver that batches a step's rounds, and why
  the output is exactly the target's (the pipelined mode's drafting ahead included);
- :mod:`~cascade.engine.planning`: each round's chain and depths (the adaptive controller's, or the configured
  plan), and the draft it starts from;
- :mod:`~cascade.engine.passes`: what a round asks of a stage, and the batched forward passes and verifications
  that answer a step's asks;
- :mod:`~cascade.engine.request`: a request in flight.
"""

from cascade.engine.core import CascadeEngine
from cascade.engine.request import Request

__all__ = ["CascadeEngine", "Request"]
