"""A lean, batched forward pass for Llama-family models, sharing the Hugging Face model's weights.

One call runs many sequences at once, each with its own new tokens and its own place in a shared KV cache
(ragged: a prefill chunk, a one-token decode and a draft to verify may sit in one batch). On a CPU, and on a GPU
without CUDA graphs, a small model's forward pass over a few tokens is mostly per-operator overhead:
transformers' Llama forward spends most of a 2-layer model's 0.7 ms building masks, position tensors and cache
objects; this one does the same arithmetic in about half the operators (fused QKV and gate/up projections, a
rotary table computed once) and keeps every sequence's keys and values in one preallocated :class:`SlotCache`,
where a rejection crops a sequence by lowering its length.

The logits equal transformers' to float32 rounding (tests/test_lean.py), not bit for bit: a batched forward is
never bit-identical to an unbatched one anyway (DESIGN.md, "Numerics"). The target runs it too, which is what
makes batched serving pay; its output is checked against transformers' own ``generate``.

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
_INITIAL_CAPACITY = 256  # positions per slot before the first doubling
_INITIAL_SLOTS = 4  # sequences before the first doubling


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
    out_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class SlotCache:
    """Keys and values of many sequences, one slot each, in one preallocated buffer per stage.

    ``buffer``: [layers, 2, slots, kv_heads, capacity, head_dim]. A sequence owns a slot for its lifetime and
    ``lengths[slot]`` positions of it are filled; a rejection crops it by lowering that length. Slots and capacity
    grow by doubling (a copy) as sequences arrive and lengthen, so memory follows use: at most the engine's
    ``max_running`` slots times the longest context it admits.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.buffer = torch.zeros(  # zeros, not empty: a masked-out key's value still meets a 0 weight, and 0·NaN = NaN
            (num_layers, 2, _INITIAL_SLOTS, kv_heads, _INITIAL_CAPACITY, head_dim), dtype=dtype, device=device
        )
        self.lengths: list[int] = [0] * _INITIAL_SLOTS  # [slots]: positions filled
        self._free: list[int] = list(range(_INITIAL_SLOTS - 1, -1, -1))  # a stack: the lowest slot is taken first

    @property
    def capacity(self) -> int:
        return self.buffer.shape[4]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def allocate(self) -> int:
        if not self._free:
            self._grow(2 * len(self.lengths), self.capacity)
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)  # keep handing out the lowest slots: the running batch stays contiguous

    def reserve(self, length: int) -> None:
        if length > self.capacity:
            capacity = self.capacity
            while capacity < length:
                capacity *= 2
            self._grow(len(self.lengths), capacity)

    def _grow(self, slots: int, capacity: int) -> None:
        old = self.buffer
        shape = list(old.shape)
        shape[2], shape[4] = slots, capacity
        self.buffer = old.new_zeros(shape)
        self.buffer[:, :, : old.shape[2], :, : old.shape[4]] = old
        self._free = list(range(slots - 1, len(self.lengths) - 1, -1)) + self._free
        self.lengths += [0] * (slots - len(self.lengths))


@dataclass(frozen=True, slots=True)
class _Batch:
    """Where each new token of a ragged batch goes. N new tokens over B sequences, at most T_max per sequence."""

    seq_of: torch.Tensor  # [N]: the sequence (0..B-1) each new token belongs to
    offset: torch.Tensor  # [N]: its index among its sequence's new tokens
    slot_of: torch.Tensor  # [N]: its sequence's cache slot
    position: torch.Tensor  # [N]: its absolute position
    slots: torch.Tensor | slice  # [B] cache slots (a slice when they are consecutive: no gather copy)
    mask: torch.Tensor | None  # [B, 1, T_max, L_max] bool: query i of b sees keys 0 .. start_b + i
    width: int  # T_max
    span: int  # L_max: the longest sequence after this step


def _layout(slots: list[int], starts: list[int], lengths: list[int], device: torch.device) -> _Batch:
    count = len(slots)
    lengths_t = torch.tensor(lengths, device=device)  # [B]
    starts_t = torch.tensor(starts, device=device)  # [B]
    seq_of = torch.repeat_interleave(torch.arange(count, device=device), lengths_t)  # [N]
    first = torch.cumsum(lengths_t, 0) - lengths_t  # [B]: index of each sequence's first new token
    offset = torch.arange(seq_of.numel(), device=device) - first[seq_of]  # [N]
    width = max(lengths)
    span = max(s + n for s, n in zip(starts, lengths))
    mask = None
    if width > 1 or any(s + n != span for s, n in zip(starts, lengths)):  # else every query sees every key
        queries = starts_t[:, None] + torch.arange(width, device=device)[None]  # [B, T_max]: absolute positions
        mask = (torch.arange(span, device=device)[None, None] <= queries[:, :, None])[:, None]  # [B, 1, T, L]
    consecutive = all(b == a + 1 for a, b in zip(slots, slots[1:]))
    slot_index = slice(slots[0], slots[-1] + 1) if consecutive else torch.tensor(slots, device=device)
    return _Batch(
        seq_of, offset, torch.tensor(slots, device=device)[seq_of], starts_t[seq_of] + offset, slot_index, mask,
        width, span,
    )


class LeanDecoder:
    """Runs a supported decoder-only model's forward pass on a :class:`SlotCache` (see the module docstring)."""

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

    def new_cache(self) -> SlotCache:
        return SlotCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    def forward(
        self, cache: SlotCache, slots: list[int], new_tokens: list[list[int]], num_positions: list[int]
    ) -> torch.Tensor:
        """Append ``new_tokens[b]`` to slot ``slots[b]`` (after its first ``cache.lengths[slot]`` positions) and
        return the logits of each sequence's last ``num_positions[b]`` new tokens, sequence after sequence:
        ``[sum(num_positions), vocab]``. Every ``new_tokens[b]`` is non-empty; slots are distinct."""
        starts = [cache.lengths[s] for s in slots]
        lengths = [len(t) for t in new_tokens]
        batch = _layout(slots, starts, lengths, self.device)
        cache.reserve(batch.span)
        cos, sin = self._rotation(batch.span)
        cos, sin = cos[batch.position][:, None], sin[batch.position][:, None]  # [N, 1, head_dim] each
        flat = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.long, device=self.device)
        x = F.embedding(flat, self.embed)  # [N, hidden]
        count, q_width, kv_width = len(slots), self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        for layer, kv in zip(self.layers, cache.buffer):  # kv: [2, slots, kv_heads, capacity, head_dim]
            h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [N, q_width + 2 * kv_width]
            q, k, v = qkv.split((q_width, kv_width, kv_width), dim=-1)
            q = _rotate(q.view(-1, self.num_heads, self.head_dim), cos, sin)  # [N, heads, head_dim]
            keys, values = kv[0], kv[1]  # [slots, kv_heads, capacity, head_dim] each
            keys[batch.slot_of, :, batch.position] = _rotate(k.view(-1, self.kv_heads, self.head_dim), cos, sin)
            values[batch.slot_of, :, batch.position] = v.view(-1, self.kv_heads, self.head_dim)
            if batch.width == 1:  # one new token per sequence: no padding
                queries = q[:, :, None]  # [B, heads, 1, head_dim]
            else:
                queries = q.new_zeros(count, batch.width, self.num_heads, self.head_dim)
                queries[batch.seq_of, batch.offset] = q
                queries = queries.transpose(1, 2)  # [B, heads, T_max, head_dim]
            attended = F.scaled_dot_product_attention(
                queries,
                keys[batch.slots, :, : batch.span],  # [B, kv_heads, L_max, head_dim]
                values[batch.slots, :, : batch.span],
                attn_mask=batch.mask,
                enable_gqa=self.kv_heads != self.num_heads,
            )  # [B, heads, T_max, head_dim]
            if batch.width == 1:
                attended = attended[:, :, 0]  # [N, heads, head_dim]
            else:
                attended = attended.transpose(1, 2)[batch.seq_of, batch.offset]  # [N, heads, head_dim]
            x = x + F.linear(attended.reshape(-1, q_width), layer.out, layer.out_bias)
            h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate, up = F.linear(h, layer.gate_up).split((self.intermediate, self.intermediate), dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        for slot, start, length in zip(slots, starts, lengths):
            cache.lengths[slot] = start + length
        ends = torch.cumsum(torch.tensor(lengths), 0).tolist()
        rows = [i for end, n in zip(ends, num_positions) for i in range(end - n, end)]
        if not rows:
            return x.new_empty((0, self.head.shape[0]))
        x = F.rms_norm(x[rows], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.head)  # [sum(num_positions), vocab]

    def _rotation(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if end > self._cos.shape[0]:  # the table grows by doubling, computed by the model's own rotary module
            size = max(end, 2 * self._cos.shape[0], _INITIAL_CAPACITY)
            positions = torch.arange(size, device=self.device)[None]  # [1, size]
            cos, sin = self._rotary(self.embed[:1][None], positions)  # [1, size, head_dim] each
            self._cos, self._sin = cos[0], sin[0]
        return self._cos, self._sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[..., head_dim]``: ``x·cos + rotate_half(x)·sin``."""
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
        layer.input_layernorm.weight, qkv, qkv_bias, attention.o_proj.weight, attention.o_proj.bias,
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
