"""`build_app`: a `ClusterConfig` → one Serve application (router + prefill pool + decode pool).

`build_app` is the Serve YAML's ``import_path: cluster.app:build_app``; Serve calls it with the
YAML's ``args:``. `compose_app` does the work from a validated config and lets tests inject fakes.
Deployments: ``router`` (the HTTP ingress), ``prefill`` (disaggregated mode only) and ``decode``.
Each pool's handles route with `router.replica_router.LoadAwareRequestRouter` over the replicas'
own load reports (``record_routing_stats`` → ``load()``); decode replicas read the prefill replicas'
reports too (by the deployment's name, `PREFILL_DEPLOYMENT`), to meet every KV source at start-up.

Placement, autoscaling and graceful drain come from each section via `cluster.placement`; a pool
scaling on its own load (``autoscaling.policy: objectives``) also reports its signals to Serve
(`cluster.autoscaling.with_scaling_signals`).

Invariants: the only place the components meet; every replica gets its whole config as one frozen
object; replica classes can be swapped (tests pass fakes with the same constructor and methods).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from ray import serve
from ray.serve import Application
from ray.serve.deployment import Deployment

from cluster.autoscaling import with_scaling_signals
from cluster.config import PREFILL_DEPLOYMENT, ClusterConfig
from cluster.placement import actor_placement, serve_options
from router.app import Router
from router.codec import TextCodec
from router.config import RouterConfig
from router.replica_router import serve_router_config, with_routing_stats


def _deployment(cls: type) -> Deployment:
    return cast(Deployment, serve.deployment(cls))  # Serve's overloads confuse mypy for a class value


def _actor_options(num_cpus: float, num_gpus: float, num_threads: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        options["num_gpus"] = num_gpus
    if num_threads:
        # BLAS/OpenMP pools are sized at import, before the replica's own torch.set_num_threads
        threads = str(num_threads)
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}
    return options


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The Serve entry point: ``args`` is the YAML's ``args:``. (Serve requires exactly one parameter.)"""
    return compose_app(ClusterConfig.from_args(args))


def compose_app(
    cfg: ClusterConfig,
    *,
    prefill_cls: type | None = None,
    decode_cls: type | None = None,
    codec_factory: Callable[[RouterConfig], TextCodec] | None = None,
) -> Application:
    """The pdserve application for ``cfg``; tests swap in fake replica classes and a fake tokenizer."""
    if decode_cls is None:
        from decode_worker.deployment import DecodeServer

        decode_cls = DecodeServer
    threads = cfg.engine.num_threads
    period = cfg.router.routing_stats_period_s

    decode = _deployment(with_scaling_signals(with_routing_stats(decode_cls), cfg.decode.autoscaling)).options(
        name="decode",
        max_ongoing_requests=cfg.decode.max_ongoing_requests,
        ray_actor_options=_actor_options(cfg.decode.num_cpus, cfg.decode.num_gpus, threads)
        | actor_placement(cfg.decode.placement),
        request_router_config=serve_router_config(cfg.decode_policy(), cfg.affinity(cfg.decode.affinity), period),
        **serve_options(cfg.decode),
    ).bind(cfg.decode_worker_config())

    prefill = None
    if cfg.disaggregated:
        if prefill_cls is None:
            from prefill_worker.deployment import PrefillServer

            prefill_cls = PrefillServer
        prefill = _deployment(with_scaling_signals(with_routing_stats(prefill_cls), cfg.prefill.autoscaling)).options(
            name=PREFILL_DEPLOYMENT,
            max_ongoing_requests=cfg.prefill.max_ongoing_requests,
            ray_actor_options=_actor_options(cfg.prefill.num_cpus, cfg.prefill.num_gpus, threads)
            | actor_placement(cfg.prefill.placement),
            request_router_config=serve_router_config(cfg.prefill.policy, cfg.affinity(cfg.prefill.affinity),
                                                      period),
            **serve_options(cfg.prefill),
        ).bind(cfg.prefill_worker_config())

    return cast(Deployment, Router).options(
        name="router",
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.router.num_cpus} | actor_placement(cfg.router.placement),
        **serve_options(cfg.router),
    ).bind(prefill, decode, cfg.router_config(), codec_factory)
