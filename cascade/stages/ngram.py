"""Prompt-lookup drafting (Saxena 2023; ``prompt_lookup_num_tokens`` in transformers): no model at all.

The tail of the context is looked up earlier in the context, longest n-gram first, and the tokens that followed
it are proposed: after its latest occurrence, after its earliest (as transformers' prompt lookup does), or — the
``consensus`` mode — token by token the continuation most of its occurrences agree on. Code and repeated text make
this surprisingly effective.

Why consensus: a short tail (``x = `` or ``):\n``) recurs many times with different continuations, and any one
occurrence is a poor guess. Following the majority, and narrowing the occurrences to those that agree with what
was proposed so far, drafts what this context usually does next. Along the demo target's own greedy decodes
(``cascade bench``'s default and mixed prompts, max_ngram 3, 12 tokens per draft) it makes a target round yield
3.62 and 3.55 tokens against 2.95 and 2.53 for the latest occurrence and 3.07 and 3.17 for the earliest.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from cascade.verify.tree import Branch

_WIDTH = 4  # bytes per token id in the search buffer
_MAX_OCCURRENCES = 32  # occurrences that vote (the latest ones); more changed no draft along the demo's decodes
MATCH_MODES = ("latest", "earliest", "consensus")


class NGramDrafter:
    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1, match: str = "latest"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if match not in MATCH_MODES:
            raise ValueError(f"match must be one of {', '.join(MATCH_MODES)}, got {match!r}")
        self.name = name
        self.match = match
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, contexts: Sequence[Sequence[int]], depths: Sequence[int]) -> list[list[int]]:
        return [self._propose_one(list(ctx), k)[0] for ctx, k in zip(contexts, depths)]

    def propose_tree(self, contexts: Sequence[Sequence[int]], depths: Sequence[int], branches: int
                     ) -> list[tuple[list[int], list[Branch]]]:
        """:meth:`propose`'s drafts with up to ``branches`` other continuations each, as draft-tree branches
        (``consensus`` only: where the occurrences split, :func:`consensus_tree`; the other modes follow one
        occurrence and propose chains)."""
        return [self._propose_one(list(ctx), k, branches) for ctx, k in zip(contexts, depths)]

    def _propose_one(self, ctx: list[int], depth: int, branches: int = 0) -> tuple[list[int], list[Branch]]:
        if depth <= 0 or len(ctx) < 2:
            return [], []
        # Token ids as fixed-width bytes, so the search is bytes.rfind (C speed); a hit must be token-aligned.
        haystack = array("i", ctx).tobytes()
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            if self.match == "consensus":
                follows = self._find_all(haystack, n, len(ctx))
                if follows:
                    return _consensus(ctx, follows, depth, branches)
                continue
            follow = self._find(haystack, n, len(ctx))
            if follow is not None:
                return ctx[follow : follow + depth], []
        return [], []

    @staticmethod
    def _find_all(haystack: bytes, n: int, length: int) -> list[int]:
        """Indices of the tokens after the latest ``_MAX_OCCURRENCES`` token-aligned earlier occurrences of the
        last ``n`` tokens, earliest first."""
        needle = haystack[-n * _WIDTH :]
        hi = (length - 1) * _WIDTH
        follows: list[int] = []
        while len(follows) < _MAX_OCCURRENCES:
            hit = haystack.rfind(needle, 0, hi)
            if hit < 0:
                break
            if hit % _WIDTH == 0:
                follows.append(hit // _WIDTH + n)
            hi = hit + len(needle) - 1  # the next search ends before this hit's end: overlapping hits are found
        follows.reverse()
        return follows

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


def tail_follows(ctx: Sequence[int], n: int) -> list[int]:
    """Indices of the tokens after the latest ``_MAX_OCCURRENCES`` earlier occurrences of ``ctx``'s last ``n`` tokens,
    earliest first (the suffix drafter's own-context lookup)."""
    if len(ctx) <= n:
        return []
    return NGramDrafter._find_all(array("i", ctx).tobytes(), n, len(ctx))


def _consensus(ctx: list[int], follows: list[int], depth: int, branches: int = 0) -> tuple[list[int], list[Branch]]:
    """Up to ``depth`` tokens: each the one most of the surviving occurrences continue with (ties go to the earliest
    occurrence); an occurrence survives while its continuation equals what was proposed. With ``branches``, also the
    alternatives (:func:`consensus_tree`)."""
    return consensus_tree(lambda i: ctx[i] if i < len(ctx) else None, lambda i: i + 1, follows, depth, branches)


def consensus_tree(
    token: Callable[[int], int | None], advance: Callable[[int], int], follows: list[int], depth: int, branches: int = 0,
) -> tuple[list[int], list[Branch]]:
    """The consensus continuation of the occurrences ``follows`` (each a place whose ``token`` is the next one, None
    past the end; ``advance`` moves a place one token on): up to ``depth`` tokens, each what most surviving
    occurrences continue with (ties: the first in ``follows``' order), an occurrence surviving while it agrees. And up
    to ``branches`` alternatives, as draft-tree branches (:mod:`cascade.verify.tree`): where the occurrences split, the
    token most of the others took, continued by their own consensus — the ones with the most occurrences first.
    Deterministic candidates: the verifier tests each against its own distribution (one-hot proposals)."""
    spine: list[int] = []
    splits: list[tuple[int, int, int, list[int]]] = []  # (occurrences, position, token, its occurrences)
    while len(spine) < depth:
        groups: dict[int, list[int]] = {}
        for place in follows:
            t = token(place)
            if t is not None:
                groups.setdefault(t, []).append(place)
        if not groups:
            break
        chosen = max(groups, key=lambda t: len(groups[t]))
        if branches:
            splits += [(len(g), len(spine), t, g) for t, g in groups.items() if t != chosen]
        spine.append(chosen)
        follows = [advance(place) for place in groups[chosen]]
    tree = []
    for _, at, first, group in sorted(splits, key=lambda split: -split[0])[:branches]:
        rest, _ = consensus_tree(token, advance, [advance(place) for place in group], depth - at - 1)
        tree.append(Branch(at, (first, *rest)))
    return spine, tree
