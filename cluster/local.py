"""A local Ray cluster running one pdserve app, for ``make serve`` / ``pdserve serve``.

Owns: starting Ray (auth off, no dashboard, a known temp dir, CPUs sized so fractional replicas
fit), starting Serve's HTTP proxy on the asked host/port, deploying, waiting for ``/ready``,
printing a curl to paste, and on Ctrl-C or SIGTERM draining the app (`cluster.drain`: ``/ready``
turns 503 first, requests in flight finish) before shutting everything down (a second Ctrl-C skips
the wait).

Invariants: this module starts what it stops: Serve and Ray are shut down in a ``finally``; the
wait for ``/ready`` is bounded and a failure to get ready is an error, not a hang.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ray.serve import Application

from cluster.config import ClusterConfig

TEMP_DIR = "/tmp/pdserve-ray"


@dataclass(frozen=True)
class LocalOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "pdserve"
    route_prefix: str = "/"
    temp_dir: str = TEMP_DIR
    ready_timeout_s: float = 900.0  # the first start converts the bundled model


def cluster_cpus(cfg: ClusterConfig) -> int:
    """Logical CPUs to give Ray: what the replicas ask for, and never fewer than the machine has."""
    return max(os.cpu_count() or 1, math.ceil(cfg.total_cpus() + 0.5))


def start_ray(num_cpus: int, temp_dir: str = TEMP_DIR) -> None:
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # for Ray itself (and the workers it starts)
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir)


def wait_ready(base_url: str, timeout_s: float, api_key: str | None = None) -> None:
    """Poll ``/ready`` until it answers 200; raise TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{base_url}/ready", headers=headers),
                                        timeout=10) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(1.0)
    raise TimeoutError(f"{base_url}/ready did not answer 200 within {timeout_s:g} s (last: {last})")


def curl_example(base_url: str, model: str, api_key: str | None) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello in five words."}],
            "max_tokens": 32, "stream": True}
    # double quotes: the key is usually given as "$PDSERVE_API_KEY" and should expand
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    return (f"curl -N {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(json.dumps(body))}")


def _drain_before_stop(app_name: str, base: str, cfg: ClusterConfig) -> None:
    """Drain (bounded by the longest stream the decode pool is configured to wait for); a second
    Ctrl-C or SIGTERM cuts the wait short."""
    from cluster.drain import drain_app

    timeout = max(cfg.decode.drain.timeout_s, cfg.prefill.drain.timeout_s)
    key = cfg.router.api_keys[0] if cfg.router.api_keys else None
    print(f"\ndraining pdserve (/ready is now 503; up to {timeout:g} s for requests in flight; "
          "Ctrl-C again to stop at once) ...", flush=True)
    try:
        result = drain_app(app_name, base, announce_s=1.0, timeout_s=timeout, api_key=key)
    except KeyboardInterrupt:
        print("drain cut short", flush=True)
        return
    except Exception as e:  # a drain that cannot run must not keep the cluster up
        print(f"drain failed: {e!r}", flush=True)
        return
    state = "drained" if result.drained else f"timed out with {result.left} in flight"
    print(f"{state} after {result.total_s:.1f} s", flush=True)


def serve_forever(app: Application, cfg: ClusterConfig, opts: LocalOptions) -> None:
    """Run ``app`` until Ctrl-C or SIGTERM, then shut Serve and Ray down."""
    import ray
    from ray import serve

    def _on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (docker stop, kill) shuts down like Ctrl-C

    signal.signal(signal.SIGTERM, _on_term)
    start_ray(cluster_cpus(cfg), opts.temp_dir)
    base: str | None = None  # set once the app answers /ready (only then is there anything to drain)
    try:
        serve.start(http_options={"host": opts.host, "port": opts.port})
        serve.run(app, name=opts.app_name, route_prefix=opts.route_prefix, blocking=False)
        shown = "127.0.0.1" if opts.host in ("0.0.0.0", "::") else opts.host
        url = f"http://{shown}:{opts.port}{opts.route_prefix.rstrip('/')}"
        key = cfg.router.api_keys[0] if cfg.router.api_keys else None
        wait_ready(url, opts.ready_timeout_s, key)
        base = url
        print(f"pdserve is ready at {base} (model {cfg.name!r}, mode {cfg.mode}). Try:\n")
        if key:
            print("API keys are on: export PDSERVE_API_KEY=<one of your keys> first.")
        print("  " + curl_example(base, cfg.name, "$PDSERVE_API_KEY" if key else None) + "\n")
        print("Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        if base is not None:
            _drain_before_stop(opts.app_name, base, cfg)
        print("stopping pdserve ...", flush=True)
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave replicas running.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            serve.shutdown()
        except Exception as e:  # Ray may already be going down; still stop it below
            print(f"serve.shutdown() failed: {e!r}", flush=True)
        finally:
            ray.shutdown()
            signal.signal(signal.SIGINT, previous)
