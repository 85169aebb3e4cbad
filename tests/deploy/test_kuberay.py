"""deploy/kuberay/rayservice.yaml: its embedded Serve config is a valid `ClusterConfig`, and its worker
groups can host every deployment at its maximum replica count, each pool on the group meant for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import ClusterConfig, Environment
from cluster.placement import NodeGroup, max_replicas, pack
from cluster.serve_yaml import IMPORT_PATH

pytestmark = pytest.mark.timeout(60)

RAYSERVICE = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "rayservice.yaml"


def _quantity(v: Any) -> float:
    s = str(v)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def node_group(name: str, count: int, spec: dict[str, Any]) -> NodeGroup:
    """What ``ray start`` in this group's pods offers: KubeRay derives CPU/GPU from the container's
    limits unless ``rayStartParams`` sets them; custom resources come as a quoted JSON string."""
    params = spec.get("rayStartParams", {})
    limits = spec["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    res: dict[str, float] = {"CPU": _quantity(params.get("num-cpus", limits.get("cpu", 0)))}
    gpus = _quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    if gpus:
        res["GPU"] = gpus
    if "resources" in params:
        res.update(json.loads(params["resources"].strip().strip('"').replace('\\"', '"')))
    labels = dict(kv.split("=", 1) for kv in params.get("labels", "").split(",") if kv)
    return NodeGroup(name, count, res, labels)


def load() -> tuple[dict[str, Any], ClusterConfig, list[NodeGroup]]:
    doc = yaml.safe_load(RAYSERVICE.read_text())
    assert doc["kind"] == "RayService" and doc["apiVersion"] == "ray.io/v1"
    serve_cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = [a for a in serve_cfg["applications"] if a["import_path"] == IMPORT_PATH]
    cfg = ClusterConfig.from_args(app["args"], Environment(kv_secret="from-the-k8s-secret"), source="serveConfigV2")
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [node_group("head", 1, cluster["headGroupSpec"])]
    groups += [node_group(w["groupName"], int(w["maxReplicas"]), w) for w in cluster["workerGroupSpecs"]]
    return doc, cfg, groups


def test_embedded_serve_config_is_the_gpu_layout() -> None:
    _, cfg, _ = load()
    assert cfg.disaggregated and cfg.kv.transport == "nccl"
    assert cfg.engine.device == "cuda" and cfg.engine.dtype == "bfloat16"
    assert cfg.prefill.num_gpus == 1 and cfg.decode.num_gpus == 1
    assert cfg.prefill.placement.resources == {"prefill_node": 0.01}
    assert cfg.decode.placement.resources == {"decode_node": 0.01}
    assert cfg.prefill.autoscaling is not None and cfg.decode.autoscaling is not None
    assert cfg.decode.drain.timeout_s <= cfg.router.drain.timeout_s  # a stream outlives neither hop's drain


def test_groups_host_every_deployment_at_its_maximum() -> None:
    _, cfg, groups = load()
    fit = pack(cfg.demands(), groups)
    assert fit.ok, fit.problems
    assert fit.placed["prefill"] == {"prefill-gpu": max_replicas(cfg.prefill)}
    assert fit.placed["decode"] == {"decode-gpu": max_replicas(cfg.decode)}
    # each pool's custom resource is offered by exactly the group meant for it, and that group has a GPU each
    for pool, group in (("prefill", "prefill-gpu"), ("decode", "decode-gpu")):
        (resource,) = getattr(cfg, pool).placement.resources
        assert [g.name for g in groups if resource in g.resources] == [group]
        assert next(g for g in groups if g.name == group).resources["GPU"] >= getattr(cfg, pool).num_gpus


def test_a_group_too_small_is_reported() -> None:
    _, cfg, groups = load()
    smaller = [NodeGroup(g.name, 2, g.resources, g.labels) if g.name == "decode-gpu" else g for g in groups]
    fit = pack(cfg.demands(), smaller)
    assert fit.problems and fit.problems[0].startswith("decode: only 2 of 4 replicas fit"), fit.problems


def test_gpu_pods_carry_the_nccl_settings() -> None:
    doc, cfg, _ = load()
    for w in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        pod = w["template"]["spec"]
        (c,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_SOCKET_IFNAME"] and env["NCCL_IB_DISABLE"] == "1" and env["NCCL_DEBUG"]
        assert "PDSERVE_KV_SECRET" in env  # one secret across replicas and redeploys
        assert c["resources"]["limits"]["nvidia.com/gpu"] == int(w["rayStartParams"]["num-gpus"])
        shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    prefill = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert {p["containerPort"] for p in prefill["template"]["spec"]["containers"][0]["ports"]} == {cfg.kv.port}
