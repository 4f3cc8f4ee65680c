"""A Hugging Face causal LM as a cascade stage, with its KV cache kept aligned by longest common prefix.

Before each forward pass the stage compares the tokens it has cached for a sequence with the context it is
asked about, crops the cache to their common prefix and feeds only the rest. A rejection anywhere in the
cascade therefore needs no rollback message: the next call repairs the cache (DESIGN.md, "KV caches").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from cascade.stages.lean import KVCache, LeanDecoder, unsupported_reason

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but PyTorch sees no GPU (CUDA or ROCm)")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case: the cache is a prefix of the new context (C-speed comparison)
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _source(path: str | Path) -> str:
    local = Path(path).expanduser()
    return str(local) if local.exists() else str(path)


def load_model(name: str, path: str | Path, *, device: str = "auto", dtype: str = "auto") -> PreTrainedModel:
    """A causal LM from a directory or hub id, on ``device`` in ``dtype`` (``auto``: bf16 on a GPU, else fp32)."""
    torch_device = resolve_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(_source(path), dtype=resolve_dtype(dtype, torch_device))
    except OSError as e:
        raise FileNotFoundError(f"stage {name!r}: cannot load model {str(path)!r}: {e}") from None
    return model.to(torch_device)


@dataclass(slots=True)
class _Sequence:
    cache: DynamicCache | KVCache
    tokens: list[int] = field(default_factory=list)  # the tokens whose keys and values are in ``cache``


def choose_forward(model: PreTrainedModel, forward: str, *, is_target: bool) -> str:
    """Resolve a stage's ``forward`` setting: ``auto`` is the lean forward for a drafter whose architecture it
    supports and transformers' forward otherwise; the target always keeps transformers' forward, the
    reference its output must equal."""
    if forward == "transformers" or (forward == "auto" and is_target):
        return "transformers"
    if is_target:
        raise ValueError("the target keeps transformers' forward (its greedy decode is the reference); use auto")
    reason = unsupported_reason(model)
    if reason is None:
        return "lean"
    if forward == "lean":
        raise ValueError(f"forward: lean does not support this model: {reason}; use auto or transformers")
    return "transformers"


class HFStage:
    """Wraps an ``AutoModelForCausalLM``; ``score`` runs the model's forward pass directly on its cache.

    ``forward`` is ``transformers`` (the model's own forward) or ``lean`` (:class:`LeanDecoder`, for drafters).
    """

    def __init__(
        self, name: str, model: PreTrainedModel, *, vocab_size: int | None = None, tokenizer=None,
        forward: str = "transformers",
    ):
        if forward not in ("transformers", "lean"):
            raise ValueError(f"forward must be transformers or lean, got {forward!r}")
        self.name = name
        self.model = model.eval()
        self.forward = forward
        self._lean = LeanDecoder(self.model) if forward == "lean" else None
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.model_vocab_size = model.get_output_embeddings().weight.shape[0]
        self.vocab_size = vocab_size or self.model_vocab_size  # the target's width, which logits are fitted to
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._sequences: dict[int, _Sequence] = {}
        self.forward_passes = 0
        self.forward_seconds = 0.0

    @classmethod
    def from_pretrained(
        cls, name: str, path: str | Path, *, device: str = "auto", dtype: str = "auto", forward: str = "transformers",
        is_target: bool = False,
    ) -> HFStage:
        from transformers import AutoTokenizer

        model = load_model(name, path, device=device, dtype=dtype)
        forward = choose_forward(model, forward, is_target=is_target)
        source = _source(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"stage {name!r}: model {str(path)!r} has no loadable tokenizer: {e}") from None
        return cls(name, model, tokenizer=tokenizer, forward=forward)

    def score(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        return [self._score_one(s, c, n) for s, c, n in zip(seq_ids, contexts, num_positions)]

    def argmax(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        return [logits.argmax(dim=-1) for logits in self.score(seq_ids, contexts, num_positions)]

    def greedy_draft(self, seq_id: int, context: Sequence[int], k: int, eos_token_id: int | None) -> list[int]:
        tokens: list[int] = []
        for _ in range(k):
            token = int(self._score_one(seq_id, [*context, *tokens], 1).argmax())
            tokens.append(token)
            if token == eos_token_id:
                break
        return tokens

    @torch.inference_mode()
    def _score_one(self, seq_id: int, context: Sequence[int], num_positions: int) -> torch.Tensor:
        assert 1 <= num_positions <= len(context), (num_positions, len(context))
        if len(context) > self.max_context:
            raise ValueError(
                f"stage {self.name!r}: context of {len(context)} tokens exceeds the model's {self.max_context}"
            )
        seq = self._sequences.get(seq_id)
        if seq is None:
            cache = self._lean.new_cache() if self._lean else DynamicCache(config=self.model.config)
            seq = self._sequences[seq_id] = _Sequence(cache)
        # Keep the common prefix, but always recompute the positions whose logits are asked for.
        keep = min(common_prefix_length(seq.tokens, context), len(context) - num_positions)
        started = time.perf_counter()
        if self._lean is not None:
            seq.cache.crop(keep)
            new = torch.tensor(context[keep:], dtype=torch.long, device=self.device)  # [new_tokens]
            logits = self._lean.forward(new, seq.cache, num_positions)  # [num_positions, vocab]
        else:
            if keep < len(seq.tokens):
                seq.cache.crop(keep - len(seq.tokens))  # a negative count drops that many tokens from the end
            new = torch.tensor([context[keep:]], dtype=torch.long, device=self.device)  # [1, new_tokens]
            logits = self.model(input_ids=new, cache=seq.cache, use_cache=True, logits_to_keep=num_positions).logits[0]
        self.forward_seconds += time.perf_counter() - started
        self.forward_passes += 1
        seq.tokens = list(context)
        return self._fit_vocab(logits)  # [num_positions, vocab]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad (with -inf) or cut logits to the target's vocabulary width; padded vocabularies differ by model."""
        width = logits.shape[-1]
        if width == self.vocab_size:
            return logits
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))

    def release(self, seq_id: int) -> None:
        self._sequences.pop(seq_id, None)

    def num_cached_sequences(self) -> int:
        return len(self._sequences)

    def cached_tokens(self, seq_id: int) -> int:
        seq = self._sequences.get(seq_id)
        return len(seq.tokens) if seq else 0
