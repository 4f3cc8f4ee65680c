"""The KV cache of the lean forward (:class:`~cascade.stages.lean.LeanDecoder`): every sequence's keys and values in
one preallocated buffer per stage, a slot each, and the slots finished sequences leave for ones that begin alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cascade.allocator import zeros_on_huge_pages

INITIAL_CAPACITY = 256  # positions per slot before the first doubling
INITIAL_SLOTS = 4  # sequences before the first doubling, unless told how many to expect
RETIRED_KEY = 16  # a retired slot is found by its first tokens: a shorter shared prefix saves too little to look for


class SlotCache:
    """Keys and values of many sequences, one slot each, in one preallocated buffer per stage.

    ``buffer``: [layers, 2, slots, kv_heads, capacity, head_dim]. A sequence owns a slot for its lifetime and
    ``lengths[slot]`` positions of it are filled; a rejection crops it by lowering that length. ``slots`` are
    allocated up front (the engine's ``max_running``: admitting a request then copies nothing; growing the slots of
    a full cache copies all of it, a stall of a few hundred ms for a long-context cache on a CPU). Capacity grows by
    doubling as sequences lengthen, a copy each time a context longer than any before arrives, so memory follows
    use: at most ``max_running`` slots times the longest context admitted. A ``capacity`` given up front
    (``batching.reserved_context``) is held from the start, and the cache grows only past it.

    A released sequence's slot may be retired instead of freed (:meth:`retire`): its positions stay filled, to be
    claimed by a new sequence that starts with the same tokens (:meth:`retired`, :meth:`claim`), until a slot is
    needed and the slot retired longest ago is freed. Retired slots are slots no running sequence holds, so
    retiring takes no memory beyond the slots themselves.
    """

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        slots: int = INITIAL_SLOTS, capacity: int = 0,
    ):
        capacity = max(capacity, INITIAL_CAPACITY)
        # zeros, not empty: a masked-out key's value still meets a 0 weight, and 0·NaN = NaN; on huge pages, which a
        # decode step's streaming of every sequence's keys and values reads faster (cascade.allocator)
        self.buffer = zeros_on_huge_pages((num_layers, 2, slots, kv_heads, capacity, head_dim), dtype, device)
        self.lengths: list[int] = [0] * slots  # [slots]: positions filled
        self._free: list[int] = list(range(slots - 1, -1, -1))  # a stack: the lowest slot is taken first
        self._retired: dict[int, list[int]] = {}  # slot -> the tokens its positions hold; retired longest ago first
        self._by_key: dict[tuple[int, ...], list[int]] = {}  # a retired sequence's first RETIRED_KEY tokens -> slots

    @property
    def capacity(self) -> int:
        return self.buffer.shape[4]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def allocate(self) -> int:
        if not self._free and self._retired:
            self.free(self.claim(next(iter(self._retired)))[0])
        if not self._free:
            self._grow(2 * len(self.lengths), self.capacity)
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)  # keep handing out the lowest slots: the running batch stays contiguous

    def retire(self, slot: int, tokens: list[int]) -> None:
        """Keep ``slot``'s first ``len(tokens)`` positions, which hold ``tokens``, for a sequence that starts alike
        (one shorter than ``RETIRED_KEY`` is freed)."""
        if len(tokens) < RETIRED_KEY:
            self.free(slot)
            return
        self.lengths[slot] = len(tokens)
        self._retired[slot] = tokens
        self._by_key.setdefault(tuple(tokens[:RETIRED_KEY]), []).append(slot)

    def retired(self, tokens: Sequence[int]) -> list[tuple[int, list[int]]]:
        """The retired slots whose tokens start as ``tokens`` do (their first ``RETIRED_KEY``), with those tokens."""
        if len(tokens) < RETIRED_KEY:
            return []
        return [(slot, self._retired[slot]) for slot in self._by_key.get(tuple(tokens[:RETIRED_KEY]), ())]

    def claim(self, slot: int) -> tuple[int, list[int]]:
        """Take a retired slot back, its positions as they are; returns it and the tokens they hold."""
        tokens = self._retired.pop(slot)
        key = tuple(tokens[:RETIRED_KEY])
        self._by_key[key].remove(slot)
        if not self._by_key[key]:
            del self._by_key[key]
        return slot, tokens

    def move(self, slot: int, sources: list[int], destinations: list[int]) -> None:
        """Copy the keys and values at positions ``sources`` of ``slot`` to ``destinations`` (a draft tree's accepted
        path, moved to where a chain's would be: its keys keep the rotation of their depth, which is the position
        they move to)."""
        moved = self.buffer[:, :, slot, :, sources]  # [layers, 2, kv_heads, len(sources), head_dim] (a copy)
        self.buffer[:, :, slot, :, destinations] = moved

    @property
    def num_retired(self) -> int:
        return len(self._retired)

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
        self.buffer = zeros_on_huge_pages(shape, old.dtype, old.device)
        self.buffer[:, :, : old.shape[2], :, : old.shape[4]] = old
        self._free = list(range(slots - 1, len(self.lengths) - 1, -1)) + self._free
        self.lengths += [0] * (slots - len(self.lengths))
