"""`make bench-goodput`: per server, the share of requests within both objectives over a sweep of offered rates.

Owns the goodput benchmark's run: objectives first (one request at a time on the baseline server, by
default always-remote disaggregated: 3x each class's lone TTFT, 3x the lone chat TPOT; or given with
``--slo-ms``), then for each server of `loadtests.goodput_servers.SERVERS` in turn: start it (pdserve
with those objectives in its YAML), warm it up, and for each rate of the `Sweep` send the seeded
open-loop schedule (`loadtests.goodput_schedule`) over the rate's window, wait ``drain_s`` for the
requests in flight, cut the rest (they count as missed), and wait for the server to go idle before the
next rate. For pdserve it reads the path decisions and the router's own judgement from ``/metrics``
before and after each rate.

Writes ``results/goodput.json`` (`loadtests.goodput_schema.GOODPUT_SCHEMA`: per server per rate the
attainment overall and per class, TTFT / TPOT / ITL percentiles, the path decisions, every request;
per server the knee; issue #33's targets) and ``results/goodput.png``, and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_common import (
    MODEL,
    REPO,
    RESULTS,
    fill_stream,
    log,
    machine,
    new_record,
    result_doc,
    stream_chat,
    wait_idle,
    warm_up,
    write_result,
    yaml_config,
)
from loadtests.goodput_plot import plot
from loadtests.goodput_results import SLO, TARGET, Baseline, RateRun, knee, rate_point, table, targets
from loadtests.goodput_schedule import Sweep, schedule
from loadtests.goodput_schema import GOODPUT_SCHEMA
from loadtests.goodput_servers import (
    SERVERS,
    Live,
    ServerSpec,
    counts_between,
    labelled_counts,
    pick,
    started,
    write_bench_yaml,
)
from loadtests.profiles import chat_body, get_profile
from loadtests.vllm_peer import VENV as VLLM_VENV
from loadtests.vllm_peer import PeerUnavailable

SMOKE = Sweep(rates=(0.25,), duration_s=8.0, min_requests=1, drain_s=30.0)
BASELINE_REPEATS = 3


@dataclass
class ServerRun:
    spec: ServerSpec
    config: Path | None = None  # the YAML it ran (pdserve)
    rates: list[RateRun] = field(default_factory=list)
    describe: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


def _client(base_url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits)


async def _lone(live: Live, sweep: Sweep, server: str) -> Baseline:
    """``BASELINE_REPEATS`` requests of each kind, one at a time, after a warm-up: the medians."""
    kinds = {w.name: w for w, _ in get_profile(sweep.profile).workloads}
    rng = random.Random(f"{sweep.seed}-baseline")
    async with _client(live.base_url) as client:
        await warm_up(client, 4, kinds["long"].prompt_tokens)
        recs = {k: [await stream_chat(client, chat_body(MODEL, kinds[k], rng), k) for _ in range(BASELINE_REPEATS)]
                for k in ("chat", "long")}
    bad = [r.error for rs in recs.values() for r in rs if not r.ok]
    if bad:
        raise RuntimeError(f"baseline on {server} failed: {bad[0]}")

    def med(xs: list[float | None]) -> float:
        return round(statistics.median(x * 1e3 for x in xs if x is not None), 3)

    return Baseline(med([r.ttft for r in recs["chat"]]), med([r.ttft for r in recs["long"]]),
                    med([r.tpot for r in recs["chat"]]), server)


def _scrape(live: Live, spec: ServerSpec) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    if spec.kind != "pdserve":
        return None, None
    return (labelled_counts(live.base_url, "pdserve:path_decisions_total", ("path", "reason")),
            labelled_counts(live.base_url, "pdserve:slo_requests_total", ("slo_class", "path", "attained")))


async def run_rate(client: httpx.AsyncClient, live: Live, spec: ServerSpec, rate: float, sweep: Sweep) -> RateRun:
    window = sweep.window_s(rate)
    arrivals = schedule(rate, window, sweep.profile, sweep.seed)
    before = await asyncio.to_thread(_scrape, live, spec)
    run = RateRun(rate=rate, window_s=window, t0=time.perf_counter())
    tasks = []
    for a in arrivals:
        await asyncio.sleep(max(0.0, run.t0 + a.at_s - time.perf_counter()))
        rec = new_record(a.workload.name, a.body, prompt_tokens=a.workload.prompt_tokens)
        run.records.append(rec)
        tasks.append(asyncio.create_task(fill_stream(client, a.body, rec)))
    await asyncio.sleep(max(0.0, run.t0 + window - time.perf_counter()))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=sweep.drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if not await wait_idle(live.base_url, timeout_s=90, names=live.load_gauges):
        log(f"  rate {rate:g}: still busy 90 s after the cut; the next rate starts anyway")
    after = await asyncio.to_thread(_scrape, live, spec)
    run.path_decisions, run.server_slo = counts_between(before[0], after[0]), counts_between(before[1], after[1])
    return run


async def _sweep(live: Live, spec: ServerSpec, sweep: Sweep) -> list[RateRun]:
    long = next(w for w, _ in get_profile(sweep.profile).workloads if w.name == "long")
    out = []
    async with _client(live.base_url) as client:
        await warm_up(client, 4, long.prompt_tokens)
        for rate in sweep.rates:
            out.append(await run_rate(client, live, spec, rate, sweep))
            r = out[-1]
            log(f"  {spec.name} at {rate:g}/s: {len(r.records)} sent over {r.window_s:g} s, "
                f"{sum(x.ok for x in r.records)} finished")
    return out


def measure_baseline(spec: ServerSpec, sweep: Sweep, dtype: str | None, vllm_venv: Path) -> Baseline:
    log(f"objectives: lone requests on {spec.name}")
    config = write_bench_yaml(spec, None, dtype, "baseline") if spec.kind == "pdserve" else None
    with started(spec, config, vllm_venv) as live:
        b = asyncio.run(_lone(live, sweep, spec.name))
    log(f"  baseline {b}")
    return b


def run_server(spec: ServerSpec, slo: SLO, sweep: Sweep, dtype: str | None, vllm_venv: Path) -> ServerRun:
    run = ServerRun(spec)
    if spec.kind == "pdserve":
        run.config = write_bench_yaml(spec, slo.objectives_section(sweep.profile), dtype, "sweep")
    log(f"{spec.name}: starting ({spec.config or 'vLLM CPU build'})")
    try:
        with started(spec, run.config, vllm_venv) as live:
            run.describe = live.describe
            run.rates = asyncio.run(_sweep(live, spec, sweep))
    except PeerUnavailable as e:
        log(f"{spec.name} skipped: {e}")
        run.skipped = str(e)
    return run


def build_doc(runs: Sequence[ServerRun], slo: SLO, baseline: Baseline | None, sweep: Sweep, dtype: str | None,
              machine_info: dict[str, Any] | None = None, note: str = "") -> dict[str, Any]:
    servers: dict[str, Any] = {}
    for r in runs:
        points = [rate_point(x, slo) for x in r.rates]
        servers[r.spec.name] = {"kind": r.spec.kind, "prefill_path": r.spec.prefill_path, "describe": r.describe,
                                "rates": points, "knee_rps": knee(points, TARGET),
                                **({"skipped": r.skipped} if r.skipped else {})}
    mix = ", ".join(f"{wt:.0%} {w.name} {w.prompt_tokens} → {w.max_tokens} tokens"
                    for w, wt in get_profile(sweep.profile).workloads)
    setup = {"description": f"open loop, Poisson arrivals, {mix} (stratified), the same seeded schedule for "
                            f"every server, one after another, one client (httpx, streamed chat completions); "
                            f"pdserve engine dtype {dtype or 'as each YAML says'}" + (f"; {note}" if note else ""),
             "sweep": {**asdict(sweep), "rates": list(sweep.rates)},
             "windows_s": {f"{r:g}": round(sweep.window_s(r), 3) for r in sweep.rates},
             "servers": [r.spec.name for r in runs], "dtype": dtype, "target_attainment": TARGET}
    configs = {r.spec.name: {**yaml_config(r.config), "source": r.spec.config} for r in runs if r.config is not None}
    results = {"slo": slo.as_json(), "baseline": None if baseline is None else asdict(baseline),
               "servers": servers, "targets": targets(servers)}
    return result_doc("goodput", setup, configs, results, machine_info)


def _slo_given(text: str) -> SLO:
    try:
        chat, long, tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--slo-ms takes CHAT_TTFT,LONG_TTFT,TPOT in ms, got {text!r}") from None
    return SLO(chat, long, tpot, "given on the command line (--slo-ms)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of: " + ", ".join(SERVERS))
    p.add_argument("--rates", default=None, help="requests/s, comma-separated (default "
                   + ",".join(f"{r:g}" for r in Sweep.rates) + ")")
    p.add_argument("--duration", type=float, default=Sweep.duration_s, help="shortest window per rate (s)")
    p.add_argument("--min-requests", type=int, default=Sweep.min_requests, help="a rate's window holds this many")
    p.add_argument("--drain", type=float, default=Sweep.drain_s, help="s after a window for requests in flight")
    p.add_argument("--smoke", action="store_true", help=f"one rate ({SMOKE.rates[0]:g}/s) for "
                   f"{SMOKE.duration_s:g} s per server: proves the harness, measures nothing")
    p.add_argument("--slo-ms", default=None, help="CHAT_TTFT,LONG_TTFT,TPOT objectives in ms (skips the baseline)")
    p.add_argument("--baseline-server", default="remote", help="where the lone requests run (default: remote)")
    p.add_argument("--slo-scale", type=float, default=3.0, help="objectives = this × the lone baseline")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "yaml"),
                   help="every pdserve server's engine dtype (yaml: as each YAML says)")
    p.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    p.add_argument("--note", default="", help="appended to setup.description (e.g. what else was running)")
    p.add_argument("--out", type=Path, default=RESULTS / "goodput.json")
    args = p.parse_args(argv)
    try:
        specs, base = pick(args.servers), pick(args.baseline_server)[0]
        sweep = SMOKE if args.smoke else Sweep(duration_s=args.duration, min_requests=args.min_requests,
                                               drain_s=args.drain)
        if args.rates:
            sweep = replace(sweep, rates=tuple(float(r) for r in args.rates.split(",") if r.strip()))
        given = _slo_given(args.slo_ms) if args.slo_ms else None
    except ValueError as e:
        p.error(str(e))
    needed = [*specs, *([] if given else [base])]
    missing = sorted({f"{s.name} ({s.config})" for s in needed if s.config and not (REPO / s.config).exists()})
    if missing:  # refused before an hour of other servers, not when the sweep reaches them
        p.error(f"no YAML for {', '.join(missing)}; leave them out with --servers / --baseline-server")
    dtype = None if args.dtype == "yaml" else args.dtype
    info = machine()
    baseline: Baseline | None = None
    if given is None:
        baseline = measure_baseline(base, sweep, dtype, args.vllm_venv)
        slo = SLO.from_baseline(baseline, args.slo_scale)
    else:
        slo = given
    log(f"objectives: TTFT chat {slo.chat_ttft_ms:g} ms, long {slo.long_ttft_ms:g} ms; TPOT {slo.tpot_ms:g} ms")
    runs = [run_server(s, slo, sweep, dtype, args.vllm_venv) for s in specs]
    doc = build_doc(runs, slo, baseline, sweep, dtype, info, args.note)
    write_result(args.out, doc, GOODPUT_SCHEMA)
    plot(doc, args.out.with_suffix(".png"))
    print(table(doc["results"]["servers"]))
    for t in doc["results"]["targets"]:
        log(f"{'MET ' if t['met'] else 'MISS' if t['met'] is False else 'n/a '} {t['description']}: {t['value']}")
    log(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
