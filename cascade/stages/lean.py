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

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from cascade.stages import cpu_attention
from cascade.stages.slots import INITIAL_CAPACITY, INITIAL_SLOTS, SlotCache

_ARCHITECTURES = {"llama", "qwen2"}
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inverse frequencies fixed at load time


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


_PAD_LIMIT = 16  # sequences with up to this many new tokens (decodes, drafts to verify) attend together: through
# the CPU kernel (cascade.stages.cpu_attention), each row reading its own keys; or, without it, in padded calls over runs
# of nearby cache slots read as views: a step's attention is bound by reading the keys and values, and a view reads
# each slot's once. Longer ones (prefill chunks) attend alone through SDPA, whose blocked kernel suits long runs.
_CALL_COST = 8000  # the fixed cost of one more attention call (its indexing and masking, per layer) in query-key
# pairs of a padded call: measured on a CPU, where one call costs about what 16 sequences × 500 keys of padding do


@dataclass(frozen=True, slots=True)
class _Group:
    """Sequences whose attention runs as one padded call over a consecutive range of cache slots, read as a view
    (far cheaper than gathering the rows of scattered slots: a copy of their keys and values). The slots of the
    range that are not in the group ride along with dummy queries. B_g slots in the range, T_g new tokens at most,
    L_g keys at most."""

    rows: torch.Tensor | None  # [N_g]: the batch's new-token rows in this group (None: all rows, in order)
    batch_of: torch.Tensor  # [N_g]: the place (0..B_g-1) in the range of the slot each row belongs to
    offset: torch.Tensor  # [N_g]: its index among its sequence's new tokens
    slots: slice  # the range of cache slots
    mask: torch.Tensor | None  # [B_g, 1, T_g, L_g] bool: query i of slot b sees keys 0 .. start_b + i
    causal: bool  # one sequence's first tokens (a prompt's first chunk): the mask is SDPA's own causal one, which
    # skips the blocks above the diagonal instead of computing and masking them (half the work of a long chunk)
    dense: bool  # every slot of the range is in the group, in order: one row per slot when T_g == 1
    count: int  # B_g
    width: int  # T_g
    span: int  # L_g


@dataclass(frozen=True, slots=True)
class _Ragged:
    """The sequences with few new tokens, attended in one call of the CPU kernel, each row over exactly its own
    sequence's keys (no padding, no mask). B_r sequences, N_r rows."""

    rows: torch.Tensor | None  # [N_r]: their rows in the batch (None: all rows, in order)
    seq_slot: torch.Tensor  # [B_r]: each sequence's cache slot
    seq_start: torch.Tensor  # [B_r]: its positions cached before this step
    cu_rows: torch.Tensor  # [B_r + 1]: where its rows start among the N_r


@dataclass(frozen=True, slots=True)
class TreeNodes:
    """A sequence's last new tokens as the nodes of a draft tree (:mod:`cascade.verify.tree`): each attends to the
    context and to its ancestors only, at the position of its depth, while its keys and values are stored one after
    the other past the context. K nodes."""

    parents: list[int]  # [K]: each node's parent among the K, -1 for a child of the context
    depths: list[int]  # [K]: its distance from the context (0: the token right after it)
    cached: int = 0  # the first nodes are cached already (a tree grown pass by pass): the new tokens are the other
    # K - cached nodes, and the cached ones the slot's last positions before them, right after the context


@dataclass(frozen=True, slots=True)
class _Batch:
    """Where each of the N new tokens of a ragged batch goes."""

    slot_of: torch.Tensor  # [N]: its sequence's cache slot
    position: torch.Tensor  # [N]: where in the slot its keys and values are stored
    rotary: torch.Tensor  # [N]: its position in the sequence (the rotary embedding's): ``position``, except for a
    # tree's nodes, which sit at the position of their depth
    ragged: _Ragged | None  # the short sequences, when the kernel attends them
    groups: list[_Group]  # the SDPA calls of the others
    span: int  # the longest sequence after this step


def _short_groups(short: list[int], slots: list[int], starts: list[int], lengths: list[int]) -> list[list[int]]:
    """The attention calls of the sequences with few new tokens: runs of all of them padded to the widest in
    each, or runs of the decodes (one new token, no padding) and runs of the drafts apart — whichever reads and
    computes fewer padded query-key pairs, counting ``_CALL_COST`` per call. One request verifying a long draft
    among many decodes must not pad all their queries to its width; a few short drafts cost less padded than in
    calls of their own."""

    def cost(runs: list[list[int]]) -> int:
        total = 0
        for run in runs:
            count = max(slots[b] for b in run) - min(slots[b] for b in run) + 1
            span = max(starts[b] + lengths[b] for b in run)
            total += _CALL_COST + count * max(lengths[b] for b in run) * span
        return total

    together = _runs(short, slots)
    decodes = [b for b in short if lengths[b] == 1]
    if len(decodes) in (0, len(short)):
        return together
    apart = _runs(decodes, slots) + _runs([b for b in short if lengths[b] > 1], slots)
    return min(together, apart, key=cost)


def _runs(members: list[int], slots: list[int]) -> list[list[int]]:
    """``members`` split into runs of nearby slots, each run at least half members (the rest of its range rides
    along): one attention call per run. Each run lists its members in batch order, as their rows are."""
    runs: list[list[int]] = []
    for b in sorted(members, key=slots.__getitem__):
        if runs and slots[b] - slots[runs[-1][0]] + 1 <= 2 * (len(runs[-1]) + 1):
            runs[-1].append(b)
        else:
            runs.append([b])
    return [sorted(run) for run in runs]


def _group(members: list[int], firsts: list[int], starts: list[int], lengths: list[int], slots: list[int],
           whole: bool, device: torch.device) -> _Group:
    # Index lists are built in Python and become tensors in one call: a step's layout is a dozen tiny tensors,
    # and each torch call costs microseconds (and lets another thread take the GIL) whatever its size.
    starts_g, lengths_g, slots_g = ([v[b] for b in members] for v in (starts, lengths, slots))
    low = min(slots_g)
    count = max(slots_g) - low + 1
    where = [s - low for s in slots_g]  # each member's place in the slot range
    dense = where == list(range(count))
    width = max(lengths_g)
    span = max(s + n for s, n in zip(starts_g, lengths_g))
    batch_of = [w for w, n in zip(where, lengths_g) for _ in range(n)]  # [N_g]: each new token's place in the range
    offset = [i for n in lengths_g for i in range(n)]  # [N_g]: and its place among its sequence's new tokens
    index = [batch_of, offset]
    if not whole:  # [N_g]: the group's rows in the batch
        index.append([r for b in members for r in range(firsts[b], firsts[b] + lengths[b])])
    index_t = torch.tensor(index, device=device)
    mask = None
    causal = len(members) == 1 and starts_g[0] == 0 and width > 1
    if not causal and (width > 1 or not dense or any(s + n != span for s, n in zip(starts_g, lengths_g))):
        range_starts = [0] * count  # a slot outside the group: its dummy queries see key 0 onwards (no NaN)
        for w, s in zip(where, starts_g):
            range_starts[w] = s
        queries = [[s + i for i in range(width)] for s in range_starts]  # [B_g, T_g]: each query's position
        keys = torch.arange(span, device=device)[None, None]
        mask = (keys <= torch.tensor(queries, device=device)[:, :, None])[:, None]  # [B_g, 1, T_g, L_g]
    rows = None if whole else index_t[2]
    return _Group(rows, index_t[0], index_t[1], slice(low, low + count), mask, causal, dense, count, width, span)


def _ragged(short: list[int], firsts: list[int], starts: list[int], lengths: list[int], slots: list[int],
            whole: bool, device: torch.device) -> _Ragged:
    cu_rows = [0, *itertools.accumulate(lengths[b] for b in short)]
    index = torch.tensor([slots[b] for b in short] + [starts[b] for b in short] + cu_rows, device=device)
    rows = None
    if not whole:
        rows = torch.tensor([r for b in short for r in range(firsts[b], firsts[b] + lengths[b])], device=device)
    count = len(short)
    return _Ragged(rows, index[:count], index[count : 2 * count], index[2 * count :])


def _tree_group(b: int, tree: TreeNodes, firsts: list[int], starts: list[int], lengths: list[int], slots: list[int],
                whole: bool, device: torch.device) -> _Group:
    """The attention call of one sequence whose last new tokens are a tree's nodes: U context tokens, then the K -
    cached new nodes, each node seeing the context and its ancestors (the tree attention mask), cached or new."""
    start, count = starts[b], lengths[b]
    nodes = len(tree.parents)
    tail = count - (nodes - tree.cached)  # U: the context's tokens fed before the nodes (none when some are cached)
    span = start + count
    # The new tokens' view of the positions from the cached nodes on (the context's new tokens, then every node:
    # [T, U + K]), built in Python (a few dozen cells) and made a tensor in one call: the context's tokens causally,
    # each node those and itself and its ancestors.
    seen = [[j <= i for j in range(tail)] + [False] * nodes for i in range(tail)]
    for node in range(tree.cached, nodes):
        row = [True] * tail + [False] * nodes
        parent = node
        while parent >= 0:
            row[tail + parent] = True
            parent = tree.parents[parent]
        seen.append(row)
    mask = torch.ones(count, span, dtype=torch.bool)  # [T, L]: every new token sees the context before the nodes
    mask[:, start - tree.cached :] = torch.tensor(seen, dtype=torch.bool)
    rows = None if whole else torch.arange(firsts[b], firsts[b] + count, device=device)
    zeros = torch.zeros(count, dtype=torch.long, device=device)
    return _Group(rows, zeros, torch.arange(count, device=device), slice(slots[b], slots[b] + 1),
                  mask.to(device)[None, None], False, True, 1, count, span)  # (a bool mask: SDPA's CPU kernel takes
    # it as it is; an additive float one measured no faster)


def _layout(slots: list[int], starts: list[int], lengths: list[int], kernel: bool, device: torch.device,
            trees: list[TreeNodes | None] | None = None) -> _Batch:
    firsts = [0, *itertools.accumulate(lengths)][:-1]  # [B]: each sequence's first row in the batch
    trees = trees or [None] * len(lengths)
    short = [b for b, n in enumerate(lengths) if n <= _PAD_LIMIT and trees[b] is None]
    members = [[b] for b, n in enumerate(lengths) if n > _PAD_LIMIT and trees[b] is None]
    treed = [b for b, tree in enumerate(trees) if tree is not None]
    ragged = None
    if short and kernel:
        ragged = _ragged(short, firsts, starts, lengths, slots, not members and not treed, device)
    elif short:
        members = _short_groups(short, slots, starts, lengths) + members
    whole = len(members) + len(treed) == 1 and ragged is None
    groups = [_group(m, firsts, starts, lengths, slots, whole, device) for m in members]
    groups += [_tree_group(b, trees[b], firsts, starts, lengths, slots, whole, device) for b in treed]
    slot_of = [s for s, n in zip(slots, lengths) for _ in range(n)]
    position = [p + i for p, n in zip(starts, lengths) for i in range(n)]
    rotary = position
    if treed:
        rotary = []
        for p, n, tree in zip(starts, lengths, trees):
            if tree is None:
                rotary += [p + i for i in range(n)]
                continue
            tail = n - (len(tree.depths) - tree.cached)  # the context's tokens, then the new nodes at their depths
            rotary += [p + i for i in range(tail)] + [p + tail - tree.cached + d for d in tree.depths[tree.cached :]]
    where = torch.tensor([slot_of, position, rotary], device=device)  # [3, N]: each new token's slot, place, position
    return _Batch(where[0], where[1], where[2], ragged, groups, max(s + n for s, n in zip(starts, lengths)))


class LeanDecoder:
    """Runs a supported decoder-only model's forward pass on a :class:`SlotCache` (see the module docstring).
    ``attention``: ``auto`` attends decodes and drafts through the CPU kernel (:mod:`cascade.stages.cpu_attention`)
    for a float32 or float64 model on the CPU where it builds, and through padded SDPA calls otherwise; ``kernel`` or
    ``sdpa`` insist (the ``CASCADE_ATTENTION`` environment variable overrides all three)."""

    def __init__(self, model: PreTrainedModel, attention: str = "auto"):
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
        self.kernel = cpu_attention.use_kernel(self.device, self.dtype, attention)

    def new_cache(self, slots: int = INITIAL_SLOTS, capacity: int = 0) -> SlotCache:
        """A cache of ``slots`` sequences holding ``capacity`` positions each from the start (at least the initial
        capacity; more only as contexts need)."""
        return SlotCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, slots, capacity)

    def forward(
        self, cache: SlotCache, slots: list[int], new_tokens: list[list[int]], num_positions: list[int],
        trees: list[TreeNodes | None] | None = None,
    ) -> torch.Tensor:
        """Append ``new_tokens[b]`` to slot ``slots[b]`` (after its first ``cache.lengths[slot]`` positions) and
        return the logits of each sequence's last ``num_positions[b]`` new tokens, sequence after sequence:
        ``[sum(num_positions), vocab]``. Every ``new_tokens[b]`` is non-empty; slots are distinct. ``trees[b]``: the
        last of ``new_tokens[b]`` are a draft tree's nodes (:class:`TreeNodes`; None: a chain)."""
        starts = [cache.lengths[s] for s in slots]
        lengths = [len(t) for t in new_tokens]
        batch = _layout(slots, starts, lengths, self.kernel, self.device, trees)
        cache.reserve(batch.span)
        cos, sin = self._rotation(batch.span)
        cos, sin = cos[batch.rotary][:, None], sin[batch.rotary][:, None]  # [N, 1, head_dim] each
        flat = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.long, device=self.device)
        x = F.embedding(flat, self.embed)  # [N, hidden]
        q_width, kv_width = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        for layer, kv in zip(self.layers, cache.buffer):  # kv: [2, slots, kv_heads, capacity, head_dim]
            h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [N, q_width + 2 * kv_width]
            # queries and keys rotated in one call: [N, heads + kv_heads, head_dim]
            qk = _rotate(qkv[:, : q_width + kv_width].view(-1, self.num_heads + self.kv_heads, self.head_dim), cos, sin)
            q = qk[:, : self.num_heads]  # [N, heads, head_dim]
            keys, values = kv[0], kv[1]  # [slots, kv_heads, capacity, head_dim] each
            keys[batch.slot_of, :, batch.position] = qk[:, self.num_heads :]
            v = qkv[:, q_width + kv_width :].view(-1, self.kv_heads, self.head_dim)
            values[batch.slot_of, :, batch.position] = v
            if batch.ragged is not None and batch.ragged.rows is None:
                attended = self._attend_ragged(batch.ragged, q.contiguous(), keys, values)  # [N, heads, head_dim]
            elif batch.ragged is None and len(batch.groups) == 1:
                attended = self._attend(batch.groups[0], q, keys, values)
            else:
                attended = torch.empty_like(q)
                if batch.ragged is not None:
                    rows = batch.ragged.rows
                    attended[rows] = self._attend_ragged(batch.ragged, q[rows], keys, values)
                for group in batch.groups:
                    attended[group.rows] = self._attend(group, q[group.rows], keys, values)
            x = x + F.linear(attended.reshape(-1, q_width), layer.out, layer.out_bias)
            h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate, up = F.linear(h, layer.gate_up).split((self.intermediate, self.intermediate), dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        for slot, start, length in zip(slots, starts, lengths):
            cache.lengths[slot] = start + length
        ends = itertools.accumulate(lengths)
        rows = [i for end, n in zip(ends, num_positions) for i in range(end - n, end)]
        if not rows:
            return x.new_empty((0, self.head.shape[0]))
        x = F.rms_norm(x[rows], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.head)  # [sum(num_positions), vocab]

    def _attend(self, group: _Group, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of one group's queries ``q`` [N_g, heads, head_dim] over their slots' cached keys and values
        ([slots, kv_heads, capacity, head_dim] each); returns [N_g, heads, head_dim]."""
        direct = group.width == 1 and group.dense  # one new token per slot of the range: no padding
        if direct:
            queries = q[:, :, None]  # [B_g, heads, 1, head_dim]
        else:
            queries = q.new_zeros(group.count, group.width, *q.shape[1:])
            queries[group.batch_of, group.offset] = q
            queries = queries.transpose(1, 2)  # [B_g, heads, T_g, head_dim]
        attended = F.scaled_dot_product_attention(
            queries,
            keys[group.slots, :, : group.span],  # [B_g, kv_heads, L_g, head_dim]
            values[group.slots, :, : group.span],
            attn_mask=group.mask,
            is_causal=group.causal,
            enable_gqa=self.kv_heads != self.num_heads,
        )  # [B_g, heads, T_g, head_dim]
        if direct:
            return attended[:, :, 0]
        return attended.transpose(1, 2)[group.batch_of, group.offset]

    def _attend_ragged(self, ragged: _Ragged, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
                       ) -> torch.Tensor:
        return cpu_attention.ragged_attention(
            q, keys, values, ragged.seq_slot, ragged.seq_start, ragged.cu_rows, self.head_dim**-0.5
        )

    def _rotation(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if end > self._cos.shape[0]:  # the table grows by doubling, computed by the model's own rotary module
            size = max(end, 2 * self._cos.shape[0], INITIAL_CAPACITY)
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
