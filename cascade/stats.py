"""Per-request statistics, per stage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol


@dataclass(slots=True)
class StageStats:
    """What one stage did for one request.

    As a drafter (every stage but the target): ``drafted`` tokens proposed to the stage above, of which
    ``accepted`` were accepted; ``accepted_by_position[j]`` counts drafts whose position j (0-based) was accepted.
    As a verifier (every model stage but the bottom one): ``rounds`` verified. As a model: ``forward_passes``
    and ``forward_seconds``.
    """

    name: str
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0  # non-empty drafts proposed (one per round of the stage above that had one)
    accepted_by_position: list[int] = field(default_factory=list)
    rounds: int = 0
    forward_passes: int = 0
    forward_seconds: float = 0.0
    depths: dict[int, int] = field(default_factory=dict)  # depth chosen for this stage -> top-level rounds
    branch_tokens: int = 0  # draft trees: tokens proposed on branches beside the drafts (cascade.verify.tree)
    branch_accepted: int = 0  # and tokens accepted on a branch (after the ``accepted`` of its draft's chain)
    branch_ranks: dict[int, int] = field(default_factory=dict)  # rank of the sibling a tree's path took -> drafts

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted(self) -> float | None:
        """Mean accepted tokens per draft."""
        return self.accepted / self.drafts if self.drafts else None

    def record_draft(self, drafted: int, accepted: int, branch_tokens: int = 0, branch_accepted: int = 0,
                     branch_rank: int = 0) -> None:
        self.branch_tokens += branch_tokens
        self.branch_accepted += branch_accepted
        if branch_rank:
            self.branch_ranks[branch_rank] = self.branch_ranks.get(branch_rank, 0) + 1
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        if len(self.accepted_by_position) < drafted:
            self.accepted_by_position.extend([0] * (drafted - len(self.accepted_by_position)))
        for j in range(accepted):
            self.accepted_by_position[j] += 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted"] = self.mean_accepted
        d["forward_seconds"] = round(self.forward_seconds, 6)
        return d


@dataclass(slots=True)
class RequestStats:
    stages: list[StageStats]  # bottom first; the last is the target
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    chains: dict[str, int] = field(default_factory=dict)  # active chain ("ngram+small+target") -> top-level rounds
    topology_changes: int = 0  # top-level rounds whose chain differed from the previous round's
    verifier: str | None = None  # the verification implementation used: reference, triton or native
    drafted_ahead: int = 0  # pipelined mode: rounds whose next draft was drafted while the target verified
    kept_ahead: int = 0  # and of those, the drafts the next round started from
    kept_ahead_rejected: int = 0  # and of those, drafted for an outcome where the target rejected a draft token
    _last_chain: str | None = None

    def record_plan(self, chain: list[str], depths: tuple[int, ...]) -> bool:
        """The chain and depths chosen for one top-level round; True when the chain differs from the last round's."""
        key = "+".join(chain)
        self.chains[key] = self.chains.get(key, 0) + 1
        changed = self._last_chain is not None and key != self._last_chain
        self.topology_changes += changed
        self._last_chain = key
        for name, depth in zip(chain, depths):
            stats = self.stage(name)
            stats.depths[depth] = stats.depths.get(depth, 0) + 1
        return changed

    def stage(self, name: str) -> StageStats:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage named {name!r}; stages are {[s.name for s in self.stages]}")

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "seconds": round(self.seconds, 6),
            "chains": dict(self.chains),
            "topology_changes": self.topology_changes,
            "verifier": self.verifier,
            "drafted_ahead": self.drafted_ahead,
            "kept_ahead": self.kept_ahead,
            "kept_ahead_rejected": self.kept_ahead_rejected,
            "stages": {s.name: s.to_dict() for s in self.stages},
        }


class RoundObserver(Protocol):
    """Receives the engine's events as they happen (the server's Prometheus sink is one). Called from the thread
    that runs the engine; an implementation must be cheap and must not raise."""

    def on_plan(self, chain: Sequence[str], depths: Sequence[int], rounds: int, changed: int) -> None:
        """``rounds`` top-level rounds of a step are starting with these stages (bottom first) and the drafters'
        depths; ``changed`` of them: the request's previous round used a different chain. (One call per distinct
        plan of the step, not per request: a Prometheus increment costs about a microsecond, and at 64 requests
        the per-request calls cost 1-2% of a step.)"""

    def on_draft(self, stage: str, verifier: str, drafted: int, accepted: int, branch_tokens: int,
                 branch_accepted: int, branch_rank: int) -> None:
        """``stage`` proposed ``drafted`` tokens (at least one: an empty draft is not a draft) to ``verifier`` (the
        stage above it in the round's chain: the next stage, or one further up where the chain bypassed those
        between), which accepted the first ``accepted``; a draft tree (``cascade.verify.tree``) proposed ``branch_tokens`` more
        on its branches, and ``branch_accepted`` of them were accepted after those, on the sibling of rank
        ``branch_rank`` where the path left the spine (0, 0 and 0 for a chain, or a path along the spine)."""

    def on_forward(self, stage: str, num_positions: int, seconds: float) -> None:
        """One (batched) forward pass of a model stage over ``num_positions`` new positions of all its sequences
        together, or one lookup of the n-gram drafter, took ``seconds``."""

    def on_step(self, batch: int, tokens: int) -> None:
        """An engine step ran one round for each of ``batch`` requests, whose target verified ``tokens`` positions
        in all (``batch`` when nobody speculated)."""
