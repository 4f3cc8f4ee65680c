"""Prompt-lookup drafting (Saxena 2023; ``prompt_lookup_num_tokens`` in transformers): no model at all.

The tail of the context is looked up earlier in the context, longest n-gram first, and the tokens that followed
its latest occurrence are proposed. Code and repeated text make this surprisingly effective.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = 4  # bytes per token id in the search buffer


class NGramDrafter:
    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, contexts: Sequence[Sequence[int]], depths: Sequence[int]) -> list[list[int]]:
        return [self._propose_one(list(ctx), k) for ctx, k in zip(contexts, depths)]

    def _propose_one(self, ctx: list[int], depth: int) -> list[int]:
        if depth <= 0 or len(ctx) < 2:
            return []
        # Token ids as fixed-width bytes, so the search is bytes.rfind (C speed); a hit must be token-aligned.
        haystack = array("i", ctx).tobytes()
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            needle = haystack[-n * _WIDTH :]
            # The match must end before the last token so that at least one token follows it.
            end = (len(ctx) - 1) * _WIDTH
            while True:
                hit = haystack.rfind(needle, 0, end)
                if hit < 0:
                    break
                if hit % _WIDTH == 0:
                    follow = hit // _WIDTH + n
                    return ctx[follow : follow + depth]
                end = hit + len(needle) - 1  # misaligned: look further left
        return []
