"""Writes the Grafana dashboards in this folder from one description, so that every panel uses the same selectors,
datasource variable and divide-by-zero guards, through Grafana's official typed builders (grafana-foundation-sdk,
a test dependency). Run it after changing a panel; a test checks the JSON is current.

    python dashboards/generate.py
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_model
from grafana_foundation_sdk.models import dashboard as dashboard_model

HERE = Path(__file__).resolve().parent
DS = dashboard_model.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job", instance=~"$instance"'
STAGE_SEL = SEL + ', stage=~"$stage"'
RI = "$__rate_interval"


def rate(metric: str, sel: str = SEL, by: str = "") -> str:
    grouping = f"sum by ({by}) " if by else "sum "
    return f"{grouping}(rate({metric}{{{sel}}}[{RI}]))"


def ratio(numerator: str, denominator: str, matching: str = "") -> str:
    """numerator / denominator with the denominator clamped away from zero (no NaN or Inf while idle);
    ``matching`` is a vector-matching clause such as ``ignoring(position) group_left``."""
    match = f" / {matching} " if matching else " / "
    return f"{numerator}{match}clamp_min({denominator}, 1e-9)"


def status_ratio(pattern: str) -> str:
    """Share of HTTP answers whose status matches ``pattern``; ``or vector(0)``: no such answers is 0, not no data."""
    matching = rate("cascade_http_requests_total", SEL + f', status=~"{pattern}"')
    return ratio(f"({matching} or vector(0))", rate("cascade_http_requests_total"))


def quantiles(metric: str, by: str = "le") -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{{{SEL}}}[{RI}])))", f"p{round(q * 100)}")
        for q in (0.5, 0.95, 0.99)
    ]


def stage_mean_and_quantile(metric: str, q: float) -> list[tuple[str, str]]:
    """Per stage: the mean of histogram ``metric`` and its ``q`` quantile."""
    return [
        (ratio(rate(f"{metric}_sum", STAGE_SEL, "stage"), rate(f"{metric}_count", STAGE_SEL, "stage")), "{{stage}} mean"),
        (f"histogram_quantile({q}, sum by (le, stage) (rate({metric}_bucket{{{STAGE_SEL}}}[{RI}])))",
         f"{{{{stage}}}} p{round(q * 100)}"),
    ]


class Board:
    """A dashboard built with Grafana's own typed builders (``grafana-foundation-sdk``), which are kept in step with
    Grafana's schema; every panel gets the datasource variable and a Prometheus query per target."""

    def __init__(self, uid: str, title: str, description: str, stage_variable: bool):
        self.uid = uid
        self._ids = 0  # panel ids, unique within the dashboard
        self.builder = (
            dashboard.Dashboard(title).uid(uid).description(description).tags(["cascade", "speculative-decoding"])
            .editable().tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR).time("now-1h", "now").refresh("10s")
            .timezone("")
        )
        self.builder.with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        self.builder.with_variable(label_variable("job", "label_values(cascade_rounds_total, job)", "Job"))
        self.builder.with_variable(
            label_variable("instance", 'label_values(cascade_rounds_total{job=~"$job"}, instance)', "Instance")
        )
        if stage_variable:
            self.builder.with_variable(
                label_variable("stage", f"label_values(cascade_stage_forward_seconds_count{{{SEL}}}, stage)", "Stage")
            )

    def row(self, title: str) -> None:
        self.builder.with_row(dashboard.Row(title).id(self._next_id()))

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def panel(self, title: str, description: str, targets: list[tuple[str, str]], *, unit: str = "short",
              width: int = 12, max_value: float | None = None) -> None:
        panel = (
            timeseries.Panel().id(self._next_id()).title(title).description(description).datasource(DS).unit(unit).height(8).span(width)
            .legend(common.VizLegendOptions().display_mode(common_model.LegendDisplayMode.LIST)
                    .placement(common_model.LegendPlacement.BOTTOM).show_legend(True))
            .tooltip(common.VizTooltipOptions().mode(common_model.TooltipDisplayMode.MULTI)
                     .sort(common_model.SortOrder.DESCENDING))
        )
        if max_value is not None:
            panel.min(0).max(max_value)
        for i, (expr, legend) in enumerate(targets):
            panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
                              .range().datasource(DS))
        self.builder.with_panel(panel)

    def to_json(self) -> dict:
        return json.loads(json.dumps(self.builder.build(), cls=JSONEncoder))


def label_variable(name: str, query: str, label: str) -> dashboard.QueryVariable:
    """A multi-value variable over a label's values, "All" by default."""
    return (
        dashboard.QueryVariable(name).label(label).datasource(DS)
        .query({"query": query, "refId": f"{name}-values", "qryType": 1})
        .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).multi(True)
        .all_value(".*").sort(dashboard_model.VariableSort.ALPHABETICAL_ASC)
        .current(dashboard_model.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def speculation() -> Board:
    b = Board("cascade-speculation", "Cascade: speculation by stage",
              "Acceptance, depths, topology and cost of each stage of the cascade (the `stage` of a draft series is "
              "the stage that drafted).", stage_variable=True)
    b.row("Acceptance")
    b.panel("Acceptance rate by stage", "Accepted draft tokens / drafted tokens, per drafting stage.",
            [(ratio(rate("cascade_spec_decode_num_accepted_tokens_total", STAGE_SEL, "stage"),
                    rate("cascade_spec_decode_num_draft_tokens_total", STAGE_SEL, "stage")), "{{stage}}")],
            unit="percentunit", max_value=1)
    b.panel("Acceptance by draft position", "Fraction of drafts whose token at position j was accepted.",
            [(ratio(rate("cascade_spec_decode_num_accepted_tokens_per_pos_total", STAGE_SEL, "stage, position"),
                    rate("cascade_spec_decode_num_drafts_total", STAGE_SEL, "stage"), "ignoring(position) group_left"),
              "{{stage}} position {{position}}")],
            unit="percentunit", max_value=1)
    b.panel("Mean accepted tokens per draft", "Accepted tokens per non-empty draft; the stage above yields one more.",
            [(ratio(rate("cascade_spec_decode_num_accepted_tokens_total", STAGE_SEL, "stage"),
                    rate("cascade_spec_decode_num_drafts_total", STAGE_SEL, "stage")), "{{stage}}")])
    b.panel("Drafted vs accepted tokens per second", "Draft tokens proposed and accepted, per drafting stage.",
            [(rate("cascade_spec_decode_num_draft_tokens_total", STAGE_SEL, "stage"), "{{stage}} drafted"),
             (rate("cascade_spec_decode_num_accepted_tokens_total", STAGE_SEL, "stage"), "{{stage}} accepted")],
            unit="ops")
    b.panel("Draft trees",
            "Branch tokens accepted per draft (tokens a tree adds to its chain's), and per branch token proposed (the "
            "share of siblings that pay for their positions), per drafting stage with trees on.",
            [(ratio(rate("cascade_spec_decode_num_tree_accepted_tokens_total", STAGE_SEL, "stage"),
                    rate("cascade_spec_decode_num_drafts_total", STAGE_SEL, "stage")), "{{stage}} per draft"),
             (ratio(rate("cascade_spec_decode_num_tree_accepted_tokens_total", STAGE_SEL, "stage"),
                    rate("cascade_spec_decode_num_tree_tokens_total", STAGE_SEL, "stage")), "{{stage}} per branch token")])
    b.panel("Draft trees: the sibling taken, by rank",
            "Share of a stage's drafts whose accepted path left the spine, by the rank of the sibling it took (1: the "
            "likeliest after the draft's own token): where the acceptance by rank falls off, wider trees stop paying.",
            [(ratio(rate("cascade_spec_decode_tree_branch_rank_total", STAGE_SEL, "stage, rank"),
                    rate("cascade_spec_decode_num_drafts_total", STAGE_SEL, "stage"), "ignoring(rank) group_left"),
              "{{stage}} rank {{rank}}")],
            unit="percentunit")
    b.row("Controller")
    b.panel("Chosen depth by stage", "Mean depth the controller chose per round for each drafting stage.",
            stage_mean_and_quantile("cascade_spec_decode_depth", 0.9))
    b.panel("Bypassed stages and topology changes",
            "Fraction of rounds in which the controller left a stage out; chain changes per second.",
            [(ratio(rate("cascade_stage_bypassed_rounds_total", STAGE_SEL, "stage"), rate("cascade_rounds_total"),
                    "on() group_left"), "{{stage}} bypassed"),
             (rate("cascade_topology_changes_total"), "topology changes / s")],
            unit="percentunit")
    b.row("Cost and throughput")
    b.panel("Forward time by stage", "Mean and p95 time of one forward pass of each stage.",
            stage_mean_and_quantile("cascade_stage_forward_seconds", 0.95), unit="s")
    b.panel("Generation tokens per second", "Tokens generated (counted when requests finish) and target rounds.",
            [(rate("cascade_generation_tokens_total"), "generated tokens / s"),
             (rate("cascade_rounds_total"), "target rounds / s"),
             (ratio(rate("cascade_generation_tokens_total"), rate("cascade_rounds_total")), "tokens per round")],
            unit="ops")
    b.row("Batching")
    b.panel("Running batch", "Requests that ran a round together in one engine step: mean, p50 and p95.",
            [(ratio(rate("cascade_batch_size_sum"), rate("cascade_batch_size_count")), "mean"),
             *[(expr, legend) for expr, legend in quantiles("cascade_batch_size") if legend != "p99"]])
    b.panel("Speculation under load",
            "Positions the target verifies per request per step (1: plain decoding, no speculation) next to the "
            "mean batch: the controller speculates less as the batch grows.",
            [(ratio(rate("cascade_step_tokens_sum"), rate("cascade_batch_size_sum")), "verified positions per request"),
             (ratio(rate("cascade_batch_size_sum"), rate("cascade_batch_size_count")), "mean batch")])
    b.panel("Tokens per step", "Positions the target verified in one step, all requests together: mean and p95.",
            [(ratio(rate("cascade_step_tokens_sum"), rate("cascade_step_tokens_count")), "mean"),
             (f"histogram_quantile(0.95, sum by (le) (rate(cascade_step_tokens_bucket{{{SEL}}}[{RI}])))", "p95")])
    b.panel("KV cache memory by stage", "Bytes each model stage holds for KV-cache slots (bounded by max_running).",
            [(f"sum by (stage) (cascade_stage_kv_cache_bytes{{{STAGE_SEL}}})", "{{stage}}")], unit="bytes")
    b.panel("Reused prompt tokens",
            "Tokens each model stage found cached in the slot a finished request left (batching.reuse_prefixes), "
            "as a share of the prompt tokens served: positions no forward pass computed.",
            [(ratio(rate("cascade_stage_reused_prefix_tokens_total", STAGE_SEL, "stage"),
                    rate("cascade_prompt_tokens_total"), "ignoring(stage) group_left"), "{{stage}}")],
            unit="percentunit")
    b.row("Latency and load")
    b.panel("Time to first token", "From arrival to the first generated token.",
            quantiles("cascade_time_to_first_token_seconds"), unit="s", width=8)
    b.panel("Inter-token latency", "Per generated token after the first.",
            quantiles("cascade_inter_token_latency_seconds"), unit="s", width=8)
    b.panel("End-to-end latency", "From arrival to the end of a request.",
            quantiles("cascade_e2e_request_latency_seconds"), unit="s", width=8)
    b.panel("Running and waiting requests", "Requests being generated, and queued behind them.",
            [(f"sum(cascade_num_requests_running{{{SEL}}})", "running"),
             (f"sum(cascade_num_requests_waiting{{{SEL}}})", "waiting")])
    b.panel("Finished requests by reason", "stop (EOS or a stop string), length, abort (client gone).",
            [(rate("cascade_request_success_total", SEL, "finished_reason"), "{{finished_reason}}")], unit="reqps")
    return b


def service() -> Board:
    b = Board("cascade-service", "Cascade: service", "Request rates, errors and latency of `cascade serve`.",
              stage_variable=False)
    b.panel("HTTP requests by route", "Answers per second, by route and status.",
            [(rate("cascade_http_requests_total", SEL, "route, status"), "{{route}} {{status}}")], unit="reqps")
    b.panel("Error ratio", "Share of answers with status 5xx, and 4xx (client mistakes), of all answers.",
            [(status_ratio("5.."), "5xx"), (status_ratio("4.."), "4xx")],
            unit="percentunit", max_value=1)
    b.panel("Engine failures", "Requests that failed inside the engine (for example a stage actor that died).",
            [(rate("cascade_request_failures_total"), "failures / s")], unit="reqps")
    b.panel("Queue", "Running and waiting requests.",
            [(f"sum(cascade_num_requests_running{{{SEL}}})", "running"),
             (f"sum(cascade_num_requests_waiting{{{SEL}}})", "waiting")])
    b.panel("End-to-end latency", "From arrival to the end of a request.",
            quantiles("cascade_e2e_request_latency_seconds"), unit="s", width=24)
    return b


def dashboards() -> dict[str, dict]:
    return {f"{board.uid}.json": board.to_json() for board in (speculation(), service())}


def main() -> None:
    for name, data in dashboards().items():
        (HERE / name).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
