"""Dashboards, Prometheus config and deployment files: they parse, they point at things that exist, and every
dashboard query runs against a real Prometheus scraping a real `cascade serve`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cascade.config import load_config
from cascade.server.launch import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
SHIPPED_YAML = sorted([*(ROOT / "configs").glob("*.yaml"), *(ROOT / "deploy").rglob("*.yaml"),
                       *(ROOT / "deploy").rglob("*.yml")])


def needs(tool: str):
    """Skip without ``tool``, unless CI demands it (CASCADE_REQUIRE_PROMETHEUS=1)."""
    if shutil.which(tool) is None:
        if os.environ.get("CASCADE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{tool} is required here (CASCADE_REQUIRE_PROMETHEUS=1) but not installed")
        pytest.skip(f"{tool} is not installed (apt-get install prometheus)")


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every target of every panel."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


# ---- dashboards -----------------------------------------------------------------------------------------------------


def test_dashboards_are_what_generate_py_writes():
    sys.path.insert(0, str(ROOT / "dashboards"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    expected = generate.dashboards()
    assert sorted(expected) == [p.name for p in DASHBOARDS]
    for path in DASHBOARDS:
        assert json.loads(path.read_text()) == expected[path.name], f"{path.name} is stale: run dashboards/generate.py"


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_dashboard_uses_variables_and_guards(path):
    board = json.loads(path.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["query"]["query"].startswith("label_values(")
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"]["uid"] == "${datasource}"
            assert not re.search(r"\[\d+[smhd]\]", expr), f"{panel['title']}: use $__rate_interval, not a fixed range"
            assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr, panel["title"]
            if " / " in expr:
                assert "clamp_min(" in expr.split(" / ", 1)[1], f"{panel['title']}: unguarded division"
    titles = " ".join(p["title"].lower() for p in panels)
    if path.name == "cascade-speculation.json":
        for needed in ("acceptance rate", "draft position", "accepted tokens per draft", "depth", "bypassed",
                       "drafted vs accepted", "generation tokens", "time to first token", "inter-token",
                       "end-to-end", "running and waiting", "forward time"):
            assert needed in titles, needed


@pytest.mark.slow  # a real Prometheus and a server process
def test_dashboard_queries_return_data_from_a_real_prometheus(tiny_family, tmp_path):
    needs("prometheus")
    config = yaml.safe_load(Path(tiny_family.config_path).read_text())
    config["controller"] = {"mode": "adaptive", "warmup_rounds": 0, "explore_every": 4}  # depths and chains move
    for stage in config["stages"][:-1]:  # the drafters propose draft trees (for the panel that shows them)
        if stage["type"] == "hf":
            stage["siblings"] = 2
    config_path = tmp_path / "cascade.yaml"
    config_path.write_text(yaml.safe_dump(config))
    with running_server(config_path) as url:
        port = int(url.rsplit(":", 1)[1])
        stop = threading.Event()

        def traffic():
            prompts = ["def parse(", "for i in range(10):\n    for j in range(10):\n        for k in range(",
                       "import os\nimport sys\nimport os\nimport sys\nimport", "class A:\n"]
            i = 0
            while not stop.is_set():
                body = {"prompt": prompts[i % len(prompts)], "max_tokens": 24, "temperature": 0.8 * (i % 2)}
                httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                httpx.post(f"{url}/v1/completions", json={"prompt": ""}, timeout=60)  # a 400 for the error panels
                i += 1

        workers = [threading.Thread(target=traffic) for _ in range(2)]
        for w in workers:
            w.start()
        prom_port = free_port()
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "cascade", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
        }))
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        api = f"http://127.0.0.1:{prom_port}/api/v1/query"
        try:
            # $__rate_interval is at least four scrape intervals in Grafana; 10s covers ten scrapes here.
            queries = [(board, title, expr.replace("$__rate_interval", "10s").replace("$job", ".*")
                        .replace("$instance", ".*").replace("$stage", ".*"))
                       for board, title, expr in dashboard_queries()]
            empty = queries
            deadline = time.monotonic() + 90
            while empty and time.monotonic() < deadline:
                time.sleep(2)
                still = []
                for board, title, expr in empty:
                    try:
                        response = httpx.get(api, params={"query": expr}, timeout=10)
                    except httpx.TransportError:
                        still.append((board, title, expr))
                        continue
                    body = response.json()
                    assert body["status"] == "success", f"{board} / {title}: {body}"  # it parses and evaluates
                    if not body["data"]["result"]:
                        still.append((board, title, expr))
                empty = still
            assert not empty, "queries without data:\n" + "\n".join(f"{b} / {t}: {e}" for b, t, e in empty)
        finally:
            stop.set()
            prometheus.terminate()
            prometheus.wait(timeout=30)
            for w in workers:
                w.join(timeout=60)


def test_shipped_prometheus_config_passes_promtool():
    needs("promtool")
    result = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- configs and deployment files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED_YAML, ids=[str(p.relative_to(ROOT)) for p in SHIPPED_YAML])
def test_shipped_yaml_parses(path):
    documents = list(yaml.safe_load_all(path.read_text()))
    assert documents and all(isinstance(d, dict) for d in documents)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_config_loads(path):
    config = load_config(path)
    assert config.stages[-1].type == "hf"


def test_real_model_configs_put_every_model_stage_on_its_own_gpu():
    for name in ("llama-mi300x", "qwen-mi300x"):
        config = load_config(ROOT / "configs" / f"{name}.yaml")
        assert config.runtime.backend == "ray" and not config.runtime.ray.colocate
        models = [s.name for s in config.stages if s.type == "hf"]
        assert len(models) == 3
        for stage in models:
            resources = config.runtime.ray.stages.get(stage, config.runtime.ray.default)
            assert resources.num_gpus == 1, (name, stage)


def test_compose_refers_to_files_that_exist():
    deploy = ROOT / "deploy"
    compose = yaml.safe_load((deploy / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = (deploy / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (deploy / source).exists(), f"{name}: {source}"
    for path in (deploy / "grafana/provisioning/dashboards").glob("*.yaml"):
        provider = yaml.safe_load(path.read_text())["providers"][0]
        assert provider["options"]["path"] in {v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]}
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "dashboards" / Path(home).name).is_file()
    override = yaml.safe_load((deploy / "compose.rocm.yaml").read_text())
    assert {"/dev/kfd", "/dev/dri"} <= set(override["services"]["cascade"]["devices"])


def test_dockerfile_copies_what_exists():
    for line in (ROOT / "deploy/Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


def test_ray_cluster_yaml_mounts_what_exists_and_passes_amd_devices():
    cluster = yaml.safe_load((ROOT / "deploy/ray/cluster-mi300x.yaml").read_text())
    for target, source in cluster["file_mounts"].items():
        assert (ROOT / source).exists(), source  # `ray up` runs from the repository root
    options = " ".join(cluster["docker"]["run_options"])
    assert "/dev/kfd" in options and "/dev/dri" in options


def test_kuberay_manifests_request_amd_gpus_and_name_shipped_configs():
    for name in ("raycluster.yaml", "rayservice.yaml"):
        manifest = yaml.safe_load((ROOT / "deploy/kuberay" / name).read_text())
        spec = manifest["spec"].get("rayClusterConfig", manifest["spec"])
        limits = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["amd.com/gpu"] >= 1
    service = yaml.safe_load((ROOT / "deploy/kuberay/rayservice.yaml").read_text())
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    app = serve_config["applications"][0]
    module, _, attribute = app["import_path"].partition(":")
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file() and attribute == "app"
    config = app["runtime_env"]["env_vars"]["CASCADE_CONFIG"]
    assert config.startswith("/app/configs/") and (ROOT / "configs" / Path(config).name).is_file()


def test_deployment_files_keep_the_dashboard_local_take_the_key_from_a_secret_and_cap_tokens():
    """The Ray dashboard's Jobs API runs code: never on 0.0.0.0. The API key comes from a secret or a file, not a
    command line that `ps` shows; a request without max_tokens cannot run to the end of a 128k context."""
    for name in ("raycluster.yaml", "rayservice.yaml"):
        text = (ROOT / "deploy/kuberay" / name).read_text()
        manifest = yaml.safe_load(text)
        spec = manifest["spec"].get("rayClusterConfig", manifest["spec"])
        assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        key = next(e for e in head["env"] if e["name"] == "CASCADE_API_KEY")
        assert key["valueFrom"]["secretKeyRef"]["name"] == "cascade-api-key"
        assert "--max-new-tokens" in text or "CASCADE_MAX_NEW_TOKENS" in text
    up = (ROOT / "deploy/ray/cluster-mi300x.yaml").read_text()
    assert "--dashboard-host=127.0.0.1" in up and "--api-key-file" in up and "--max-new-tokens" in up
    assert "--api-key " not in up
