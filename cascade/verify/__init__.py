"""Verification: how a stage decides which of a drafter's tokens it keeps, exactly (DESIGN.md, "Verification").

A round, followed through this package:

- :mod:`~cascade.verify.records` — :class:`Draft` (what a drafting stage proposes) and :class:`Verdict` (what
  verifying it decided), the records stages and the engine pass between them;
- :mod:`~cascade.verify.batch` — one function per regime, each verifying every draft a stage checks in one step
  with one host synchronisation: :func:`verify_matching` (greedy, and coupled sampling with a seed: a draft is kept
  while it equals the verifier's own token) and :func:`verify_sampling` (rejection sampling against the verifier's
  warped rows, with each request's random numbers from its own generator), plus the controller's expected
  acceptance;
- :mod:`~cascade.verify.dispatch` — :class:`Verifier`, the one dispatch point over the three implementations of
  the op, which agree exactly: :mod:`~cascade.verify.reference` (PyTorch: the rule itself, the CPU path and the
  oracle), :mod:`~cascade.verify.triton_kernels` (CUDA, ROCm, or the CPU under ``TRITON_INTERPRET=1``) and
  :mod:`~cascade.verify.native` (the HIP/CUDA kernels in ``kernels/``, built on first use);
- :mod:`~cascade.verify.tree` — draft trees: the rule (recursive rejection over siblings, matching down the tree),
  the batched entry points through the same ``Verifier`` (reference, or :mod:`~cascade.verify.triton_trees`);
- :mod:`~cascade.verify.bench` — the kernel benchmark (``cascade kernels bench``).

How a token is drawn from a row (the inversion every implementation follows) is :func:`cascade.sampling.sample_rows`,
shared with the drafters.
"""

from cascade.verify.batch import expected_acceptance, verify_matching, verify_sampling
from cascade.verify.dispatch import Verifier
from cascade.verify.records import Draft, Verdict

__all__ = ["Draft", "Verdict", "Verifier", "expected_acceptance", "verify_matching", "verify_sampling"]
