"""The suffix drafter (cascade.stages.suffix): drafts from earlier requests of the same scope and from the request
itself, within its memory cap; a cascade with it still commits exactly the target's greedy decode."""

from __future__ import annotations

import pytest
import yaml

from cascade.config import parse_config
from cascade.engine import CascadeEngine
from cascade.sampling import SamplingParams
from cascade.stages.suffix import SuffixDrafter
from tests.conftest import hf_stage, random_llama
from tests.test_engine_greedy import EOS, target_greedy


def test_an_earlier_requests_output_is_drafted_only_within_its_scope():
    drafter = SuffixDrafter(key_length=2)
    asked = [[7, 7, 3, 4]]
    assert drafter.propose(asked, [4]) == [[]]
    drafter.learn([1, 2, 3, 4, 5, 6, 7, 8])
    assert drafter.propose(asked, [4]) == [[5, 6, 7, 8]]
    assert drafter.propose(asked, [4], ["alice"]) == [[]]  # alice's scope has seen nothing
    drafter.learn([9, 3, 4, 11, 12], "alice")
    assert drafter.propose(asked, [4], ["alice"]) == [[11, 12]]  # a continuation stops where its request ended
    assert drafter.propose(asked, [4], [None]) == [[5, 6, 7, 8]]


def test_the_longest_shared_history_wins_then_the_majority():
    drafter = SuffixDrafter(key_length=2)
    for _ in range(3):
        drafter.learn([0, 3, 4, 20, 21])  # (3, 4) -> 20, three times, after a 0
    drafter.learn([8, 9, 3, 4, 30, 31])  # (3, 4) -> 30 once, after 8, 9
    assert drafter.propose([[1, 3, 4]], [2]) == [[20, 21]]
    assert drafter.propose([[8, 9, 3, 4]], [2]) == [[30, 31]]  # matches four tokens back, not two


def test_the_request_itself_is_looked_up_too():
    drafter = SuffixDrafter(key_length=2)
    assert drafter.propose([[5, 6, 7, 1, 5, 6]], [3]) == [[7, 1, 5]]


def test_memory_stays_within_the_cap_and_the_oldest_requests_go_first():
    drafter = SuffixDrafter(key_length=2, max_tokens=200, max_scopes=3)
    for i in range(100):
        drafter.learn(list(range(1000 + 17 * i, 1017 + 17 * i)), scope=f"user{i % 5}")
        assert drafter.kept_tokens <= 200 * 3
    newest = list(range(1000 + 17 * 99, 1017 + 17 * 99))
    assert drafter.propose([newest[:3]], [3], ["user4"]) == [newest[3:6]]
    assert drafter.propose([[1000, 1001]], [3], ["user0"]) == [[]]  # evicted long ago
    assert drafter.propose([newest[:3]], [3], ["user1"]) == [[]]  # (another scope)


def test_a_request_longer_than_the_cap_keeps_its_end():
    drafter = SuffixDrafter(key_length=2, max_tokens=64)
    drafter.learn(list(range(500)))
    assert drafter.kept_tokens <= 64
    assert drafter.propose([[490, 491]], [3]) == [[492, 493, 494]]


def test_a_suffix_cascade_commits_the_targets_greedy_decode_and_drafts_from_earlier_requests():
    """The same prompts asked twice: every output is the target's own greedy decode, and in the second pass the
    suffix drafter's drafts (from the first pass's outputs) are accepted far more often."""
    target = random_llama(48, 48, 2, seed=0, eos_token_id=EOS)
    prompts = [[6 + (7 * i + j) % 40 for j in range(5 + i)] for i in range(8)]
    reference = target_greedy(target, prompts)
    drafter = SuffixDrafter(key_length=2)
    engine = CascadeEngine([drafter, hf_stage("target", target)], [6], eos_token_id=EOS, max_running=4)
    accepted = []
    for _ in range(2):
        requests = [engine.add_request(p, SamplingParams(), 24) for p in prompts]
        while engine.has_work:
            engine.step()
        assert [r.generated for r in requests] == reference
        accepted.append(sum(r.stats.stages[0].accepted for r in requests))
    assert accepted[1] > 2 * accepted[0] + 20


def test_config_takes_a_suffix_stage_only_at_the_bottom():
    config = parse_config(yaml.safe_load(
        "stages:\n  - {name: s, type: suffix, key_length: 2, depth: 5, shortcut: true}\n  - {name: t, type: hf, model: m}\n"))
    assert config.stages[0].type == "suffix" and config.stages[0].max_tokens == 1 << 18
    with pytest.raises(ValueError, match="can only be the first stage"):
        parse_config(yaml.safe_load("stages:\n  - {name: m0, type: hf, model: a}\n  - {name: s, type: suffix}\n"
                                    "  - {name: t, type: hf, model: m}\n"))
    with pytest.raises(ValueError, match="key_length"):
        parse_config(yaml.safe_load(
            "stages:\n  - {name: s, type: suffix, key_length: 9, max_match: 4}\n  - {name: t, type: hf, model: m}\n"))


def test_the_openai_user_field_scopes_what_a_request_learns_and_drafts_from(tiny_family):
    """A config with a suffix stage, through the Python API (``user=``, as the server passes a completion's
    ``user``): a request learns into its user's scope only."""
    from cascade.api import Cascade
    from cascade.config import load_config
    from cascade.server.protocol import CompletionRequest

    config = load_config(tiny_family.config_path).model_dump(mode="json")
    config["stages"][0] = {"name": "suffix", "type": "suffix", "key_length": 2}
    cascade = Cascade.from_config(parse_config(config))
    drafter = cascade.engine.stages[0]
    assert isinstance(drafter, SuffixDrafter)
    prompt = [9, 10, 11, 12, 13]
    [done] = cascade.generate([prompt], max_tokens=16, user="alice", ignore_eos=True)
    tail = prompt[-2:]
    assert drafter.propose([tail], [4], ["alice"]) == [done.token_ids[:4]]
    assert drafter.propose([tail], [4], ["bob"]) == drafter.propose([tail], [4], [None]) == [[]]
    body = CompletionRequest(model="m", prompt="hi", user="alice")
    assert body.engine_options(8, 0)["user"] == "alice"


def test_the_metrics_show_what_the_suffix_index_keeps(tiny_family):
    """/metrics' cascade_stage_kept_tokens reads the drafter's index, within its cap however many requests come."""
    from prometheus_client import generate_latest

    from cascade.api import Cascade
    from cascade.config import load_config
    from cascade.server.metrics import Metrics

    config = load_config(tiny_family.config_path).model_dump(mode="json")
    config["stages"][0] = {"name": "suffix", "type": "suffix", "key_length": 2, "max_tokens": 256}
    cascade = Cascade.from_config(parse_config(config))
    metrics = Metrics([s.name for s in cascade.engine.stages], gauges=cascade.cache_gauges())

    def kept() -> float:
        line = next(line for line in generate_latest(metrics.registry).decode().splitlines()
                    if line.startswith('cascade_stage_kept_tokens{stage="suffix"}'))
        return float(line.split()[-1])

    assert kept() == 0
    for i in range(12):
        cascade.generate([[7 + i, 8, 9, 10 + i] * 8], max_tokens=24, ignore_eos=True)
        assert 0 < kept() <= 256
