"""Placing model stages on a Ray cluster: one placement-group bundle per actor, one actor per stage (or per
co-located group of stages), each with its own GPU when the cluster has GPUs."""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cascade.config import RayRuntimeConfig, RayStageResources
from cascade.distributed.actor import StageHost
from cascade.distributed.remote import Host, RemoteStage

log = logging.getLogger("cascade.distributed")


class PlacementError(RuntimeError):
    """The cluster cannot host the stages as configured."""


@dataclass
class RayDeployment:
    """The actors and placement group of one cascade; :meth:`close` gives them back."""

    stages: dict[str, RemoteStage]
    hosts: list[Host]
    placement_group: object
    infos: list[dict]  # per actor: node_id, pid, gpu_ids, torch_threads, stages, num_cpus (reserved)
    started_ray: bool
    shares_cores: bool = False  # the actors run on a node Cascade started on this machine: the driver's cores
    closed: bool = field(default=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for host in self.hosts:
            try:
                ray.kill(host.actor, no_restart=True)
            except Exception as e:  # already gone: nothing to give back
                log.debug("killing %s: %s", host.label, e)
        remove_placement_group(self.placement_group)
        if self.started_ray:
            ray.shutdown()


def _groups(names: Sequence[str], colocate: Sequence[Sequence[str]]) -> list[list[str]]:
    grouped = {name for group in colocate for name in group}
    groups = [list(g) for g in colocate]
    groups += [[name] for name in names if name not in grouped]
    order = {name: i for i, name in enumerate(names)}
    return sorted(groups, key=lambda g: min(order[n] for n in g))


def _bundle(res: RayStageResources, has_gpus: bool, auto_cpus: float) -> dict[str, float]:
    gpus = (1.0 if has_gpus else 0.0) if res.num_gpus == "auto" else float(res.num_gpus)
    bundle = {"CPU": auto_cpus if res.num_cpus == "auto" else float(res.num_cpus), **res.resources}
    if gpus:
        bundle["GPU"] = gpus
    return bundle


def _auto_cpus(own_node: bool, actors: int) -> float:
    """CPUs per actor when the config says ``auto``: 1, or an equal share of a node Cascade started itself that has
    fewer CPUs than actors (so the default config runs on a 2-core machine), rounded down to 0.01."""
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if own_node and 0 < cpus < actors:
        return math.floor(100 * cpus / actors) / 100
    return 1.0


def _threads(res: RayStageResources, bundle: dict[str, float], auto_cpus: float, holds_target: bool) -> int:
    """An actor's torch threads (``num_threads: auto``): its CPUs, rounded down; on a node Cascade started with
    fewer CPUs than actors, where the stages take turns on the same cores, all of them for the target's actor
    and one for a drafter's — an idle actor's OpenMP threads wait actively for a while after each parallel
    region, on the cores the next stage needs, and a small drafter gains little from more threads."""
    if res.num_threads != "auto":
        return res.num_threads
    if res.num_cpus == "auto" and auto_cpus < 1:
        return max(1, int(ray.cluster_resources().get("CPU", 1))) if holds_target else 1
    return max(1, int(bundle["CPU"]))


def _nodes() -> list[dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]


def _fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in bundle.items() if v > 0)


def _never_fits(bundles: list[dict[str, float]], strategy: str, nodes: list[dict[str, float]]) -> str | None:
    """Why no amount of waiting can place ``bundles`` on these nodes (their total resources), or None."""
    for i, bundle in enumerate(bundles):
        if not any(_fits(bundle, node) for node in nodes):
            return f"bundle {i} {bundle} fits on no node"
    if strategy == "STRICT_PACK":
        total = {k: sum(b.get(k, 0.0) for b in bundles) for k in {k for b in bundles for k in b}}
        if not any(_fits(total, node) for node in nodes):
            return f"STRICT_PACK needs {total} on one node"
    if strategy == "STRICT_SPREAD" and len(bundles) > len(nodes):
        return f"STRICT_SPREAD needs {len(bundles)} nodes, the cluster has {len(nodes)}"
    return None


def launch(
    models: Sequence[tuple[str, Callable]], config: RayRuntimeConfig, *, label: str = "cascade"
) -> RayDeployment:
    """Start one actor per stage group for ``models`` (``(stage name, loader)`` pairs, bottom first)."""
    started_ray, own_node = _connect(config)
    groups = _groups([name for name, _ in models], config.colocate)
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    resources = [config.stages.get(group[0], config.default) for group in groups]
    auto_cpus = _auto_cpus(own_node, len(groups))
    bundles = [_bundle(res, has_gpus, auto_cpus) for res in resources]
    try:
        pg = _place(bundles, config, label)
    except PlacementError:
        if started_ray:
            ray.shutdown()
        raise
    loaders = dict(models)
    hosts = []
    suffix = uuid.uuid4().hex[:6]
    for i, (group, res, bundle) in enumerate(zip(groups, resources, bundles)):
        actor_name = f"{label}-{'+'.join(group)}-{suffix}"
        actor_class = ray.remote(StageHost).options(
            name=actor_name,
            namespace=config.namespace,
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            resources=dict(res.resources),
            max_restarts=-1,  # a dead stage comes back (and reloads its model); the engine fails only its request
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        )
        threads = _threads(res, bundle, auto_cpus, holds_target=models[-1][0] in group)
        actor = actor_class.remote({name: loaders[name] for name in group}, threads)
        hosts.append(Host(actor, "+".join(group), actor_name=actor_name, recovery_timeout_s=config.load_timeout_s,
                          call_timeout_s=config.call_timeout_s))
    try:
        infos = ray.get([h.actor.info.remote() for h in hosts], timeout=config.load_timeout_s)
    except Exception as e:
        deployment = RayDeployment({}, hosts, pg, [], started_ray)
        deployment.close()
        raise PlacementError(f"a stage actor failed to start: {e}") from None
    stages = {}
    for host, info, group, bundle in zip(hosts, infos, groups, bundles):
        info["num_cpus"] = bundle["CPU"]
        for name in group:
            stages[name] = RemoteStage(name, host, info["stages"][name])
        log.info("actor %s on node %s (GPUs %s, %d threads)", host.label, info["node_id"][:8], info["gpu_ids"],
                 info["torch_threads"])
    return RayDeployment(stages, hosts, pg, infos, started_ray, shares_cores=own_node)


def _connect(config: RayRuntimeConfig) -> tuple[bool, bool]:
    """Join Ray unless this process already has; returns whether it started Ray here and whether that is a node of
    its own on this machine."""
    if ray.is_initialized():
        return False, False
    # No address: the cluster of a Ray job this runs in (RAY_ADDRESS), else a new node on this machine — not
    # whatever `ray start` left running here.
    address = config.address or os.environ.get("RAY_ADDRESS") or "local"
    # A node of its own: Ray's start-up notices (token authentication is on; a local instance started) are
    # noise next to Cascade's output, so only Ray's errors are shown; Cascade logs what it started.
    quiet = {"logging_level": logging.ERROR} if address == "local" else {}
    ray.init(address=address, namespace=config.namespace, include_dashboard=False, log_to_driver=False, **quiet)
    own_node = address == "local"
    if own_node:
        log.info("started a local Ray node (%g CPUs, %g GPUs; token authentication on)",
                 ray.cluster_resources().get("CPU", 0), ray.cluster_resources().get("GPU", 0))
    return True, own_node


def _place(bundles: list[dict], config: RayRuntimeConfig, label: str):
    """A ready placement group for ``bundles``; PlacementError when the cluster can never place them, or cannot
    within ``startup_timeout_s``."""
    nodes = _nodes()
    reason = _never_fits(bundles, config.placement_strategy, nodes)
    if reason is not None:
        raise PlacementError(
            f"the cluster can never place the stages: {reason}. Asked for bundles {bundles} with strategy "
            f"{config.placement_strategy}; the cluster's nodes have {nodes} (set runtime.ray.default / stages)"
        )
    pg = placement_group(bundles, strategy=config.placement_strategy, name=f"{label}-{uuid.uuid4().hex[:8]}")
    try:
        ray.get(pg.ready(), timeout=config.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
        available = ray.available_resources()
        remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not place the stages within {config.startup_timeout_s} s (the resources are in use): "
            f"bundles {bundles} with strategy {config.placement_strategy}; the cluster has {available} available "
            f"of {nodes}"
        ) from None
    return pg
