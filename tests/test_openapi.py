"""The HTTP API driven by its own OpenAPI document: schemathesis generates requests (valid and invalid) for every
operation, and every response must be what the document says — no 5xx, a documented status code and content
type, a body that fits the documented schema, every error an OpenAI error object. Bounded in examples, derandomized
(the same requests every run); the server must be healthy and right afterwards."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from cascade.api import Cascade
from cascade.server.launch import running_server, scrape

pytestmark = pytest.mark.slow  # a server process, fuzzed

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed(tiny_family):
    # --max-new-tokens keeps generated requests short: the fuzzer asks for up to the whole context window.
    with running_server(tiny_family.config_path, "--max-new-tokens", "8", "--log-level", "warning") as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    return schemathesis.openapi.from_url(f"{fuzzed}/openapi.json")


def _operations(schema) -> dict[str, object]:
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


@pytest.mark.parametrize(
    "label", ["GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions"]
)
def test_every_response_is_what_the_openapi_document_says(api_schema, fuzzed, label):
    operation = _operations(api_schema)[label]

    @given(case=operation.as_strategy())
    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call_and_validate(base_url=fuzzed, checks=CHECKS)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()


def test_the_document_says_400_not_422_and_lists_what_the_server_answers(fuzzed):
    doc = httpx.get(f"{fuzzed}/openapi.json").json()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and {"200", "400", "401", "404", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_the_fuzzed_server_is_healthy_and_right_afterwards(fuzzed, tiny_family):
    assert httpx.get(f"{fuzzed}/health").status_code == 200
    reference = Cascade.from_config(tiny_family.config_path, progress=False)
    body = {"prompt": "def parse(", "max_tokens": 8, "temperature": 0}
    got = httpx.post(f"{fuzzed}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert got == reference.generate("def parse(", max_tokens=8).text
    metrics = scrape(fuzzed)
    assert sum(v for k, v in metrics.items() if k.startswith("cascade_stage_cached_sequences")) == 0
