"""A model-free drafter that learns across requests: the context's tail is looked up in the request itself and in
the prompts and outputs of earlier requests, and what followed it there is proposed.

The n-gram drafter (:mod:`cascade.stages.ngram`) only sees its own request. Much of what a server is asked repeats
*across* requests — the same document or code file asked about again, an agent re-emitting the code it is editing,
answers quoting a shared context — and suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Snowflake reports
2.8–4× on agentic and SWE-bench workloads) drafts from an index over earlier outputs. This stage keeps such an index
per *scope*: a bounded store of finished requests' tokens, with every position keyed by the ``key_length`` tokens
before it.

A lookup gathers the occurrences of the context's last ``key_length`` tokens in the request's own context and in the
index, keeps those whose match extends furthest back (up to ``max_match`` tokens: a longer shared history predicts
better), and proposes token by token what most of them continue with, narrowing to the occurrences that agree
(the n-gram drafter's consensus rule). Occurrences in the request's own context count as the earlier requests' do.

Memory: at most ``max_tokens`` tokens are kept per scope; past that the oldest requests are evicted, each taking its
own index entries with it, and at most ``max_scopes`` scopes are kept, the least recently used dropped. Held in the
process, gone with the server.

Isolation: a draft changes how long a request takes, never its text (the target verifies every token), but timing
can tell one client that another sent similar text. So requests only draw on the index of their own scope: the
OpenAI ``user`` field when a request gives one (each end user their own index), else one index the server's clients
share — who can reach the server shares it, as they share its KV-cache prefix reuse.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from cascade.stages.ngram import consensus_tree, tail_follows
from cascade.verify.tree import Branch

_SEPARATOR = -1  # between two requests' tokens in the store: no continuation runs across it
_MAX_OCCURRENCES = 32  # occurrences of a key kept (the latest): more changed few drafts, and cost time
_SHARED = None  # the scope of requests that name no user
_BITS = 24  # bits per token in an index key (token ids below 16.7 million: any vocabulary)
_POSITION = 8  # bytes per position in the index


def _key(tail: Sequence[int]) -> int:
    """``tail``'s tokens packed in one int."""
    key = 0
    for token in tail:
        key = (key << _BITS) | token
    return key


def _keys(tokens: Sequence[int], n: int):
    """``(i, key)`` for every position i >= n of ``tokens``: the key of the n tokens before it, rolled along."""
    mask, key = (1 << (_BITS * n)) - 1, 0
    for i, token in enumerate(tokens[:-1]):
        key = ((key << _BITS) | token) & mask
        if i + 1 >= n:
            yield i + 1, key


class _Index:
    """The tokens of one scope's finished requests and, for every position, the key that precedes it. Positions are
    absolute (counted from the first token ever added), so evicting the oldest requests removes only their own
    entries: no step of the engine waits for the index to be rebuilt."""

    def __init__(self, key_length: int, max_tokens: int):
        self.key_length = key_length
        self.max_tokens = max_tokens
        self.tokens = array("i")  # every kept request's tokens, each followed by _SEPARATOR
        self.base = 0  # the absolute position of tokens[0] (what was evicted before it)
        self.keys: dict[int, bytes] = {}  # key (its tokens packed in one int, _key) -> absolute positions right after
        # its occurrences (int64 bytes), oldest first, the latest _MAX_OCCURRENCES. Ints and bytes, not tuples and
        # lists: what the index keeps is nothing the garbage collector tracks, so it does not bring on its full
        # collections (0.1 s each in a process with torch loaded, every few requests learned with a list per key)
        self.requests: deque[int] = deque()  # each kept request's length (with its separator), oldest first

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.max_tokens + 1 :] if len(tokens) >= self.max_tokens else list(tokens)
        while self.requests and len(self.tokens) + len(tokens) + 1 > self.max_tokens:
            self._evict_oldest()
        offset = self.base + len(self.tokens)
        for i, key in _keys(tokens, self.key_length):
            positions = self.keys.get(key, b"") + (offset + i).to_bytes(_POSITION, "little")
            self.keys[key] = positions[_POSITION:] if len(positions) > _MAX_OCCURRENCES * _POSITION else positions
        self.tokens.extend(tokens)
        self.tokens.append(_SEPARATOR)
        self.requests.append(len(tokens) + 1)

    def _evict_oldest(self) -> None:
        """Forget the oldest request: its keys' entries (each the oldest of its list, if still there), then its
        tokens."""
        length = self.requests.popleft()
        for i, key in _keys(self.tokens[: length - 1], self.key_length):
            positions = self.keys.get(key)
            if positions and int.from_bytes(positions[:_POSITION], "little") == self.base + i:
                if len(positions) > _POSITION:
                    self.keys[key] = positions[_POSITION:]
                else:
                    del self.keys[key]
        del self.tokens[:length]
        self.base += length

    def occurrences(self, tail: Sequence[int]) -> list[int]:
        """Where the tokens after the kept occurrences of ``tail`` (``key_length`` tokens) are, as indices of
        ``tokens``."""
        positions = self.keys.get(_key(tail), b"")
        return [int.from_bytes(positions[j : j + _POSITION], "little") - self.base
                for j in range(0, len(positions), _POSITION)]


class SuffixDrafter:
    """A model-free bottom stage drafting from the request itself and earlier requests of its scope (module
    docstring). ``key_length``: the tail that must match; ``max_match``: how far back a match is extended to rank
    occurrences; ``max_tokens``: the tokens kept per scope; ``max_scopes``: the scopes kept."""

    def __init__(self, name: str = "suffix", key_length: int = 3, max_match: int = 32, max_tokens: int = 1 << 18,
                 max_scopes: int = 64):
        if not 1 <= key_length <= max_match:
            raise ValueError(f"need 1 <= key_length <= max_match, got key_length={key_length}, max_match={max_match}")
        if max_tokens < 2 * key_length or max_scopes < 1:
            raise ValueError(f"max_tokens must be >= {2 * key_length} and max_scopes >= 1, got {max_tokens}, {max_scopes}")
        self.name = name
        self.key_length = key_length
        self.max_match = max_match
        self.max_tokens = max_tokens
        self.max_scopes = max_scopes
        self._scopes: OrderedDict[str | None, _Index] = OrderedDict()

    def learn(self, tokens: Sequence[int], scope: str | None = _SHARED) -> None:
        """Keep a finished request's tokens (prompt and output) for later requests of ``scope`` to draft from."""
        if len(tokens) <= self.key_length:
            return
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = _Index(self.key_length, self.max_tokens)
            if len(self._scopes) > self.max_scopes:
                self._scopes.popitem(last=False)
        self._scopes.move_to_end(scope)
        index.add(tokens)

    @property
    def kept_tokens(self) -> int:
        """Tokens held over every scope (at most ``max_tokens`` × ``max_scopes``)."""
        return sum(len(index.tokens) for index in self._scopes.values())

    def propose(self, contexts: Sequence[Sequence[int]], depths: Sequence[int],
                scopes: Sequence[str | None] | None = None) -> list[list[int]]:
        return [spine for spine, _ in self.propose_tree(contexts, depths, 0, scopes)]

    def propose_tree(self, contexts: Sequence[Sequence[int]], depths: Sequence[int], branches: int,
                     scopes: Sequence[str | None] | None = None) -> list[tuple[list[int], list[Branch]]]:
        """:meth:`propose`'s drafts with up to ``branches`` other continuations each, where the occurrences split, as
        draft-tree branches (:func:`~cascade.stages.ngram.consensus_tree`)."""
        scopes = scopes if scopes is not None else [_SHARED] * len(contexts)
        return [self._propose_one(list(ctx), k, scope, branches) for ctx, k, scope in zip(contexts, depths, scopes)]

    def _propose_one(self, ctx: list[int], depth: int, scope: str | None, branches: int
                     ) -> tuple[list[int], list[Branch]]:
        n = self.key_length
        if depth <= 0 or len(ctx) < n:
            return [], []
        index = self._scopes.get(scope)
        own = tail_follows(ctx, n)  # positions in ctx after earlier occurrences of its tail
        stored = index.occurrences(ctx[-n:]) if index is not None else []
        if not own and not stored:
            return [], []
        # Each occurrence as (how far back it matches, where its continuation is): own-context ones as negative
        # positions -1 - i, so one list holds both sources; earlier requests' first, the request's own last (the
        # latest: among equal votes the consensus takes the latest, the request's own).
        ranked = [(self._match(ctx, index.tokens, i), i) for i in stored]
        ranked += [(self._match(ctx, ctx, i), -1 - i) for i in own]
        best = max(m for m, _ in ranked)
        follows = [where for m, where in ranked if m == best]
        stored_tokens = index.tokens if index is not None else array("i")

        def token(where: int) -> int | None:  # the token at an occurrence's place; None past its request's end
            if where < 0:
                return ctx[-1 - where] if -1 - where < len(ctx) else None
            return stored_tokens[where] if where < len(stored_tokens) and stored_tokens[where] != _SEPARATOR else None

        # latest first: among equal votes the latest occurrence's token, the request's own before earlier requests'
        return consensus_tree(token, lambda where: where - 1 if where < 0 else where + 1, follows[::-1], depth, branches)

    def _match(self, ctx: list[int], source, i: int) -> int:
        """How many tokens before position ``i`` of ``source`` equal the context's last ones (at most max_match)."""
        m, limit = 0, min(self.max_match, i, len(ctx))
        while m < limit and source[i - 1 - m] == ctx[-1 - m]:
            m += 1
        return m
