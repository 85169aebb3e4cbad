"""The ``pdserve`` command line (entry point ``cluster.cli:main``).

Commands:
  pdserve serve --config FILE [--host H] [--port N]   run the YAML's app on a local Ray cluster
  pdserve prepare-model [MODEL] [--cache-dir DIR]     convert/fetch a model once, print its folder
  pdserve config --config FILE                        validate a YAML, print the effective config
  pdserve drain [--app A] [--url U] [--undo]          take a running app out of rotation and wait
                                                      until nothing is in flight (cluster.drain)

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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
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
