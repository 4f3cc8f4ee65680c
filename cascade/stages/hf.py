"""A Hugging Face causal LM as a cascade stage, with its KV cache kept aligned by longest common prefix.

Before each forward pass the stage compares the tokens it has cached for a sequence with the context it is
asked about, crops the cache to their common prefix and feeds only the rest. A rejection anywhere in the
cascade therefore needs no rollback message: the next call repairs the cache (DESIGN.md, "KV caches").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from cascade.emulation import EmulatedDevice, PassModel, Row
from cascade.sampling import BROKEN_ROW
from cascade.stages.draft import DraftSampling, draft_tokens, draft_tree
from cascade.stages.lean import LeanDecoder, TreeNodes, unsupported_reason
from cascade.stages.loading import load_model, load_tokenizer
from cascade.verify.records import Draft
from cascade.verify.tree import ROOT, Flat, spine_length

log = logging.getLogger("cascade.stages")

def _argmax_or_broken(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [rows, vocab] -> [rows]: each row's argmax, or ``BROKEN_ROW`` where the row is not finite."""
    values, ids = logits.max(dim=-1)
    return ids.masked_fill(~torch.isfinite(values), BROKEN_ROW)


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


def tokens_to_keep(cached: Sequence[int], context: Sequence[int], num_positions: int) -> int:
    """How many of a sequence's cached tokens its next pass over ``context`` keeps: their common prefix, but never
    the positions whose logits are asked for (at least one; those are recomputed). The one rule for a stage here
    and for a remote stage's mirror of its actor's cache."""
    return max(min(common_prefix_length(cached, context), len(context) - max(num_positions, 1)), 0)


@dataclass(slots=True)
class _Sequence:
    tokens: list[int] = field(default_factory=list)  # the tokens whose keys and values are cached
    slot: int = -1  # its slot in the stage's SlotCache (the lean forward)
    cache: DynamicCache | None = None  # its own cache (transformers' forward)
    tree: tuple[int, Flat] | None = None  # a draft tree scored last, its nodes stored from this position on: the
    # next pass moves the keys and values of the path the context took through it into place (no recompute)


def choose_forward(model: PreTrainedModel, forward: str) -> str:
    """Resolve a stage's ``forward`` setting: ``auto`` is the lean, batched forward when it supports the
    architecture and transformers' forward (one sequence at a time) otherwise."""
    if forward == "transformers":
        return "transformers"
    reason = unsupported_reason(model)
    if reason is None:
        return "lean"
    if forward == "lean":
        raise ValueError(f"forward: lean does not support this model: {reason}; use auto or transformers")
    log.warning("the lean forward does not support this model (%s): transformers' forward, unbatched", reason)
    return "transformers"


class HFStage:
    """Wraps an ``AutoModelForCausalLM``. ``forward`` is ``lean`` (:class:`LeanDecoder`: every call is one batched
    forward pass over all its sequences, their caches in one :class:`SlotCache`) or ``transformers`` (the model's
    own forward, one sequence at a time, for architectures the lean forward does not support). ``max_sequences``:
    how many sequences the engine runs at once, the lean cache's slots allocated up front; ``reserved_context``: the
    positions each slot holds from the start (0: as contexts need).

    ``reuse_prefixes`` (the lean forward): a released sequence's slot is retired, its keys and values kept, and a
    new sequence whose context starts with the same tokens takes it over and computes only what differs (a prompt
    sent again, a shared system prompt, the next turn of a chat); slots no running sequence holds are all it uses
    (:class:`~cascade.stages.slots.SlotCache`).

    ``emulation``: the stage stands for another model on another device (:mod:`cascade.emulation`); each pass computes
    with this model, then lasts as long as the emulated device's roofline says (stretched by its time scale).
    ``profile``: the roofline of what the stage really is (its model on its device): only the adaptive controller's
    cost prior, before it has measured a pass."""

    def __init__(
        self, name: str, model: PreTrainedModel, *, vocab_size: int | None = None, tokenizer=None,
        forward: str = "transformers", max_sequences: int = 4, reserved_context: int = 0, reuse_prefixes: bool = True,
        emulation: EmulatedDevice | None = None, profile: PassModel | None = None,
    ):
        if forward not in ("transformers", "lean"):
            raise ValueError(f"forward must be transformers or lean, got {forward!r}")
        self.name = name
        self.model = model.eval()
        self.lean = LeanDecoder(self.model) if forward == "lean" else None  # its forward pass (None: transformers')
        self._slots = self.lean.new_cache(max_sequences, reserved_context) if self.lean is not None else None
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # the target's width, which logits are fitted to (default: this model's own output width)
        self.vocab_size = vocab_size or model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._sequences: dict[int, _Sequence] = {}
        self.reuse_prefixes = reuse_prefixes and self._slots is not None
        self.reused_tokens = 0  # context tokens new sequences found cached in a retired slot
        self.new_tokens = 0
        self.emulation = emulation
        self.profile = emulation or profile

    @classmethod
    def from_pretrained(
        cls, name: str, path: str | Path, *, device: str = "auto", dtype: str = "auto", forward: str = "auto",
        max_sequences: int = 4, reserved_context: int = 0, reuse_prefixes: bool = True,
        emulation: EmulatedDevice | None = None, profile: PassModel | None = None,
    ) -> HFStage:
        model = load_model(name, path, device=device, dtype=dtype)
        forward = choose_forward(model, forward)
        tokenizer = load_tokenizer(name, path)
        return cls(name, model, tokenizer=tokenizer, forward=forward, max_sequences=max_sequences,
                   reserved_context=reserved_context, reuse_prefixes=reuse_prefixes, emulation=emulation,
                   profile=profile)

    def score(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        """Logits ``[num_positions[b], vocab]`` per sequence; ``num_positions[b] == 0`` only fills the cache (a
        prefill chunk). One forward pass for the whole batch with the lean forward."""
        return self._pass(seq_ids, contexts, num_positions, greedy=False)

    def argmax(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int]
    ) -> list[torch.Tensor]:
        return self._pass(seq_ids, contexts, num_positions, greedy=True)

    @property
    def scores_trees(self) -> bool:
        """Whether :meth:`score_tree` can run: the lean forward's tree attention (transformers' forward has none
        here)."""
        return self.lean is not None

    def score_tree(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], num_positions: Sequence[int],
        trees: Sequence[Flat | None],
    ) -> list[torch.Tensor]:
        """:meth:`score`, where ``trees[b]`` (when not None) is a draft tree continuing ``contexts[b]``: the last
        ``num_positions[b]`` of its ``1 + nodes`` logits rows come from the same forward pass, row 0 after the context
        and row 1 + n after node n (its context and its ancestors before it). The nodes' keys and values stay cached:
        the next pass over the sequence keeps those of the path its context took through the tree, and a tree pass
        over the same context whose tree grows this one (its first nodes the same, rows asked only of nodes after
        them: a drafter growing a tree pass by pass) computes only the nodes it adds."""
        assert all(t is None or 1 <= n <= 1 + len(t.tokens) for n, t in zip(num_positions, trees))
        return self._pass(seq_ids, contexts, num_positions, greedy=False, trees=trees)

    @torch.inference_mode()
    def _pass(self, seq_ids, contexts, num_positions, greedy: bool, trees=None) -> list[torch.Tensor]:
        """One forward pass: logits rows, or (``greedy``) their argmax ids. An emulated stage then waits out the
        rest of its modelled pass, with its result (ids, or bf16 rows) sent over the device's link."""
        started = time.perf_counter()
        rows: list[Row] = []  # what the pass fed, per sequence (for the emulated device's roofline)
        if self.lean is None:
            assert trees is None, "tree scoring needs the lean forward"
            out = [self._score_transformers(s, c, n, rows) for s, c, n in zip(seq_ids, contexts, num_positions)]
            out = [self._finish(logits, greedy) for logits in out]
        else:  # one [positions, vocab] tensor for the whole batch, cut per sequence once it is finished
            logits, spans = self._score_lean(seq_ids, contexts, num_positions, rows, trees)
            logits = self._finish(logits, greedy)
            out = [logits[start : start + n] for start, n in spans]
        if self.emulation is not None:
            positions = sum(num_positions)
            self.emulation.wait_out(started, rows, positions * (8 if greedy else 2 * self.emulation.shape.vocab))
        return out

    def draft(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
        eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None],
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        return draft_tokens(self, seq_ids, contexts, depths, eos_token_ids, sampling)

    def draft_tree(
        self, seq_ids: Sequence[int], contexts: Sequence[Sequence[int]], depths: Sequence[int],
        eos_token_ids: Sequence[int], sampling: Sequence[DraftSampling | None], siblings: int,
    ) -> list[Draft]:
        """:meth:`draft`'s drafts grown into trees of up to ``siblings`` branch nodes per draft token
        (:func:`cascade.stages.draft.draft_tree`)."""
        return draft_tree(self, seq_ids, contexts, depths, eos_token_ids, sampling, siblings)

    def _sequence(self, seq_id: int, context: Sequence[int], num_positions: int) -> tuple[_Sequence, int]:
        """The sequence's cache entry and how many of its cached tokens to keep: the common prefix with
        ``context``, but never the positions whose logits are asked for (they are recomputed)."""
        assert 0 <= num_positions <= len(context), (num_positions, len(context))
        if len(context) > self.max_context:
            raise ValueError(
                f"stage {self.name!r}: context of {len(context)} tokens exceeds the model's {self.max_context}"
            )
        seq = self._sequences.get(seq_id)
        if seq is None:
            seq = self._new_sequence(seq_id, context)
        if seq.tree is not None:
            self._keep_tree_path(seq, context)
        return seq, tokens_to_keep(seq.tokens, context, num_positions)

    def _keep_tree_path(self, seq: _Sequence, context: Sequence[int]) -> None:
        """After a tree pass: the deepest node whose root path ``context`` continues with, its path's keys and values
        moved from where the nodes were stored to where the path's tokens sit in ``context``."""
        (base, flat), seq.tree = seq.tree, None
        if len(context) <= base or common_prefix_length(seq.tokens, context) < base:
            return
        on_path = {ROOT: True}
        deepest = ROOT
        for node, (token, parent, depth) in enumerate(zip(flat.tokens, flat.parents, flat.depths)):
            on_path[node] = on_path.get(parent, False) and base + depth < len(context) and context[base + depth] == token
            if on_path[node] and (deepest == ROOT or depth > flat.depths[deepest]):
                deepest = node
        path = []
        while deepest != ROOT:
            path.append(deepest)
            deepest = flat.parents[deepest]
        path.reverse()
        if len(path) <= common_prefix_length(seq.tokens[base:], context[base:]):
            return  # the path is the stored spine's (or no longer): nothing to move
        moves = [(base + node, base + depth) for depth, node in enumerate(path) if node != depth]
        self._slots.move(seq.slot, [m[0] for m in moves], [m[1] for m in moves])
        seq.tokens = list(context[: base + len(path)])

    def _new_sequence(self, seq_id: int, context: Sequence[int]) -> _Sequence:
        """A cache entry for a sequence first seen with ``context``: in the retired slot that holds the longest
        prefix of it (``reuse_prefixes``), else in a fresh one."""
        seq = self._sequences[seq_id] = _Sequence()
        if self._slots is None:
            seq.cache = DynamicCache(config=self.model.config)
            return seq
        best, shared = None, 0
        for slot, tokens in self._slots.retired(context) if self.reuse_prefixes else ():
            length = common_prefix_length(tokens, context)
            if length > shared:
                best, shared = slot, length
        if best is None:
            seq.slot = self._slots.allocate()
        else:
            seq.slot, seq.tokens = self._slots.claim(best)
            self.reused_tokens += shared
        return seq

    def adopt(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Start caching a new sequence whose context begins with ``prompt``; returns how many of its tokens are
        cached already (a retired slot's prefix, ``reuse_prefixes``), which no forward pass need compute."""
        if seq_id in self._sequences:
            raise ValueError(f"stage {self.name!r}: sequence {seq_id} is cached already")
        return min(common_prefix_length(self._new_sequence(seq_id, prompt).tokens, prompt), len(prompt))

    def _score_lean(
        self, seq_ids, contexts, num_positions, fed_rows: list[Row], trees=None,
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The batch's logits as one ``[positions, vocab]`` tensor, and where each sequence's ``num_positions`` rows
        start in it."""
        spans: list[tuple[int, int]] = [(0, 0)] * len(seq_ids)
        trees = trees or [None] * len(seq_ids)
        work = []  # (slot, b, new tokens, positions, tree nodes), ordered by slot so the batch's slots are mostly
        # consecutive
        fed: list[tuple[_Sequence, Sequence[int], Flat | None]] = []
        for b, (seq_id, context, n, tree) in enumerate(zip(seq_ids, contexts, num_positions, trees)):
            grown = self._grown_nodes(seq_id, context, tree, n)
            if grown:  # the tree's first nodes are cached right after the context, which is cached whole
                seq, keep = self._sequences[seq_id], len(context) + grown
                seq.tree = None
            else:
                seq, keep = self._sequence(seq_id, context, 1 if tree is not None else n)
            self._slots.lengths[seq.slot] = keep  # a rejection is repaired here: the cache forgets what differs
            # Until the pass is done only the kept positions are known to hold the context: a pass that fails
            # part-way must not leave a slot that a later sequence takes over (reuse_prefixes) with the rest.
            seq.tokens = list(context[: min(keep, len(context))])
            fed.append((seq, context, tree))
            new = list(context[keep:])
            nodes = None
            if tree is not None and tree.tokens:
                new += tree.tokens[grown:]
                nodes = TreeNodes(tree.parents, tree.depths, grown)
            work.append((seq.slot, b, new, n, nodes))
            fed_rows.append(Row(len(new), keep, n))
            self.new_tokens += len(new)
        work.sort(key=lambda w: w[:2])
        tree_nodes = {"trees": [w[4] for w in work]} if any(trees) else {}
        logits = self.lean.forward(self._slots, [w[0] for w in work], [w[2] for w in work], [w[3] for w in work],
                                   **tree_nodes)
        for seq, context, tree in fed:
            seq.tokens = list(context)
            if tree is not None and tree.tokens:  # the spine is stored right after the context, as a chain's draft
                seq.tokens += tree.tokens[: spine_length(tree)]
                seq.tree = (len(context), tree)
        start = 0
        for _, b, _, n, _ in work:
            spans[b] = (start, n)
            start += n
        return logits, spans

    def _grown_nodes(self, seq_id: int, context: Sequence[int], tree: Flat | None, num_positions: int) -> int:
        """How many of ``tree``'s first nodes are cached right after ``context`` (cached whole) and need no rows:
        the nodes the last tree pass over this context stored, as far as this tree repeats them."""
        seq = self._sequences.get(seq_id)
        if tree is None or seq is None or seq.tree is None or seq.tree[0] != len(context):
            return 0
        if num_positions > len(tree.tokens) or common_prefix_length(seq.tokens, context) < len(context):
            return 0
        stored = seq.tree[1]
        same = common_prefix_length(list(zip(stored.tokens, stored.parents)), list(zip(tree.tokens, tree.parents)))
        return min(same, len(tree.tokens) - num_positions)

    def _score_transformers(
        self, seq_id: int, context: Sequence[int], num_positions: int, fed_rows: list[Row]
    ) -> torch.Tensor:
        seq, keep = self._sequence(seq_id, context, num_positions)
        if keep < len(seq.tokens):
            seq.cache.crop(keep - len(seq.tokens))  # a negative count drops that many tokens from the end
        new = torch.tensor([context[keep:]], dtype=torch.long, device=self.device)  # [1, new_tokens]
        self.new_tokens += new.shape[1]
        fed_rows.append(Row(new.shape[1], keep, num_positions))
        logits = self.model(input_ids=new, cache=seq.cache, use_cache=True, logits_to_keep=max(num_positions, 1)).logits[0]
        seq.tokens = list(context)
        return logits[logits.shape[0] - num_positions :]  # [num_positions, vocab]

    def _finish(self, logits: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Logits fitted to the target's vocabulary, or (``greedy``) each row's argmax id — ``BROKEN_ROW`` where the
        row is not finite (its max is NaN or ±inf): one reduction, no sync."""
        logits = self._fit_vocab(logits)
        return _argmax_or_broken(logits) if greedy else logits

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad (with -inf) or cut logits to the target's vocabulary width; padded vocabularies differ by model."""
        width = logits.shape[-1]
        if width == self.vocab_size:
            return logits
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))

    def release(self, seq_id: int) -> None:
        seq = self._sequences.pop(seq_id, None)
        if seq is not None and self._slots is not None:
            if self.reuse_prefixes:
                self._slots.retire(seq.slot, seq.tokens)
            else:
                self._slots.free(seq.slot)

    @property
    def cost_prior(self):
        """c(t) from the stage's roofline (emulated or ``profile``), the controller's costs before it measures; None
        without one."""
        return self.profile.prior if self.profile is not None else None

    def emulation_report(self) -> dict | None:
        """The emulated device's passes and real-compute share (None: the stage runs as it is)."""
        return self.emulation.report() if self.emulation is not None else None

    def kv_cache_bytes(self) -> int:
        """Memory held by this stage's KV cache (the lean forward's slots; 0 for transformers' caches)."""
        return self._slots.nbytes if self._slots is not None else 0

    def num_cached_sequences(self) -> int:
        return len(self._sequences)

    def cached_tokens(self, seq_id: int) -> int:
        seq = self._sequences.get(seq_id)
        return len(seq.tokens) if seq else 0
