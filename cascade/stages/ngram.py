"""Prompt-lookup drafting (Saxena 2023; ``prompt_lookup_num_tokens`` in transformers): no model at all.

The tail of the context is looked up earlier in the context, longest n-gram first, and the tokens that followed
its latest occurrence (or its earliest, as transformers' prompt lookup does) are proposed. Code and repeated text
make this surprisingly effective.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = 4  # bytes per token id in the search buffer


class NGramDrafter:
    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1, match: str = "latest"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if match not in ("latest", "earliest"):
            raise ValueError(f"match must be 'latest' or 'earliest', got {match!r}")
        self.name = name
        self.match = match
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
            follow = self._find(haystack, n, len(ctx))
            if follow is not None:
                return ctx[follow : follow + depth]
        return []

    def _find(self, haystack: bytes, n: int, length: int) -> int | None:
        """Index of the token after a token-aligned earlier occurrence of the last ``n`` tokens, or None.

        The occurrence must end before the last token, so that at least one token follows it.
        """
        needle = haystack[-n * _WIDTH :]
        lo, hi = 0, (length - 1) * _WIDTH
        while True:
            hit = haystack.rfind(needle, lo, hi) if self.match == "latest" else haystack.find(needle, lo, hi)
            if hit < 0:
                return None
            if hit % _WIDTH == 0:
                return hit // _WIDTH + n
            if self.match == "latest":  # misaligned: look further left, or further right
                hi = hit + len(needle) - 1
            else:
                lo = hit + 1
