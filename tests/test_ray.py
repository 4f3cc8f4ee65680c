"""Stages as Ray actors, on a real two-node Ray cluster simulated on this machine (``ray start`` twice)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import ray
import torch
import yaml
from conftest import emulate_stages, perturbed_copy, random_llama
from ray.util.state import list_actors
from test_engine_greedy import CHAINS, EOS, NEW_TOKENS, RESTLESS, build_models, build_prompts, target_greedy
from test_engine_sampling import (
    VOCAB,
    MaskedStage,
    chi_square_p_value,
    exact_first_two,
    exact_pair_after_two,
    sample_pairs,
    samples,
)

from cascade.api import Cascade
from cascade.config import RayRuntimeConfig, parse_config
from cascade.distributed import ModelObject, PlacementError, launch
from cascade.engine import CascadeEngine
from cascade.sampling import SamplingParams
from cascade.server.launch import free_port, running_server, scrape
from cascade.stages.base import StageUnavailable
from cascade.stages.ngram import NGramDrafter

pytestmark = pytest.mark.slow  # a real Ray cluster

NAMESPACE = "cascade"
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def cluster():
    """A head node with resource `node_a` and a second node with `node_b`, both on this machine."""
    assert os.environ["RAY_AUTH_MODE"] == "token"  # set by conftest.py before ray was imported
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus=4", "--disable-usage-stats"]
    # With token authentication on, `ray start --head` needs a token; a fresh machine has none yet.
    subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True)
    subprocess.run([RAY, "start", "--head", f"--port={port}", '--resources={"node_a": 100}',
                    f"--dashboard-port={free_port()}", *common], check=True, capture_output=True)
    try:
        subprocess.run([RAY, "start", f"--address={address}", '--resources={"node_b": 100}', *common],
                       check=True, capture_output=True)
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, "the second Ray node did not join"
            time.sleep(0.5)
        yield address
    finally:
        ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True)


def node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def actor_node(actor_name: str) -> str:
    [actor] = list_actors(filters=[("name", "=", actor_name), ("state", "=", "ALIVE")])
    return actor.node_id


# ---- losslessness on Ray -----------------------------------------------------------------------------------------

VOCAB_GREEDY = 48


def sampling_models() -> dict:
    """The sampling test's models (a vocabulary small enough to enumerate), named apart from the greedy suite's."""
    target = random_llama(VOCAB, 16, 1, seed=0, init_range=0.5)
    return {"s-bottom": random_llama(VOCAB, 16, 1, seed=2, init_range=0.5),
            "s-medium": perturbed_copy(target, 0.3, seed=1), "s-target": target}


@pytest.fixture(scope="module")
def remote_models(cluster):
    """The greedy suite's models and the sampling test's, in four actors (each actor's process costs seconds to start):
    models that share an actor never follow one another in a chain, so every hop of every chain crosses actors, and
    the co-located form is served too. Yields the deployment, the greedy prompts and the target's own greedy decode,
    and the sampling models."""
    models = build_models(VOCAB_GREEDY)
    sampling = sampling_models()
    config = RayRuntimeConfig(default={"num_cpus": 0.5}, colocate=[
        ["tiny16", "small32", "s-bottom"], ["close", "closer", "s-medium"], ["medium", "s-target"]])
    loaders = [(name, ModelObject(m, forward="transformers" if name == "s-medium" else "auto"))
               for name, m in {**models, **sampling}.items()]  # (one with transformers' forward and its KV crops)
    deployment = launch(loaders, config, label="suite")
    assert len(deployment.hosts) == 4
    prompts = build_prompts(VOCAB_GREEDY)
    reference = target_greedy(models["target"], prompts)
    yield deployment, prompts, reference, sampling
    deployment.close()


@pytest.mark.parametrize("chain", list(CHAINS), ids=list(CHAINS))
def test_greedy_on_ray_matches_target(remote_models, chain):
    deployment, prompts, reference, _ = remote_models
    drafters = {
        "ngram": NGramDrafter(max_ngram=3),
        "ngram-earliest": NGramDrafter(max_ngram=2, match="earliest"),
        "ngram-consensus": NGramDrafter(max_ngram=3, match="consensus"),
    }
    names = [n.partition(":")[0] for n in CHAINS[chain]]  # each actor runs the forward its loader chose
    stages = [drafters[n] if n in drafters else deployment.stages[n] for n in names]
    for i, (prompt, expected) in enumerate(zip(prompts, reference)):
        depths = [1 + (i + 3 * level) % 8 for level in range(len(stages) - 1)]
        controller = RESTLESS if i % 2 else None  # half the prompts with depths and chain changing every round
        engine = CascadeEngine(stages, depths, eos_token_id=EOS, controller=controller)
        request = engine.run(engine.add_request(prompt, SamplingParams(), NEW_TOKENS))
        assert request.generated == expected, f"prompt {i} depths {depths}"
    assert all(deployment.stages[n].num_cached_sequences() == 0 for n in names if n in deployment.stages)


@pytest.mark.parametrize("chain", ["3-stage", "ngram+3-stage", "4-stage"])
def test_pipelined_greedy_on_ray_matches_target(remote_models, chain):
    """The pipelined mode on actors: the drafters' calls come from a second thread of the driver while the target's
    actor verifies."""
    deployment, prompts, reference, _ = remote_models
    stages = [NGramDrafter(max_ngram=3) if n == "ngram" else deployment.stages[n] for n in CHAINS[chain]]
    kept = 0
    for i, (prompt, expected) in enumerate(zip(prompts, reference)):
        depths = [1 + (i + 3 * level) % 8 for level in range(len(stages) - 1)]
        engine = CascadeEngine(stages, depths, eos_token_id=EOS, controller=RESTLESS if i % 2 else None, pipeline=True)
        engine.interrupt_ahead = bool(i % 2)  # adaptive: stopped by the target's pass; fixed: full depth, no timing
        engine.ahead_outcomes = True  # every outcome of a verification, as on actors with GPUs of their own
        request = engine.run(engine.add_request(prompt, SamplingParams(), NEW_TOKENS))
        assert request.generated == expected, f"prompt {i} depths {depths}"
        kept += request.stats.kept_ahead if i % 2 == 0 else 0
    assert kept > 0  # (counted where no timing decides: fixed plans drafting ahead to full depth)


def test_sampling_on_ray_matches_target_distribution(remote_models):
    """Pipelined over actors: the first two tokens come from the first round, synchronous (nothing was drafted ahead
    before it), and tokens three and four from rounds that often start from drafts made ahead (see the local test);
    both pairs follow the target. One run checks both, as the synchronous path needs no run of its own."""
    params = SamplingParams(temperature=1.0)
    deployment, _, _, models = remote_models
    target, s = models["s-target"], deployment.stages
    stages = [MaskedStage(s["s-bottom"], banned=[0, 5]), s["s-medium"], s["s-target"]]
    received = s["s-target"].transfer.bytes_received
    # 256 requests a step: a step over Ray costs its round trips more than its rows
    finished: list = []
    later, kept = sample_pairs(stages, [3, 1], params, num_samples=samples(2000), at=2, max_tokens=4,
                               pipeline=True, batch=256, finished=finished)
    assert kept > samples(2000) // 10
    # The sampled rows really crossed the process boundary.
    assert s["s-target"].transfer.bytes_received - received >= samples(2000) * VOCAB * 4

    @torch.inference_mode()
    def next_logits(ctx):
        return target(input_ids=torch.tensor([ctx])).logits[0, -1]

    first = Counter(tuple(r.generated[:2]) for r in finished)
    assert chi_square_p_value(first, exact_first_two(next_logits, params)) > 1e-3
    assert chi_square_p_value(later, exact_pair_after_two(next_logits, params)) > 1e-3


# ---- placement ---------------------------------------------------------------------------------------------------


def ray_config(tiny_family, cluster: str, **ray_options) -> dict:
    data = yaml.safe_load(Path(tiny_family.config_path).read_text())
    data["runtime"] = {"backend": "ray", "ray": {"address": cluster, "default": {"num_cpus": 0.5}, **ray_options}}
    return data


def test_stages_land_on_the_nodes_the_config_asks_for(tiny_family, cluster):
    data = ray_config(
        tiny_family, cluster,
        stages={"small": {"num_cpus": 0.5, "resources": {"node_a": 1}},
                "target": {"num_cpus": 0.5, "resources": {"node_b": 1}}},
        colocate=[["small", "medium"]],
        placement_strategy="SPREAD",
    )
    local = Cascade.from_config(parse_config({k: v for k, v in data.items() if k != "runtime"}), progress=False)
    with Cascade.from_config(parse_config(data), progress=False) as remote:
        hosts = {h.label: h for h in remote.deployment.hosts}
        assert set(hosts) == {"small+medium", "target"}  # co-located: one actor for small and medium
        names = {label: h.actor_name for label, h in hosts.items()}
        assert actor_node(names["small+medium"]) == node_with("node_a")
        assert actor_node(names["target"]) == node_with("node_b")
        for prompt in ["def parse(", "import os\n"]:
            assert remote.generate(prompt, max_tokens=32).token_ids == local.generate(prompt, max_tokens=32).token_ids
        # The data plane: a socket file on the driver's node, TCP to the other node.
        assert hosts["small+medium"]._channel.address.startswith("ipc://")
        assert hosts["target"]._channel.address.startswith("tcp://")


def test_cascade_bench_puts_local_and_ray_side_by_side(tiny_family, cluster, tmp_path):
    """A config whose backend is Ray: `cascade bench` runs the family's cascades in this process and with the
    stages as Ray actors in one interleaved run, synchronous and pipelined, every greedy output checked against the
    target's own decode."""
    from cascade.bench import BenchOptions, run

    options = BenchOptions(max_tokens=12, repeats=1, num_prompts=2, depths=(2,), methods=("cascade:*@2*", "ray:*@2*"),
                           out=str(tmp_path), progress=False, pipeline=True)
    report = run(parse_config(ray_config(tiny_family, cluster)), options)
    names = {s.method for s in report.summaries}
    family = "cascade:ngram+small+medium+target@2"
    assert {"target", family, "ray:" + family, family + "~pipelined", "ray:" + family + "~pipelined"} <= names
    assert not any(n.startswith("ray:") and "small+target" in n for n in names)  # only the whole family on Ray
    assert report.result.mismatches == []
    assert "ray:cascade:ngram+small+medium+target@2 " in report.table
    assert (tmp_path / "speedup.png").stat().st_size > 0


def test_unplaceable_stages_fail_with_a_clear_error(tiny_family, cluster):
    # Three actors cannot be spread strictly over two nodes.
    data = ray_config(tiny_family, cluster, placement_strategy="STRICT_SPREAD", startup_timeout_s=5)
    with pytest.raises(PlacementError, match="STRICT_SPREAD"):
        Cascade.from_config(parse_config(data), progress=False)


def test_an_impossible_placement_fails_at_once_naming_both_resource_sets(tiny_family, cluster):
    data = ray_config(tiny_family, cluster, default={"num_cpus": 64})  # no node has 64 CPUs; the timeout stays 300 s
    started = time.monotonic()
    with pytest.raises(PlacementError) as error:
        Cascade.from_config(parse_config(data), progress=False)
    assert time.monotonic() - started < 30
    message = str(error.value)
    assert "'CPU': 64.0" in message and "node_a" in message and "node_b" in message  # asked for, and what there is


_DEFAULT_RAY = """
import json, os, sys, yaml, ray, torch
from cascade.api import Cascade
from cascade.config import parse_config
data = yaml.safe_load(open(sys.argv[1]))
local = Cascade.from_config(parse_config(data), progress=False)
data["runtime"] = {"backend": "ray"}  # every Ray setting at its default
threads = torch.get_num_threads()
with Cascade.from_config(parse_config(data), progress=False) as remote:
    reserved = sum(info["num_cpus"] for info in remote.deployment.infos)
    same = all(remote.generate(p, max_tokens=24).token_ids == local.generate(p, max_tokens=24).token_ids
               for p in ["def parse(", "import os\\n"])
    print(json.dumps({"same": same, "reserved": reserved, "cpus": ray.cluster_resources()["CPU"],
                      "nodes": len(ray.nodes()), "threads": [i["torch_threads"] for i in remote.deployment.infos],
                      "step_threads": remote.engine.step_threads, "caller_threads_kept": torch.get_num_threads() == threads}))
"""


def test_the_default_ray_config_runs_on_this_machine(tiny_family, tmp_path):
    """`runtime.backend: ray` and nothing else: Cascade starts its own Ray node (not the test cluster that is
    running here) and sizes the actors to fit it, whatever the number of cores."""
    script = tmp_path / "default_ray.py"
    script.write_text(_DEFAULT_RAY)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, str(script), str(tiny_family.config_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"] and result["nodes"] == 1
    assert 0 < result["reserved"] <= result["cpus"]
    # The actors share the driver's cores: its steps run on one thread, and the caller's setting is left alone.
    assert result["step_threads"] == 1 and result["caller_threads_kept"]
    cpus, threads = int(result["cpus"]), result["threads"]  # the actors bottom first, the target's last
    if cpus < len(threads):  # a share of the cores each, taking turns: the target's actor gets them all
        assert threads == [1] * (len(threads) - 1) + [cpus]
    else:
        assert threads == [1] * len(threads)


# ---- a stage actor dies ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_on_ray(tiny_family, cluster):
    """The tiny family on actors (synchronous), shared by the tests that kill its target's actor and check that it
    came back (each leaves it serving), and the same family in process for their expected tokens."""
    data = ray_config(tiny_family, cluster)
    local = Cascade.from_config(parse_config({k: v for k, v in data.items() if k != "runtime"}), progress=False)
    with Cascade.from_config(parse_config(data), progress=False) as remote:
        yield remote, local


def test_killed_target_actor_fails_its_request_and_comes_back(tiny_on_ray):
    remote, local = tiny_on_ray
    _kill_mid_request(remote, local, remote.deployment.hosts[-1])


def test_actor_restarted_while_idle_is_noticed_and_the_request_goes_on_exactly(tiny_on_ray):
    """The target's actor is killed between two steps of a request and comes back before the next call: that call
    finds its contexts gone, the driver resends whole contexts, and the request finishes with the right tokens."""
    remote, local = tiny_on_ray
    target_host = remote.deployment.hosts[-1]
    generation = remote.start("class Stack:\n", max_tokens=40)
    for _ in range(3):
        remote.step()
    pid = ray.get(target_host.actor.info.remote())["pid"]
    ray.kill(target_host.actor, no_restart=False)
    deadline = time.monotonic() + 120
    while True:  # back (a new process), idle, before the engine calls it again
        assert time.monotonic() < deadline
        try:
            if ray.get(target_host.actor.info.remote(), timeout=10)["pid"] != pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    while not generation.finished:
        remote.step()
    assert generation.request.generated == local.generate("class Stack:\n", max_tokens=40).token_ids
    assert all(s.num_cached_sequences() == 0 for s in remote.engine.stages if hasattr(s, "host"))
    assert ray.get(target_host.actor.num_cached_sequences.remote("target")) == 0


def test_killed_drafter_actor_fails_its_pipelined_request_and_comes_back(tiny_family, cluster):
    """The bottom drafter's actor, which the driver calls from its drafting thread while the target verifies, each
    stage on an emulated device of its own (so the drafting ahead covers the outcomes where the target rejects a
    token too)."""
    data = ray_config(tiny_family, cluster)
    local = Cascade.from_config(parse_config({k: v for k, v in data.items() if k != "runtime"}), progress=False)
    data["runtime"]["pipeline"] = True
    emulate_stages(data, "mi300x", time_scale=0.05)
    with Cascade.from_config(parse_config(data), progress=False) as remote:
        _kill_mid_request(remote, local, remote.deployment.hosts[0])


def _kill_mid_request(remote: Cascade, local: Cascade, host) -> None:
    pid = ray.get(host.actor.info.remote())["pid"]
    generation = remote.start("class Stack:\n", max_tokens=1500)
    for _ in range(3):
        remote.step()
    ray.kill(host.actor, no_restart=False)  # a real crash: Ray restarts the actor
    # The driver learns of it while its next call waits on the channel: from Ray, that the actor died (the
    # request fails), or that a new one already serves another channel (the contexts are resent, and the
    # request goes on exactly).
    try:
        while not generation.finished:
            remote.step()
    except StageUnavailable as error:
        assert host.stages[0].name in str(error)
        assert generation.request.finish_reason == "abort"
    else:
        assert generation.request.generated == local.generate("class Stack:\n", max_tokens=1500).token_ids
    assert all(s.num_cached_sequences() == 0 for s in remote.engine.stages if hasattr(s, "host"))
    # The next requests wait for the restarted actor (its model reloaded) and are right.
    for prompt in ["def parse(", "for i in range("]:
        assert remote.generate(prompt, max_tokens=24).token_ids == local.generate(prompt, max_tokens=24).token_ids
    assert ray.get(host.actor.info.remote())["pid"] != pid


def test_killed_actor_under_cascade_serve_is_a_503_then_recovers(tiny_family, cluster, tmp_path):
    data = ray_config(tiny_family, cluster)
    data["served_model_name"] = "cascade-ray-serve"
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(data))
    local = Cascade.from_config(parse_config({k: v for k, v in data.items() if k != "runtime"}), progress=False)

    def serve_actors(state: str):
        return [a for a in list_actors(filters=[("class_name", "=", "StageHost"), ("state", "=", state)])
                if a.name.startswith("cascade-cascade-ray-serve-")]

    with running_server(path) as url:
        body = {"prompt": "class Stack:\n", "max_tokens": 1500, "temperature": 0}
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=httpx.post(f"{url}/v1/completions", json=body,
                                                                              timeout=300)))
        thread.start()
        deadline = time.monotonic() + 60
        while scrape(url)["cascade_generation_tokens_total"] == 0 and scrape(url)["cascade_num_requests_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        [target] = [a for a in serve_actors("ALIVE") if "-target-" in a.name]
        ray.kill(ray.get_actor(target.name, namespace=NAMESPACE), no_restart=False)
        thread.join(120)
        response = result["r"]
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "stage_unavailable"
        got = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "def parse(", "max_tokens": 24}, timeout=300)
        assert got.status_code == 200
        assert got.json()["choices"][0]["text"] == local.generate("def parse(", max_tokens=24).text
        assert serve_actors("ALIVE")
    # `cascade serve` gave its actors back on exit.
    deadline = time.monotonic() + 30
    while serve_actors("ALIVE"):
        assert time.monotonic() < deadline, "the server's actors outlived it"
        time.sleep(0.5)


def test_ray_serve_entry_point_serves_the_openai_routes(tiny_family, cluster):
    """What KubeRay's RayService runs (cascade.server.ray_serve), on the test cluster."""
    from ray import serve

    from cascade.server.ray_serve import CascadeServer

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        env = {"CASCADE_CONFIG": str(tiny_family.config_path)}
        app = CascadeServer.options(ray_actor_options={"num_cpus": 0.5, "runtime_env": {"env_vars": env}}).bind()
        serve.run(app, name="cascade-test", route_prefix="/")
        local = Cascade.from_config(tiny_family.config_path, progress=False)
        body = {"prompt": "def parse(", "max_tokens": 16, "temperature": 0}
        got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == local.generate("def parse(", max_tokens=16).text
        assert "cascade_rounds_total" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    finally:
        serve.shutdown()


def test_a_hung_stage_fails_its_step_within_the_call_timeout_and_recovers(tiny_family, cluster):
    """A real hang of the target's actor: its process is stopped (SIGSTOP, as a wedged driver leaves it), so a
    forward pass that arrives on the channel cannot start, while Ray still holds the actor alive. The step fails with
    StageUnavailable after call_timeout_s rather than hanging, the actor is restarted, and the next request is
    right."""
    data = ray_config(tiny_family, cluster, call_timeout_s=3)
    local = Cascade.from_config(parse_config({k: v for k, v in data.items() if k != "runtime"}), progress=False)
    with Cascade.from_config(parse_config(data), progress=False) as remote:
        remote.generate("x = ", max_tokens=4)  # the channels are open
        target_host = remote.deployment.hosts[-1]
        pid = ray.get(target_host.actor.info.remote(), timeout=30)["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            generation = remote.start("def parse(", max_tokens=24)
            started = time.monotonic()
            with pytest.raises(StageUnavailable, match="did not answer within 3"):
                while not generation.finished:
                    remote.step()
            assert time.monotonic() - started < 30
            assert generation.request.finish_reason == "abort"
        finally:
            with contextlib.suppress(ProcessLookupError):  # (restarting the actor killed it)
                os.kill(pid, signal.SIGCONT)
        assert remote.generate("import os\n", max_tokens=24).token_ids == local.generate("import os\n", max_tokens=24).token_ids


@pytest.mark.parametrize("pipeline", [False, True], ids=["synchronous", "pipelined"])
def test_emulated_stages_on_ray_decode_the_targets_text_and_report_their_devices(tiny_family, cluster, pipeline):
    """An emulated device per actor (``emulate`` in the config): the same greedy text as the family run locally
    without emulation, each actor reports its emulated passes over its channel, and the engine counts the target
    actor's passes it waited for as device time, not host time (each reply says how long its passes took)."""
    data = ray_config(tiny_family, cluster)
    emulate_stages(data, "mi300x", time_scale=0.05)
    data["runtime"]["pipeline"] = pipeline
    local = yaml.safe_load(Path(tiny_family.config_path).read_text())
    with Cascade.from_config(parse_config(local)) as plain:
        expected = plain.generate("def parse(", max_tokens=24).token_ids
    with Cascade.from_config(parse_config(data)) as emulated:
        assert emulated.generate("def parse(", max_tokens=24).token_ids == expected
        report = emulated.emulation_report()
        host = emulated.engine.host_time()
    models = [s["name"] for s in data["stages"] if s["type"] == "hf"]
    assert set(report["stages"]) == set(models)
    target = report["stages"][models[-1]]
    assert target["model"] == "llama-3.1-70b" and target["passes"] > 0
    # the step's thread waited out every pass of the target (a lower bound that time.sleep guarantees)
    assert host["step_wall_seconds"] - host["host_wall_seconds"] >= 0.05 * target["emulated_seconds"] * 0.999
    assert report["time_scale"] == 0.05
