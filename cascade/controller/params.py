"""Every parameter and constant of the adaptive controller's rule, in one record: the formula's inputs
(``cascade.controller.model``), the plan's re-optimisation and exploration (``cascade.controller.adaptive``) and the
observed checks beside it (``cascade.controller.checks``). ``cascade.config.ControllerConfig`` exposes the tunable
ones, with these defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ControllerParams:
    max_depth: int = 8  # the largest depth considered for any stage
    warmup_rounds: int = 4  # steps of the engine on the configured plan before the first decision
    hysteresis: float = 0.05  # a new plan must be predicted this much faster to replace the current one
    speculation_margin: float = 0.1  # drafting (models or found continuations) must be predicted this much faster
    # than the target alone: the model's error where speculation is marginal, resolved on the safe side
    explore_every: int = 32  # one request's exploration round every this many steps (0 disables exploration)
    explore_depth: int = 4  # drafts at least this deep when exploring, to observe enough positions
    replan_every: int = 4  # re-optimise the plan every this many steps (the optimisation costs ~0.2 ms in Python;
    # one serves every request of the step)
    window: float = 64.0  # acceptance memory, in observed positions
    stale_rounds: float = 32.0  # and in rounds: an estimate not refreshed for this long loses most of its weight
    prior_weight: float = 8.0  # the global estimate counts as this many positions of a request's own
    unobserved_alpha: float = 0.5  # α assumed for a pair never observed
    rate_window: float = 32.0  # memory of the observed rates of the engine's steps, in steps
    pipelined: bool = False  # the engine drafts ahead while the target verifies (runtime.pipeline): the round time
    # of cascade.controller.model's T^pipe
    check_every: int = 16  # every this many steps, the whole step runs the mode (drafting or plain; found
    # continuations or none) the observed rates do not favour, so that both stay measured at the load (0: no checks)
    explore_budget: float = 0.01  # explorations and checks: at most this fraction of the engine's time, each
    # charged what its step measured beyond the other steps' rate (GlobalStats.observe_spending)
    # ---- the observed checks (cascade.controller.checks), named here so every constant of the rule is in one place
    check_steps: int = 3  # steps of one check of the mode (drafting, found continuations) the rates do not favour
    pipeline_check_steps: int = 2  # and of one check of drafting ahead (PipelineCheck): 1 + this many steps
    max_backoff: int = 3  # checks and explorations that change nothing stretch their interval to at most 2**this times
    nearby_buckets: int = 2  # a load where either kind of step is unobserved is judged by the nearest load within this
    # many buckets (half an octave of batch size) where both were
    check_renewal: float = 0.05  # at a check's start, the weight kept by what was observed before of the mode it runs
    observed_margin: float = 0.03  # a mode's steps must be observed this much faster than those without it: within it
    # the rates cannot tell (two identical target-alone engines taking turns read 4-5% apart), and a step with the mode
    # is longer, which every arriving prompt waits for (traced at 64 sampled clients: drafting at 1.02x the target
    # alone's rate, time to first token p50 235 ms against its 189 ms)
    budget_horizon_s: float = 5.0  # the exploration budget saves up at most this many seconds' worth
    tree_cost_margin: float = 0.05  # where steps with draft trees and without are unobserved at a load, trees run
    # first if their nodes add at most this share to each verifying stage's predicted pass (a memory-bound pass on a
    # GPU: nearly free), else chains; a tree's branches gained 20-40% tokens per round where measured
    # (docs/configuration.md, "Draft trees")
    rescue_evidence: float = 3.0  # a stage pair's trees are judged by the model (kept where it predicts them faster
    # than chains) once this many of its rejected tree drafts are on record; until then they run as the check says
