"""Prometheus metrics for a served cascade.

Names follow Prometheus conventions (``cascade_`` prefix, base units, counters ending in ``_total``) and mirror
vLLM's where vLLM has a counterpart (``vllm:spec_decode_num_drafts`` → ``cascade_spec_decode_num_drafts_total``).
Per-stage series carry a ``stage`` label; for the draft series it names the stage that *drafted* (the one
whose tokens were accepted or not by the stage above it).

Only counters and histograms are exported for ratios; compute them in PromQL::

    # acceptance rate of each drafting stage
    sum by (stage) (rate(cascade_spec_decode_num_accepted_tokens_total[$__rate_interval]))
      / clamp_min(sum by (stage) (rate(cascade_spec_decode_num_draft_tokens_total[$__rate_interval])), 1e-9)

    # mean accepted tokens per draft (add 1 for the tokens per round of the stage above, recovered or bonus)
    sum by (stage) (rate(cascade_spec_decode_num_accepted_tokens_total[$__rate_interval]))
      / clamp_min(sum by (stage) (rate(cascade_spec_decode_num_drafts_total[$__rate_interval])), 1e-9)

    # acceptance by draft position: the fraction of drafts whose position j was accepted
    sum by (stage, position) (rate(cascade_spec_decode_num_accepted_tokens_per_pos_total[$__rate_interval]))
      / ignoring(position) group_left
        clamp_min(sum by (stage) (rate(cascade_spec_decode_num_drafts_total[$__rate_interval])), 1e-9)

    # mean depth the controller chose per stage
    sum by (stage) (rate(cascade_spec_decode_depth_sum[$__rate_interval]))
      / clamp_min(sum by (stage) (rate(cascade_spec_decode_depth_count[$__rate_interval])), 1e-9)

    # fraction of top-level rounds in which a stage was bypassed
    sum by (stage) (rate(cascade_stage_bypassed_rounds_total[$__rate_interval]))
      / on() group_left clamp_min(sum(rate(cascade_rounds_total[$__rate_interval])), 1e-9)

    # mean running batch, and mean positions the target verifies per request in a step (1 = no speculation)
    rate(cascade_batch_size_sum[$__rate_interval]) / clamp_min(rate(cascade_batch_size_count[$__rate_interval]), 1e-9)
    rate(cascade_step_tokens_sum[$__rate_interval]) / clamp_min(rate(cascade_batch_size_sum[$__rate_interval]), 1e-9)

    # share of prompt tokens the target found cached in a finished request's slot
    sum(rate(cascade_stage_reused_prefix_tokens_total{stage="target"}[$__rate_interval]))
      / clamp_min(sum(rate(cascade_prompt_tokens_total[$__rate_interval])), 1e-9)

    # p95 time to first token
    histogram_quantile(0.95, sum by (le) (rate(cascade_time_to_first_token_seconds_bucket[$__rate_interval])))
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Latency buckets from 1 ms to 2 minutes: CPU demo models sit at the low end, 70B targets at the high end.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 120)
_FORWARD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_DEPTH_BUCKETS = tuple(float(d) for d in range(0, 17))
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _stage_gauge(registry: CollectorRegistry, name: str, doc: str, readers: dict | None) -> None:
    """A per-stage gauge read when scraped: ``readers`` maps a stage name to a function returning its value."""
    if readers is None:
        return
    gauge = Gauge(name, doc, ["stage"], registry=registry)
    for stage, read in readers.items():
        gauge.labels(stage=stage).set_function(read)


class _StageCounter:
    """A per-stage counter that the stage keeps itself, read when scraped: ``readers`` maps a stage name to a
    function returning its running total."""

    def __init__(self, name: str, doc: str, readers: dict):
        self.name, self.doc, self.readers = name, doc, readers

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=["stage"])
        for stage, read in self.readers.items():
            family.add_metric([stage], read())
        yield family


class _EmulationCollector:
    """The emulated devices' running totals (``Cascade.emulation_report``), read when scraped: per stage, the emulated
    seconds of its passes and the wall seconds its real compute took; for the engine, the wall seconds of its steps
    and the host's share of them (unscaled). ``cascade bench --serve`` reads the real-compute share per stage and the
    host time from their increases over a level."""

    def __init__(self, report):
        self.report = report

    def collect(self):
        report = self.report()
        if not report:
            return
        emulated = CounterMetricFamily(
            "cascade_emulated_pass_seconds", "Emulated seconds of an emulated stage's passes (the roofline's).",
            labels=["stage"],
        )
        real = CounterMetricFamily(
            "cascade_emulated_real_compute_seconds",
            "Wall seconds the real model standing in for an emulated stage computed (its share of time_scale times "
            "the emulated seconds must stay small).", labels=["stage"],
        )
        for stage, r in report["stages"].items():
            emulated.add_metric([stage], r["emulated_seconds"])
            real.add_metric([stage], r["real_seconds"])
        yield emulated
        yield real
        yield CounterMetricFamily(
            "cascade_engine_step_wall_seconds", "Wall seconds of the engine's steps (unscaled).",
            value=report["step_wall_seconds"],
        )
        yield CounterMetricFamily(
            "cascade_engine_host_wall_seconds",
            "Wall seconds of the engine's steps spent outside emulated passes: the host's work (unscaled).",
            value=report["host_wall_seconds"],
        )
        yield GaugeMetricFamily(
            "cascade_emulation_time_scale", "Wall seconds per emulated second.", value=report["time_scale"]
        )


class Metrics:
    """All of a server's series in their own registry (several apps may live in one process, e.g. in tests).

    Implements :class:`cascade.stats.RoundObserver`, so the engine feeds the per-stage series directly.
    """

    def __init__(self, stage_names: Sequence[str], gauges=None, emulation=None):
        """``gauges``: per model stage, the functions that read its ``cached_sequences``, ``kv_cache_bytes`` and
        ``reused_tokens`` when scraped (``Cascade.cache_gauges``; None: those series are left out); ``emulation``
        reads the emulated devices' report (``Cascade.emulation_report``; empty or None: no emulated series)."""
        def series(kind: str) -> dict | None:
            return None if gauges is None else {name: own[kind] for name, own in gauges.items() if kind in own}

        cached_sequences, kv_cache_bytes, reused_tokens, kept_tokens = map(
            series, ("cached_sequences", "kv_cache_bytes", "reused_tokens", "kept_tokens"))
        self.registry = CollectorRegistry()
        if emulation is not None:
            self.registry.register(_EmulationCollector(emulation))
        self.stage_names = list(stage_names)
        self._declare_speculation(self.registry)
        self._declare_requests(self.registry)
        self._declare_engine(self.registry, cached_sequences, kv_cache_bytes, reused_tokens)
        _stage_gauge(
            self.registry, "cascade_stage_kept_tokens",
            "Tokens of earlier requests a drafter that learns across requests holds (type: suffix; at most max_tokens "
            "per scope, max_scopes scopes).", kept_tokens or None,
        )
        self._children: dict[tuple, object] = {}
        for name in self.stage_names:  # every per-stage series exists from the start, at zero
            self.bypassed.labels(stage=name)
            self.forward_seconds.labels(stage=name)
        for name in self.stage_names[:-1]:
            for series in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_tree_tokens,
                           self.num_tree_accepted):
                series.labels(stage=name)
            self.tree_branch_rank.labels(stage=name, rank="1")  # (the other ranks appear as they are taken)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(finished_reason=reason)

    def _declare_speculation(self, r: CollectorRegistry) -> None:
        """Drafts, acceptance, depths, bypassed stages and forward passes, per stage."""
        self.num_drafts = Counter(
            "cascade_spec_decode_num_drafts", "Non-empty drafts proposed by a stage to the stage above it.", ["stage"], registry=r
        )
        self.num_draft_tokens = Counter(
            "cascade_spec_decode_num_draft_tokens", "Draft tokens proposed by a stage.", ["stage"], registry=r
        )
        self.num_accepted_tokens = Counter(
            "cascade_spec_decode_num_accepted_tokens",
            "Draft tokens of a stage accepted by the stage above it.",
            ["stage"],
            registry=r,
        )
        # The same three per pair of stages: where the chain bypasses a stage, a drafter's tokens go to a verifier further
        # up, which accepts them at its own rate (cascade bench's planner reads each pair's).
        pair = ["stage", "verifier"]
        self.pair_drafts = Counter(
            "cascade_spec_decode_pair_drafts", "Non-empty drafts of a stage verified by `verifier`.", pair, registry=r
        )
        self.pair_draft_tokens = Counter(
            "cascade_spec_decode_pair_draft_tokens", "Draft tokens of a stage verified by `verifier`.", pair, registry=r
        )
        self.pair_accepted_tokens = Counter(
            "cascade_spec_decode_pair_accepted_tokens", "Draft tokens of a stage that `verifier` accepted.", pair,
            registry=r,
        )
        self.accepted_per_pos = Counter(
            "cascade_spec_decode_num_accepted_tokens_per_pos",
            "Drafts of a stage whose token at draft position `position` (0-based) was accepted.",
            ["stage", "position"],
            registry=r,
        )
        self.num_tree_tokens = Counter(
            "cascade_spec_decode_num_tree_tokens",
            "Tokens a stage proposed on the branches of draft trees, beside its drafts' tokens (siblings).",
            ["stage"],
            registry=r,
        )
        self.num_tree_accepted = Counter(
            "cascade_spec_decode_num_tree_accepted_tokens",
            "Tokens on the branches of a stage's draft trees that the stage above accepted (where it rejected the draft's "
            "own token there).",
            ["stage"],
            registry=r,
        )
        self.tree_branch_rank = Counter(
            "cascade_spec_decode_tree_branch_rank",
            "Draft trees of a stage whose accepted path left the spine, by the rank of the sibling it took (1: the first "
            "tested after the draft's own token).",
            ["stage", "rank"],
            registry=r,
        )
        self.depth = Histogram(
            "cascade_spec_decode_depth",
            "Depth chosen for a drafting stage, one observation per top-level round it takes part in.",
            ["stage"],
            buckets=_DEPTH_BUCKETS,
            registry=r,
        )
        self.rounds = Counter("cascade_rounds", "Top-level rounds (one forward pass of the target each).", registry=r)
        self.bypassed = Counter(
            "cascade_stage_bypassed_rounds",
            "Top-level rounds in which the controller left a stage out of the chain.",
            ["stage"],
            registry=r,
        )
        self.topology_changes = Counter(
            "cascade_topology_changes", "Top-level rounds whose chain differed from the same request's previous round.", registry=r
        )
        self.forward_seconds = Histogram(
            "cascade_stage_forward_seconds",
            "Time of one forward pass of a model stage (one lookup for the n-gram drafter).",
            ["stage"],
            buckets=_FORWARD_BUCKETS,
            registry=r,
        )

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """Latencies, queue, tokens and outcomes of requests, and the HTTP requests answered."""
        self.ttft = Histogram(
            "cascade_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "cascade_inter_token_latency_seconds",
            "Time per generated token after the first (a round's interval divided over its tokens).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "cascade_e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("cascade_num_requests_running", "Requests being generated.", registry=r)
        self.waiting = Gauge("cascade_num_requests_waiting", "Requests queued, not yet started.", registry=r)
        self.prompt_tokens = Counter("cascade_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            "cascade_generation_tokens", "Generated tokens of finished requests (as in `usage`).", registry=r
        )
        self.request_success = Counter(
            "cascade_request_success",
            "Requests that ended, by finished_reason (stop, length, abort).",
            ["finished_reason"],
            registry=r,
        )
        self.request_failures = Counter(
            "cascade_request_failures", "Requests that failed with an error inside the engine.", registry=r
        )
        self.http_requests = Counter(
            "cascade_http_requests", "HTTP requests answered, by route and status code.", ["route", "status"], registry=r
        )

    def _declare_engine(self, r: CollectorRegistry, cached_sequences, kv_cache_bytes, reused_tokens) -> None:
        """The running batch, the positions a step verifies, and each model stage's KV memory and cache use."""
        self.batch_size = Histogram(
            "cascade_batch_size",
            "Requests that ran a round together in one engine step (the running batch).",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "cascade_step_tokens",
            "Positions the target verified in one engine step, all requests together (the batch size when nobody "
            "speculated).",
            buckets=_STEP_TOKEN_BUCKETS,
            registry=r,
        )
        _stage_gauge(
            r, "cascade_stage_kv_cache_bytes",
            "Memory a model stage holds for KV caches (preallocated slots; bounded by batching.max_running).",
            kv_cache_bytes,
        )
        _stage_gauge(
            r, "cascade_stage_cached_sequences",
            "Sequences a model stage holds a KV cache for (should fall to zero when idle).", cached_sequences,
        )
        if reused_tokens is not None:
            r.register(_StageCounter(
                "cascade_stage_reused_prefix_tokens",
                "Context tokens a model stage found cached when it began a sequence, in the slot a finished one left "
                "(batching.reuse_prefixes): positions no forward pass computed.", reused_tokens,
            ))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ---- RoundObserver ------------------------------------------------------------------------------------

    def _series(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once: the engine thread reports every request's round, and a label
        lookup costs several times the increment."""
        key = (metric, labels)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = metric.labels(*labels)
        return series

    def on_plan(self, chain: Sequence[str], depths: Sequence[int], rounds: int, changed: int) -> None:
        self.rounds.inc(rounds)
        if changed:
            self.topology_changes.inc(changed)
        for name in self.stage_names:
            if name not in chain:
                self._series(self.bypassed, name).inc(rounds)
        for name, depth in zip(chain, depths):
            series = self._series(self.depth, name)
            for _ in range(rounds):  # (a histogram takes one observation at a time)
                series.observe(depth)

    def on_draft(self, stage: str, verifier: str, drafted: int, accepted: int, branch_tokens: int = 0,
                 branch_accepted: int = 0, branch_rank: int = 0) -> None:
        """A non-empty draft of ``stage`` was verified by ``verifier`` (the round counts only those:
        ``cascade.engine.rounds``)."""
        self._series(self.num_drafts, stage).inc()
        self._series(self.num_draft_tokens, stage).inc(drafted)
        self._series(self.num_accepted_tokens, stage).inc(accepted)
        self._series(self.pair_drafts, stage, verifier).inc()
        self._series(self.pair_draft_tokens, stage, verifier).inc(drafted)
        self._series(self.pair_accepted_tokens, stage, verifier).inc(accepted)
        if branch_tokens:
            self._series(self.num_tree_tokens, stage).inc(branch_tokens)
            self._series(self.num_tree_accepted, stage).inc(branch_accepted)
        if branch_rank:
            self._series(self.tree_branch_rank, stage, str(branch_rank)).inc()
        for j in range(accepted):
            self._series(self.accepted_per_pos, stage, str(j)).inc()

    def on_forward(self, stage: str, num_positions: int, seconds: float) -> None:
        self._series(self.forward_seconds, stage).observe(seconds)

    def on_step(self, batch: int, tokens: int) -> None:
        self.batch_size.observe(batch)
        self.step_tokens.observe(tokens)
