"""The expected-throughput model of a cascade (DESIGN.md, "Choosing depths"): pure functions, no state.

With i.i.d. acceptance ``α`` a round that drafts ``k`` tokens yields

    E(α, k) = (1 − α^{k+1}) / (1 − α)                    (Leviathan et al. 2023, eq. 1)

tokens. Costs are per stage, ``c_i(t) = a_i + b_i·t`` for a forward pass over ``t`` new tokens. Bottom-up over an
active chain ``s_0 → s_1 → … → s_m`` (``s_m`` the target):

    T_0(k) = ĉ_0(1)                 for the model-free drafter (one lookup gives all k tokens)
           = k · ĉ_0(1)             for a model drafter (k autoregressive forward passes)
    T_p(k) = k · min_d [T_{p−1}(d) + c_p(d + 1)] / E(α_p, d)      for 0 < p < m

and the target runs rounds at the depth ``k`` that maximises the throughput

    R(k) = E(α_m, k) / (T_{m−1}(k) + c_m(k + 1)).

``α_p`` is the acceptance of ``s_{p−1}``'s drafts by ``s_p``. Each stage has two cost curves: ``c_i`` for passes
that verify drafts and ``ĉ_i`` for passes that only decode (the bottom stage drafting, the target alone). A
verifying pass costs more than its extra tokens — the drafts' own attention call and the verification (rejection
sampling at a temperature) — so one curve through both would overcharge plain decoding and undercharge drafting.

Under load (continuous batching) a step runs every stage's forward pass once over all ``B`` requests of the
batch, so a pass over ``t`` new tokens per request costs ``c_i(B·t)``, with ``c_i`` fitted to the batch's token
count. Planning for a batch whose requests behave like the one being planned, the rate to maximise is

    R_B(k) = B · E(α_m, k) / (T^B_{m−1}(k) + c_m(B·(k + 1))),   T^B built as above from c^B_i(t) = c_i(B·t),

and the chain that is the target alone (``k = 0``: plain batched decoding, ``R_B = B / ĉ_m(B)``) is always a
candidate. Where the target's forward pass is bandwidth-bound, ``c_m(B·(k+1)) ≈ c_m(B)`` and drafting pays; as
``B`` grows the pass becomes compute-bound, ``c_m`` grows with its tokens, and the best depth falls to 0
(DESIGN.md, "The batched step"; SmartSpec's goodput rule is the same trade).

The model drafters also read every prompt once, a cost the target alone does not have (its own prefill is paid
either way): with ``P`` prompt tokens arriving per step (the target's prefill rate), a drafting step's first pass
of each model drafter ``s_i`` covers ``B + P`` positions, so the round time gains ``A = Σ_i [ĉ_i(B + P) − ĉ_i(B)]``
(added to the denominators of R and R_B). Demo family, 16 clients at T=0.8 with 170-token prompts and 64-token
completions: without A the small model at depth 2 was predicted 14% faster than the target alone and ran 5% slower;
A was ~1.6 ms of a 13 ms step.

Draft trees (:mod:`cascade.verify.tree`): a level whose drafter puts ``w`` branch nodes per draft token beside its
draft has its verifying pass cover ``d + 1 + w·d`` positions, and where the draft is rejected (probability
``1 − α^d``) a branch takes over with probability ``ρ`` — observed per stage pair over the tree rounds whose draft was
rejected — for one more token: ``E(α, d) + ρ·(1 − α^d)``. The branches' own later tokens are not counted (ρ's one
token is a floor), nor what growing a tree costs a bottom model beyond its chain's passes. Counted only while the
regime's steps run trees (``GlobalStats.treeing``); whether they do is the observed check's (``GlobalStats.trees``),
and on which stage pairs the model's: a pair whose tree makes its chain's predicted throughput no higher than a
chain at that level does is dropped (``AdaptiveController._judge_trees``).

Pipelined (``runtime.pipeline``, :mod:`cascade.engine.rounds`): while the target verifies a draft of depth ``k``, the
stages below draft ``k + 1`` tokens ahead on the draft's context; the next round starts from them, with no drafting
time of its own, when every draft is accepted and the first token ahead equals the target's bonus token, which
happens with probability ``α_m^{k+1}`` (the k acceptances, and the bonus guessed as often as a draft is accepted).
The drafting runs beside the target's pass, so a round takes

    T^pipe_m(k) = (1 − α_m^{k+1}) · T_{m−1}(k) + max(c_m(k + 1), T_{m−1}(k + 1))

in place of ``T_{m−1}(k) + c_m(k + 1)``: the drafting is hidden up to the target's time, and only a round whose draft
ahead was lost drafts while the target waits. (A model-free drafter directly under the target is not pipelined: its
lookup is already free.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Cost = Callable[[int], float]  # seconds for a forward pass over t new tokens


def expected_tokens(alpha: float, depth: int, rescue: float = 0.0) -> float:
    """E(α, k): expected tokens from one round with depth k (accepted drafts plus the recovered/bonus token); with a
    draft tree whose branches take over where the draft is rejected with probability ``rescue`` (ρ), one more token
    in each rejecting round: E(α, k) + ρ·(1 − α^k) (a branch's first token, then the verifier's after it)."""
    if depth <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(depth + 1)
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha) + rescue * (1.0 - alpha**depth)


@dataclass(frozen=True, slots=True)
class TreeTerms:
    """One level's draft trees, for the model: ``rescue`` ρ, how often a rejected draft's branches took over (as
    observed), and ``width``, the branch nodes per draft token the verifying stage scores beside it."""

    rescue: float = 0.0
    width: int = 0


CHAIN = TreeTerms()


@dataclass(frozen=True, slots=True)
class Plan:
    """A decision: the active chain (stage indices, bottom first, the target last) and each drafter's depth."""

    chain: tuple[int, ...]
    depths: tuple[int, ...]  # depths[p] is what chain[p] drafts per round; len(chain) - 1 entries
    throughput: float  # predicted tokens per second


def _best_level(
    lower_time: Callable[[int], float], alpha: float, cost: Cost, max_depth: int, tree: TreeTerms = CHAIN,
) -> tuple[int, float]:
    """The depth d that minimises the time per token of one level, and that time per token."""
    per_token = [(lower_time(d) + cost(d + 1 + tree.width * d)) / expected_tokens(alpha, d, tree.rescue)
                 for d in range(1, max_depth + 1)]
    best = min(range(max_depth), key=per_token.__getitem__)
    return best + 1, per_token[best]


def _table(cost: Cost, batch: int, size: int) -> list[float]:
    """``[0, c(B·1), …, c(B·size)]``; a cost that keeps its own tables (``CostFit``) answers from them."""
    own = getattr(cost, "table", None)
    if own is not None:
        return own(batch, size)
    return [0.0] + [cost(batch * t) for t in range(1, size + 1)]


def plan_chain(
    chain: Sequence[int],
    alphas: Sequence[float],
    costs: Sequence[Cost],
    model_free: Sequence[bool],
    max_depth: int,
    batch: int = 1,
    plain_costs: Sequence[Cost] | None = None,
    pipelined: bool = False,
    catch_up: float = 0.0,
    trees: Sequence[TreeTerms] | None = None,
) -> Plan:
    """Best depths for one chain, for a step of ``batch`` requests. ``alphas[p]`` is α between chain[p−1] and
    chain[p] (``alphas[0]`` unused); ``costs``/``model_free`` are indexed by stage (not by chain position).
    ``trees[p]``: chain[p−1]'s draft trees for chain[p] (default: chains), which yield E(α, d) + ρ·(1 − α^d) tokens
    a round for a verifying pass over d + 1 + width·d positions.

    ``costs`` are the curves of passes that verify drafts; ``plain_costs`` (default: the same) those of passes
    that only decode, which the bottom stage runs to draft and the target alone runs: a verifying pass costs more
    than its extra tokens (the drafts' attention and the verification itself). ``pipelined``: the round time
    T^pipe_m of the module docstring. ``catch_up``: P, the prompt tokens arriving per step, which each model
    drafter of the chain reads once (the term A of the module docstring)."""
    plain_costs = plain_costs if plain_costs is not None else costs
    # c^B_i(t) = c_i(B·t), tabulated for the token counts a plan can ask about (t = 1 .. max_depth + 1)
    if len(chain) == 1:
        target = chain[0]
        return Plan(tuple(chain), (), batch / _table(plain_costs[target], batch, 1)[1])
    trees = list(trees) if trees is not None else [CHAIN] * len(chain)
    bottom = chain[0]
    size = (max_depth + 1) * (1 + max(t.width for t in trees))  # the most positions a verifying pass can have
    tables = {i: _table(costs[i], batch, size) for i in chain[1:]}
    costs = {i: table.__getitem__ for i, table in tables.items()}
    unit = _table(plain_costs[bottom], batch, 1)[1]  # one plain pass of the bottom stage over the batch
    if model_free[bottom]:
        def time_of(k: int) -> float:
            return unit
    else:
        def time_of(k: int) -> float:
            return k * unit
    depths: list[int] = []
    for p in range(1, len(chain) - 1):
        d, per_token = _best_level(time_of, alphas[p], costs[chain[p]], max_depth, trees[p])
        depths.append(d)

        def time_of(k: int, per_token=per_token) -> float:
            return k * per_token

    target = chain[-1]
    alpha, top = alphas[-1], trees[-1]
    absorb = 0.0  # A: the model drafters reading the prompts that arrive
    if catch_up > 0:
        for i in chain[:-1]:
            if not model_free[i]:
                absorb += max(plain_costs[i](round(batch + catch_up)) - plain_costs[i](batch), 0.0)
    if pipelined and not (len(chain) == 2 and model_free[bottom]):
        def round_time(k: int) -> float:  # T^pipe_m(k): the drafting ahead hides behind the target's pass
            return (1.0 - alpha ** (k + 1)) * time_of(k) + max(costs[target](k + 1 + top.width * k), time_of(k + 1)) + absorb
    else:
        def round_time(k: int) -> float:
            return time_of(k) + costs[target](k + 1 + top.width * k) + absorb
    rates = [expected_tokens(alpha, k, top.rescue) / round_time(k) for k in range(1, max_depth + 1)]
    best = max(range(max_depth), key=rates.__getitem__) + 1
    throughput = batch * rates[best - 1]
    # depths[p] belongs to chain[p]: the lower levels' choices, then the top's
    return Plan(tuple(chain), tuple(depths) + (best,), throughput)


def candidate_chains(num_stages: int) -> list[tuple[int, ...]]:
    """Every chain that keeps the stages' order and ends at the target (stage num_stages − 1)."""
    target = num_stages - 1
    chains = []
    for mask in range(1 << target):
        chains.append(tuple(i for i in range(target) if mask >> i & 1) + (target,))
    return chains


def best_plan(
    pair_alpha: Callable[[int, int], float],
    costs: Sequence[Cost],
    model_free: Sequence[bool],
    max_depth: int,
    chains: Sequence[tuple[int, ...]] | None = None,
    batch: int = 1,
    plain_costs: Sequence[Cost] | None = None,
    pipelined: bool = False,
    catch_up: float = 0.0,
    pair_tree: Callable[[int, int], TreeTerms] | None = None,
) -> Plan:
    """The plan with the highest predicted throughput over ``chains`` (default: every chain) for a step of
    ``batch`` requests (``costs``, ``plain_costs``, ``pipelined``, ``catch_up``: as :func:`plan_chain`;
    ``pair_tree(i, j)``: stage i's draft trees for stage j, default chains)."""
    plans = []
    for chain in chains or candidate_chains(len(costs)):
        alphas = [0.0] + [pair_alpha(chain[p - 1], chain[p]) for p in range(1, len(chain))]
        trees = [CHAIN] + [pair_tree(chain[p - 1], chain[p]) for p in range(1, len(chain))] if pair_tree else None
        plans.append(plan_chain(chain, alphas, costs, model_free, max_depth, batch, plain_costs, pipelined, catch_up,
                                trees))
    return max(plans, key=lambda p: p.throughput)
