"""A lean forward pass for small Llama-family drafters, sharing the Hugging Face model's weights.

A drafter's forward pass over one or a few tokens does almost no arithmetic; on a CPU (and on a GPU without
CUDA graphs) its time is the per-operator overhead of the framework. transformers' Llama forward spends most
of a 2-layer drafter's 0.7 ms building masks, position tensors and cache objects; this one does the same
arithmetic in about half the operators: fused QKV and gate/up projections, a rotary table computed once, a
preallocated KV cache that a rejection crops by moving an index. On the demo family it halves the small and
medium members' per-token cost, which is what decides whether a model drafter pays for itself.

Drafts need not be bit-identical to transformers' (verification makes any draft lossless, and in sampling
mode the stage's own rows are the ``q`` its tokens were drawn from), so this path is for drafters only: the
target keeps transformers' forward, whose greedy decode is the reference the output must equal.

Supported: ``llama`` and ``qwen2`` decoders (optionally with QKV biases) with SiLU MLPs and a rotary
embedding whose frequencies do not depend on the sequence length. :func:`unsupported_reason` names what
else a model uses; such a model keeps transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

_ARCHITECTURES = {"llama", "qwen2"}
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inverse frequencies fixed at load time
_INITIAL_CAPACITY = 256  # cache slots per sequence before the first doubling


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (``None`` when it can)."""
    config = model.config
    if config.model_type not in _ARCHITECTURES:
        return f"architecture {config.model_type!r} (supported: {', '.join(sorted(_ARCHITECTURES))})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (supported: silu)"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in _STATIC_ROPE:
        return f"rope type {rope_type!r} (supported: {', '.join(sorted(_STATIC_ROPE))})"
    return None


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    out: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class KVCache:
    """One sequence's keys and values for every layer, in preallocated buffers that double when full."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.length = 0  # positions filled
        self._shape = (num_layers, 2, kv_heads, _INITIAL_CAPACITY, head_dim)
        self.buffer = torch.empty(self._shape, dtype=dtype, device=device)  # [layers, 2, kv_heads, capacity, head_dim]

    def reserve(self, length: int) -> None:
        capacity = self.buffer.shape[3]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        grown = self.buffer.new_empty((*self._shape[:3], capacity, self._shape[4]))
        grown[:, :, :, : self.length] = self.buffer[:, :, :, : self.length]
        self.buffer = grown

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length


class LeanDecoder:
    """Runs a supported decoder-only model's forward pass on a :class:`KVCache` (see the module docstring)."""

    def __init__(self, model: PreTrainedModel):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        config = model.config
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden = config.hidden_size
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.embed = model.model.embed_tokens.weight  # [vocab, hidden]
        self.final_norm = model.model.norm.weight  # [hidden]
        self.head = model.lm_head.weight  # [vocab, hidden]
        self.layers = [_fuse(layer) for layer in model.model.layers]
        self._rotary = model.model.rotary_emb
        self._cos = self._sin = self.embed.new_empty((0, self.head_dim))  # [positions, head_dim]
        self.dtype, self.device = self.embed.dtype, self.embed.device

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    def forward(self, new_tokens: torch.Tensor, cache: KVCache, num_positions: int) -> torch.Tensor:
        """Logits ``[num_positions, vocab]`` for the last positions of ``new_tokens`` (``[new]``), appended to
        ``cache``."""
        start, new = cache.length, new_tokens.shape[0]
        end = start + new
        cache.reserve(end)
        cos, sin = self._rotation(start, end)  # [new, head_dim] each
        # Query i (absolute position start + i) sees keys 0 .. start + i. One query needs no mask.
        mask = None if new == 1 else torch.ones(new, end, dtype=torch.bool, device=self.device).tril(start)
        q_width, kv_width = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        x = F.embedding(new_tokens, self.embed)  # [new, hidden]
        for layer, kv in zip(self.layers, cache.buffer):  # kv: [2, kv_heads, capacity, head_dim]
            h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [new, q_width + 2 * kv_width]
            q, k, v = qkv.split((q_width, kv_width, kv_width), dim=-1)
            q = _rotate(q.view(new, self.num_heads, self.head_dim).transpose(0, 1), cos, sin)  # [heads, new, hd]
            kv[0, :, start:end] = _rotate(k.view(new, self.kv_heads, self.head_dim).transpose(0, 1), cos, sin)
            kv[1, :, start:end] = v.view(new, self.kv_heads, self.head_dim).transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                q, kv[0, :, :end], kv[1, :, :end], attn_mask=mask, enable_gqa=self.kv_heads != self.num_heads
            )  # [heads, new, head_dim]
            x = x + F.linear(attended.transpose(0, 1).reshape(new, q_width), layer.out)
            h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate, up = F.linear(h, layer.gate_up).split((self.intermediate, self.intermediate), dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        cache.length = end
        x = F.rms_norm(x[new - num_positions :], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.head)  # [num_positions, vocab]

    def _rotation(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if end > self._cos.shape[0]:  # the table grows by doubling, computed by the model's own rotary module
            size = max(end, 2 * self._cos.shape[0], _INITIAL_CAPACITY)
            positions = torch.arange(size, device=self.device)[None]  # [1, size]
            cos, sin = self._rotary(self.embed[:1][None], positions)  # [1, size, head_dim] each
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[start:end], self._sin[start:end]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[heads, new, head_dim]``: ``x·cos + rotate_half(x)·sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _fuse(layer: torch.nn.Module) -> _Layer:
    """One layer's weights with Q/K/V and gate/up concatenated; the model's modules are re-pointed at views of
    the fused tensors, so the weights are not held twice."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv = _concat_into(attention.q_proj, attention.k_proj, attention.v_proj)
    gate_up = _concat_into(mlp.gate_proj, mlp.up_proj)
    qkv_bias = None
    if attention.q_proj.bias is not None:
        qkv_bias = torch.cat([attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias])
    return _Layer(
        layer.input_layernorm.weight, qkv, qkv_bias, attention.o_proj.weight,
        layer.post_attention_layernorm.weight, gate_up, mlp.down_proj.weight,
    )


def _concat_into(*linears: torch.nn.Linear) -> torch.Tensor:
    fused = torch.cat([linear.weight.detach() for linear in linears])  # [sum of out_features, in_features]
    offset = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused
