"""Choosing depths and topology from live acceptance statistics and measured costs."""

from cascade.controller.adaptive import AdaptiveController, RequestAcceptance
from cascade.controller.costs import CostFit, StageCost
from cascade.controller.model import Plan, best_plan, candidate_chains, expected_tokens, plan_chain
from cascade.controller.params import ControllerParams
from cascade.controller.shared import GlobalStats
from cascade.controller.step import StepController, StepPlan, StepRecord

__all__ = [
    "AdaptiveController", "ControllerParams", "CostFit", "GlobalStats", "Plan", "RequestAcceptance", "StageCost",
    "StepController", "StepPlan", "StepRecord",
    "best_plan", "candidate_chains", "expected_tokens", "plan_chain",
]
