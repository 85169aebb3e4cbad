"""The ``pdserve`` command line (entry point ``cluster.cli:main``).

Commands:
  pdserve serve --config FILE [--host H] [--port N]   run the YAML's app on a local Ray cluster
  pdserve prepare-model [MODEL] [--cache-dir DIR]     convert/fetch a model once, print its folder
  pdserve config --config FILE                        validate a YAML, print the effective config
  pdserve drain [--app A] [--url U] [--undo]          take a running app out of rotation and wait
                                                      until nothing is in flight (cluster.drain)
  pdserve profile --out FILE [--config FILE]          time a replica's engine here (cluster.planner.measure)
  pdserve plan --profile FILE --workload FILE --gpus N --rates R,R
                                                      best prefill:decode split, chunk and goodput per rate
                                                      from a simulation (cluster.planner)

Exit codes: 0 ok, 2 bad usage or config (the message says what and where), 1 anything else (for
``drain``: it timed out with work still in flight, which it prints).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cluster.config import ClusterConfig, Environment
from cluster.serve_yaml import ConfigError, application_entry
from engine.loading.bundled import DEFAULT_MODEL


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run a Serve YAML's pdserve app on a local Ray cluster")
    s.add_argument("--config", required=True, help="Serve YAML (e.g. deploy/local.yaml)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    m = sub.add_parser("prepare-model", help="prepare a model folder (the bundled model by default)")
    m.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="bundled name, .gguf file or HF folder")
    m.add_argument("--cache-dir", default=None, help="where prepared models live (PDSERVE_MODEL_CACHE)")
    c = sub.add_parser("config", help="validate a Serve YAML and print the effective pdserve config")
    c.add_argument("--config", required=True)
    d = sub.add_parser("drain", help="take a running app out of rotation (/ready 503), wait until it is idle")
    d.add_argument("--app", default="pdserve", help="Serve application name")
    d.add_argument("--url", default="http://127.0.0.1:8000", help="the app's base URL (for /ready, /metrics)")
    d.add_argument("--address", default="auto", help="Ray cluster address (ray.init)")
    d.add_argument("--announce", type=float, default=2.0, help="seconds to hold after /ready turns 503")
    d.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    d.add_argument("--api-key", default=None, help="a key, when the app has API keys on /metrics")
    d.add_argument("--undo", action="store_true", help="clear the flag: back in rotation")
    f = sub.add_parser("profile", help="measure a replica's prefill and decode step times into a profile JSON")
    f.add_argument("--out", required=True, help="the profile JSON to write")
    f.add_argument("--config", default=None, help="a Serve YAML: its model and decode pool's engine settings")
    f.add_argument("--model", default=None, help="instead of the YAML's model (default: the bundled one)")
    f.add_argument("--prefill", default="16,64,256,512", help="prompt sizes to time")
    f.add_argument("--batches", default="1,4,16", help="decode batch sizes to time")
    f.add_argument("--contexts", default="64,256,1024", help="per-sequence contexts to time")
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--transfer-bytes-per-s", type=float, default=1e9, help="KV transfer speed (not measured)")
    f.add_argument("--gpus-per-replica", type=int, default=1)
    q = sub.add_parser("plan", help="size the pools for a workload under its objectives (simulated)")
    q.add_argument("--profile", required=True, help="a profile JSON (pdserve profile, or an estimate)")
    q.add_argument("--workload", required=True, help="workload YAML/JSON: objectives, a mix or a trace")
    q.add_argument("--gpus", type=int, required=True, help="the budget: devices (replicas x gpus_per_replica)")
    q.add_argument("--rates", required=True, help="offered rates to plan for, requests/s, comma-separated")
    q.add_argument("--chunks", default="256,512,1024", help="chunk sizes to try (tokens)")
    q.add_argument("--target", type=float, default=0.9, help="the attainment to hold")
    q.add_argument("--jobs", type=int, default=1, help="processes for the simulations")
    q.add_argument("--slice", type=int, default=8, help="simulate this many replicas of a larger budget "
                   "at their share of each rate (0: all)")
    q.add_argument("--out", default=None, help="write the plan as JSON here")
    q.add_argument("--plot", default=None, help="write a PNG of attainment against rate here")
    return p


def _serve(path: str, host: str, port: int) -> int:
    from cluster.app import compose_app
    from cluster.local import LocalOptions, serve_forever

    entry = application_entry(path)
    cfg = ClusterConfig.from_yaml(path)
    opts = LocalOptions(host=host, port=port, app_name=str(entry.get("name") or "pdserve"),
                        route_prefix=str(entry.get("route_prefix") or "/"))
    serve_forever(compose_app(cfg), cfg, opts)
    return 0


def _prepare(model: str, cache_dir: str | None) -> int:
    from engine.loading.bundled import prepare_model

    cache = cache_dir or Environment.read().model_cache
    print(f"preparing {model} ...", file=sys.stderr, flush=True)
    folder = prepare_model(model, cache_dir=Path(cache) if cache else None, progress=True)
    print(folder)
    return 0


def _config(path: str) -> int:
    cfg = ClusterConfig.from_yaml(path)
    print(json.dumps(cfg.redacted(), indent=2))
    return 0


def _drain(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import os

    import ray

    from cluster.drain import drain_app, undrain

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        if args.undo:
            undrain(args.app)
            print(f"{args.app}: back in rotation")
            return 0
        result = drain_app(args.app, args.url.rstrip("/"), announce_s=args.announce, timeout_s=args.timeout,
                           api_key=args.api_key)
        print(json.dumps(dataclasses.asdict(result), indent=2))
        return 0 if result.drained else 1
    finally:
        ray.shutdown()


def _profile(args: argparse.Namespace) -> int:
    from cluster.planner.measure import Sizes, measure, parse_sizes
    from engine.config import EngineConfig

    if args.config is not None:
        cfg = ClusterConfig.from_yaml(args.config)
        engine, model, cache = cfg.decode_worker_config().engine, cfg.model, cfg.model_cache_dir
    else:
        engine, model, cache = EngineConfig(), DEFAULT_MODEL, Environment.read().model_cache
    try:
        sizes = Sizes(parse_sizes(args.prefill), parse_sizes(args.batches), parse_sizes(args.contexts), args.repeats)
    except ValueError as e:
        raise ConfigError(f"profile sizes: {e}") from None
    profile = measure(args.model or model, engine, sizes, cache_dir=cache,
                      transfer_bytes_per_s=args.transfer_bytes_per_s, gpus_per_replica=args.gpus_per_replica)
    profile.save(args.out)
    print(args.out)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from cluster.planner import report
    from cluster.planner.measure import parse_sizes
    from cluster.planner.profile import ReplicaProfile, fit
    from cluster.planner.search import RatePlan, plan
    from cluster.planner.workload import WorkloadSpec

    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--plot needs matplotlib (pip install 'pdserve[dev]'), which is not installed")
    try:
        fp = fit(ReplicaProfile.load(args.profile))
        spec = WorkloadSpec.load(args.workload)
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
        chunks = list(parse_sizes(args.chunks))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(f"planning {len(rates)} rates on {args.gpus} GPUs from {fp.profile.source} profile "
          f"{fp.profile.label!r} ...", file=sys.stderr, flush=True)

    def progress(p: RatePlan) -> None:
        pre, dec = p.split(p.best)
        print(f"  rate {p.rate:g}: {pre}P:{dec}D chunk {p.best.shape.chunk_tokens}, "
              f"{100 * p.best.result.attainment:.1f}% ({p.simulations} simulations)", file=sys.stderr, flush=True)

    try:
        plans = plan(fp, spec, rates, args.gpus, chunks, jobs=args.jobs, slice_replicas=args.slice or None,
                     progress=progress)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(report.table(plans, fp, args.gpus, args.target))
    if args.out:
        Path(args.out).write_text(json.dumps(report.to_json(plans, fp, args.gpus, args.target), indent=2) + "\n")
    if args.plot:
        from cluster.planner.plot import plot_plans

        plot_plans(plans, fp.profile, args.gpus, args.plot, args.target)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "profile":
            return _profile(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "serve":
            return _serve(args.config, args.host, args.port)
        if args.command == "prepare-model":
            return _prepare(args.model, args.cache_dir)
        if args.command == "drain":
            return _drain(args)
        return _config(args.config)
    except ConfigError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
