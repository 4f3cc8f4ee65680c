"""What a found n-gram continuation is worth to a step (cascade.controller.lookups): the rule against its cases."""

import dataclasses

import pytest

from cascade.controller.lookups import drafting_seconds, step_terms
from cascade.controller.model import Plan, expected_tokens

MAX_DEPTH = 8


def linear(fixed: float, per_token: float):
    return lambda t: fixed + per_token * t


def test_at_one_request_a_continuation_pays_exactly_when_it_beats_the_plans_rate():
    """At one request a continuation skips the plan's whole drafting, so with no margin G(d) > 0 is the rule
    R(lookup) > R(plan): E(α_L, d) / c(d + 1) against the plan's tokens over its round's seconds."""
    c = linear(2e-3, 1e-4)  # the target's pass
    alpha, k = 0.7, 3
    round_seconds = 1.5e-3 + c(k + 1)  # the plan's drafting, then the target's pass
    plan = Plan((1, 2), (k,), expected_tokens(alpha, k) / round_seconds)
    alone = Plan((2,), (), 1.0 / c(1))
    terms = step_terms(plan, alone, None, alpha, 1, k + 1, c, c, MAX_DEPTH, margin=0.0)
    assert drafting_seconds(plan, 1, alpha, c) == pytest.approx(1.5e-3)
    checked = 0
    for alpha_lookup in (0.05, 0.2, 0.4, 0.6, 0.8, 0.95):
        value = dataclasses.replace(terms, alpha=alpha_lookup)
        for d in range(1, MAX_DEPTH + 1):
            rate_lookup = expected_tokens(alpha_lookup, d) / c(d + 1)
            if abs(rate_lookup - plan.throughput) < 1e-6 * plan.throughput:
                continue  # a tie either way is rounding
            assert (value.gain(d) > 0) == (rate_lookup > plan.throughput), (alpha_lookup, d)
            checked += 1
    assert checked > 40
    assert terms.threshold == 0.0  # the step verifies drafts anyway


def test_where_the_step_only_decodes_its_continuations_pay_once_for_verifying():
    """A plain step's continuations must together gain what verifying at all costs the step, (1 + m)·R·(c(T) − ĉ(T));
    each adds c(T − 1 + d + 1) − c(T) seconds and would otherwise commit one token."""
    verifying, decoding = linear(3e-3, 2e-4), linear(2.5e-3, 2e-4)  # a verifying pass costs a fixed 0.5 ms more
    batch = tokens = 64
    alone = Plan((2,), (), batch / decoding(batch))
    margin = 0.1
    terms = step_terms(alone, alone, None, 0.0, batch, tokens, verifying, decoding, MAX_DEPTH, margin)
    rate = alone.throughput * (1 + margin)
    assert terms.base == 1.0 and terms.rate == pytest.approx(rate)
    assert terms.threshold == pytest.approx(rate * 0.5e-3)
    assert terms.extra == pytest.approx(tuple(verifying(tokens + d) - verifying(tokens) for d in range(MAX_DEPTH + 1)))


def test_under_load_a_continuation_saves_only_its_share_of_the_drafting():
    """S = T_draft(B) − T_draft(B − 1): a batched drafter pass costs the step about as much with one request fewer,
    so under load a continuation is charged nearly all its extra target positions."""
    c = linear(4e-3, 1e-4)
    alpha, k, batch = 0.7, 2, 32

    def plan_at(b: int) -> Plan:  # drafting: a fixed 1 ms plus 10 us per request, then the target's pass
        return Plan((1, 2), (k,), b * expected_tokens(alpha, k) / (1e-3 + 1e-5 * b + c(b * (k + 1))))

    alone = Plan((2,), (), batch / c(batch))
    tokens = batch * (k + 1)
    terms = step_terms(plan_at(batch), alone, plan_at(batch - 1), alpha, batch, tokens, c, c, MAX_DEPTH, 0.0)
    saved = 1e-5  # the one request's share of the drafting
    others = tokens - (k + 1)
    for d in range(MAX_DEPTH + 1):
        assert terms.extra[d] == pytest.approx(c(others + d + 1) - c(tokens) - saved)
