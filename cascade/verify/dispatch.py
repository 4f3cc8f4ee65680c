"""The verification op behind one dispatch point, with three implementations that agree exactly (the drawn token:
except within float64 rounding of a boundary between two tokens, :func:`cascade.sampling.sample_rows`).

``reference`` (:mod:`cascade.verify.reference`, PyTorch; the CPU path and the oracle), ``triton``
(:mod:`cascade.verify.triton_kernels`; CUDA and ROCm, or the CPU under ``TRITON_INTERPRET=1``) and ``native`` (the
HIP/CUDA kernels in ``kernels/``, :mod:`cascade.verify.native`).

Choice: ``auto`` (the default) uses ``native`` for GPU tensors when it builds, else ``triton`` when Triton is
installed and the tensors are on a GPU, else ``reference``. An explicit choice comes from the config
(``verify.implementation``) or, overriding it, the environment variable ``CASCADE_VERIFY_IMPL``; an explicit
choice that cannot run is an error, not a silent fallback. The chosen implementation is logged once per
:class:`Verifier` and reported in per-request stats.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch

import cascade.verify.reference as reference

log = logging.getLogger("cascade.verify")

Implementation = Literal["auto", "reference", "triton", "native"]
IMPLEMENTATIONS = ("auto", "reference", "triton", "native")
ENV_VAR = "CASCADE_VERIFY_IMPL"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class Verifier:
    """Runs the verification op with one implementation, chosen on first use for the tensors it is given."""

    def __init__(self, implementation: Implementation = "auto"):
        requested = os.environ.get(ENV_VAR) or implementation
        if requested not in IMPLEMENTATIONS:
            raise ValueError(f"verification implementation must be one of {IMPLEMENTATIONS}, got {requested!r}")
        self.requested = requested
        self.chosen: str | None = None

    def _choose(self, device: torch.device) -> str:
        if self.chosen is not None:
            return self.chosen
        if self.requested == "auto":
            chosen = "reference"
            if device.type == "cuda":
                from cascade.verify import native

                try:
                    native.load()
                    chosen = "native"
                except native.NativeUnavailable as e:
                    log.warning("verification: native kernels unavailable (%s)", e)
                    if triton_available():
                        chosen = "triton"
        else:
            chosen = self.requested
            if chosen == "triton" and not triton_available():
                raise RuntimeError("verification implementation 'triton' was asked for, but Triton is not installed")
            if chosen == "triton" and device.type != "cuda" and not triton_interpreted():
                raise RuntimeError("Triton kernels need GPU tensors here (or TRITON_INTERPRET=1 to run on the CPU)")
            if chosen == "native":
                from cascade.verify import native

                if device.type != "cuda":
                    raise RuntimeError("the native (HIP/CUDA) kernels need GPU tensors")
                native.load()
        self.chosen = chosen
        log.info("verification: using the %s implementation", chosen)
        return chosen

    def matching(
        self,
        draft_token_ids: torch.Tensor,  # [num_tokens] int64
        cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
        target_tokens: torch.Tensor,  # [num_tokens + batch] int64
        max_depth: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification by matching, from the verifier's own token ids (its argmax, or its coupled samples: the
        stages reduce their rows on their device)."""
        impl = self._choose(target_tokens.device)
        if impl == "reference":
            return reference.matching(draft_token_ids, cu_num_draft_tokens, target_tokens, max_depth)
        drafts = _nonempty(draft_token_ids)
        if impl == "triton":
            from cascade.verify import triton_kernels

            return triton_kernels.matching(drafts, cu_num_draft_tokens, target_tokens, max_depth)
        from cascade.verify import native

        return tuple(native.load().greedy_accept(drafts, cu_num_draft_tokens, target_tokens, max_depth))

    def sampling(
        self,
        draft_token_ids: torch.Tensor,  # [num_tokens] int64
        cu_num_draft_tokens: torch.Tensor,  # [batch + 1] int64
        draft_probs: torch.Tensor | None,  # [num_tokens, vocab] float32, None for one-hot drafts
        target_probs: torch.Tensor,  # [num_tokens + batch, vocab] float32
        uniforms: torch.Tensor,  # [num_tokens] float32
        final_uniforms: torch.Tensor,  # [batch] float32
        max_depth: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        impl = self._choose(target_probs.device)
        args = (draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, uniforms, final_uniforms, max_depth)
        if impl == "reference":
            return reference.sampling(*args)
        if impl == "triton":
            from cascade.verify import triton_kernels

            return triton_kernels.sampling(*args)
        from cascade.verify import native

        q = draft_probs.contiguous() if draft_probs is not None and draft_probs.numel() else None
        return tuple(
            native.load().sampling(
                _nonempty(draft_token_ids), cu_num_draft_tokens.contiguous(), q, target_probs.contiguous(),
                _nonempty(uniforms, 1.0), final_uniforms.contiguous(), max_depth,
            )
        )


    # ---- draft trees (cascade.verify.tree's batched layout) ----

    def tree_matching(
        self,
        tokens: torch.Tensor,  # [num_nodes] int64
        parents: torch.Tensor,  # [num_nodes] int64: within the request, -1 for a child of the context
        cu_num_nodes: torch.Tensor,  # [batch + 1] int64
        target_tokens: torch.Tensor,  # [num_nodes + batch] int64: the verifier's own token at each row
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Trees by matching: the accepted nodes [batch, max_nodes], their count [batch], the token after [batch]."""
        impl = self._choose(target_tokens.device)
        if impl == "reference":
            from cascade.verify.tree import reference_matching

            return reference_matching(tokens, parents, cu_num_nodes, target_tokens)
        tokens, parents = _nonempty(tokens), _nonempty(parents)
        if impl == "triton":
            from cascade.verify import triton_trees

            return triton_trees.tree_matching(tokens, parents, cu_num_nodes, target_tokens, _max_nodes(cu_num_nodes))
        from cascade.verify import native

        return tuple(native.load().tree_matching(tokens, parents, cu_num_nodes.contiguous(), target_tokens.contiguous(),
                                                 _max_nodes(cu_num_nodes)))

    def tree_sampling(
        self,
        tokens: torch.Tensor,  # [num_nodes] int64
        parents: torch.Tensor,  # [num_nodes] int64
        sampled: torch.Tensor,  # [num_nodes] bool: proposed from its q row (else a deterministic candidate)
        cu_num_nodes: torch.Tensor,  # [batch + 1] int64
        draft_probs: torch.Tensor | None,  # [num_nodes, vocab] float32
        target_probs: torch.Tensor,  # [num_nodes + batch, vocab] float32
        uniforms: torch.Tensor,  # [num_nodes] float32: each node's accept test
        final_uniforms: torch.Tensor,  # [batch] float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Trees by recursive rejection over siblings: as :meth:`tree_matching` returns."""
        impl = self._choose(target_probs.device)
        if impl == "reference":
            from cascade.verify.tree import reference_sampling

            return reference_sampling(tokens, parents, sampled, cu_num_nodes, draft_probs, target_probs, uniforms,
                                      final_uniforms)
        tokens, parents, uniforms = _nonempty(tokens), _nonempty(parents), _nonempty(uniforms, 1.0)
        if impl == "triton":
            from cascade.verify import triton_trees

            return triton_trees.tree_sampling(tokens, parents, _nonempty(sampled, 0), cu_num_nodes, draft_probs,
                                              target_probs, uniforms, final_uniforms, _max_nodes(cu_num_nodes))
        from cascade.verify import native

        q = draft_probs.contiguous() if draft_probs is not None and draft_probs.numel() else None
        return tuple(native.load().tree_sampling(
            tokens, parents, _nonempty(sampled.to(torch.uint8), 0), cu_num_nodes.contiguous(), q,
            target_probs.contiguous(), uniforms, final_uniforms.contiguous(), _max_nodes(cu_num_nodes),
        ))

def _nonempty(t: torch.Tensor, fill: float = -1) -> torch.Tensor:
    """Kernels take a pointer even when there is nothing to read: give them one valid element."""
    return t.contiguous() if t.numel() else torch.full((1,), fill, dtype=t.dtype, device=t.device)


def _max_nodes(cu_num_nodes: torch.Tensor) -> int:
    """The widest tree of a batch (at least 1): the width of the accepted nodes' output."""
    return max(int((cu_num_nodes[1:] - cu_num_nodes[:-1]).max()), 1) if cu_num_nodes.numel() > 1 else 1
