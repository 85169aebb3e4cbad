"""`make bench-goodput`: requests/s that meet both a TTFT and a TPOT SLO, per mode, over a request-rate sweep.

Owns the goodput benchmark: per mode (default ``colocated-chunked``, ``disaggregated``,
``colocated``) it starts ``pdserve serve --config deploy/bench-<mode>.yaml``, warms it up, measures
an **unloaded baseline** (chat requests one at a time, then one long prompt), then for each rate
sends the ``mixed`` profile open loop — Poisson arrivals, kinds in the profile's proportions
(stratified), the same seeded schedule of arrival times, kinds and prompts for every mode — for
``window_s`` seconds, waits up to ``drain_s`` for the requests in flight, cuts the rest (they count
as missing their SLOs) and waits for the replicas to go idle before the next rate.

SLOs are fixed after every mode ran, from the baselines: TTFT target = ``ttft_scale`` × the best
(lowest across modes) unloaded TTFT of that request kind; TPOT target = ``tpot_scale`` × the best
unloaded chat TPOT. The JSON records them with that reason and every request's (kind, sent, TTFT,
TPOT, finished), so attainment can be recomputed for other targets.

Writes ``results/goodput.json`` (schema `loadtests.schemas.GOODPUT_SCHEMA`) and
``results/goodput.png`` (goodput and SLO attainment vs offered rate, one line per mode).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_common import (
    MODEL,
    REPO,
    RESULTS,
    RequestRecord,
    ServerProcess,
    fill_stream,
    log,
    new_record,
    result_doc,
    server_metrics,
    stream_chat,
    summarize,
    wait_idle,
    warm_up,
    write_result,
    yaml_config,
)
from loadtests.bench_interference import MODES, SETUP_TEXT
from loadtests.profiles import CHAT, LONG, Profile, Workload, chat_body, get_profile
from loadtests.schemas import GOODPUT_SCHEMA

DEFAULT_MODES = ("colocated-chunked", "disaggregated", "colocated")


@dataclass(frozen=True)
class Plan:
    rates: tuple[float, ...] = (0.25, 0.5, 1.0)
    window_s: float = 30.0
    drain_s: float = 40.0
    baseline_chat: int = 2
    profile: str = "mixed"
    ttft_scale: float = 5.0
    tpot_scale: float = 3.0
    seed: int = 0


@dataclass(frozen=True)
class Arrival:
    at_s: float
    workload: Workload
    body: dict[str, Any]


def schedule(rate: float, window_s: float, profile: str, seed: int) -> list[Arrival]:
    """Poisson arrivals at ``rate`` over ``window_s``, kinds in the profile's proportions, one seeded stream.

    Kinds are stratified, not drawn one by one: a 30 s window holds only a handful of requests, and
    independent 10% draws would often give a "mixed" window without a single long prompt.
    """
    rng = random.Random(f"{seed}-{rate}")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < window_s:
        times.append(t)
        t += rng.expovariate(rate)
    kinds = stratified(get_profile(profile), len(times), rng)
    return [Arrival(at, w, chat_body(MODEL, w, rng)) for at, w in zip(times, kinds, strict=True)]


def stratified(profile: Profile, n: int, rng: random.Random) -> list[Workload]:
    """``n`` workloads in the profile's proportions (each kind at least once when n allows), shuffled."""
    weighted = sorted(profile.workloads, key=lambda x: -x[1])
    total = sum(wt for _, wt in weighted)
    counts = [max(1, round(n * wt / total)) if n >= len(weighted) else 0 for _, wt in weighted]
    counts[0] += n - sum(counts)  # the most common kind absorbs the rounding
    out = [w for (w, _), c in zip(weighted, counts, strict=True) for _ in range(c)]
    rng.shuffle(out)
    return out


@dataclass
class RateRun:
    rate: float
    window_s: float
    records: list[RequestRecord] = field(default_factory=list)
    t0: float = 0.0


@dataclass
class ModeRun:
    baseline: dict[str, float | None]
    rates: list[RateRun] = field(default_factory=list)
    server_metrics: dict[str, Any] = field(default_factory=dict)
    load_avg_1m: float | None = None


async def baseline(client: httpx.AsyncClient, plan: Plan) -> dict[str, float | None]:
    """One request at a time: ``baseline_chat`` chat requests, then one long prompt."""
    rng = random.Random(f"{plan.seed}-baseline")
    chats = [await stream_chat(client, chat_body(MODEL, CHAT, rng), "chat") for _ in range(plan.baseline_chat)]
    long = await stream_chat(client, chat_body(MODEL, LONG, rng), "long")

    def med(xs: list[float | None]) -> float | None:
        vals = [x * 1000 for x in xs if x is not None]
        return round(statistics.median(vals), 3) if vals else None

    return {"chat_ttft_ms": med([r.ttft for r in chats]), "chat_tpot_ms": med([r.tpot for r in chats]),
            "long_ttft_ms": med([long.ttft])}


async def run_rate(client: httpx.AsyncClient, base_url: str, rate: float, plan: Plan) -> RateRun:
    arrivals = schedule(rate, plan.window_s, plan.profile, plan.seed)
    run = RateRun(rate=rate, window_s=plan.window_s, t0=time.perf_counter())
    tasks: list[asyncio.Task[RequestRecord]] = []
    for a in arrivals:
        await asyncio.sleep(max(0.0, run.t0 + a.at_s - time.perf_counter()))
        rec = new_record(a.workload.name, a.body, prompt_tokens=a.workload.prompt_tokens)
        run.records.append(rec)
        tasks.append(asyncio.create_task(fill_stream(client, a.body, rec)))
    await asyncio.sleep(max(0.0, run.t0 + plan.window_s - time.perf_counter()))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=plan.drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if not await wait_idle(base_url, timeout_s=60):
        log(f"rate {rate:g}: replicas still busy 60 s after the cut; the next rate starts anyway")
    return run


async def drive(base_url: str, plan: Plan) -> ModeRun:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        await warm_up(client, 4, LONG.prompt_tokens)
        mode = ModeRun(baseline=await baseline(client, plan))
        for rate in plan.rates:
            mode.rates.append(await run_rate(client, base_url, rate, plan))
            r = mode.rates[-1]
            log(f"  rate {rate:g}/s: {len(r.records)} sent, {sum(x.ok for x in r.records)} finished")
    return mode


# ---- results (pure) ----

def slos(baselines: Mapping[str, Mapping[str, float | None]], plan: Plan) -> dict[str, Any]:
    def best(key: str) -> float:
        vals = [b[key] for b in baselines.values() if b.get(key) is not None]
        if not vals:
            raise ValueError(f"no mode measured a baseline {key}")
        return min(v for v in vals if v is not None)

    def sig2(x: float) -> float:
        return float(f"{x:.2g}")

    ttft = {"chat": sig2(plan.ttft_scale * best("chat_ttft_ms")), "long": sig2(plan.ttft_scale * best("long_ttft_ms"))}
    tpot = sig2(plan.tpot_scale * best("chat_tpot_ms"))
    reason = (f"from the unloaded baseline (one request at a time) on this machine, best mode: TTFT ≤ "
              f"{plan.ttft_scale:g}× the best lone TTFT of the request's kind (a ~2,000-token prefill alone takes "
              f"seconds here, so one TTFT target for both kinds would fail every long prompt or excuse any chat "
              f"delay), room for a few requests of queueing; TPOT ≤ {plan.tpot_scale:g}× the best lone chat TPOT "
              f"(a decode batch of ~8 costs about twice a batch of 1 on these cores, plus headroom). Rounded to 2 "
              f"significant digits.")
    return {"ttft_ms": ttft, "tpot_ms": tpot, "reason": reason, "ttft_scale": plan.ttft_scale,
            "tpot_scale": plan.tpot_scale}


def rate_point(run: RateRun, slo: Mapping[str, Any]) -> dict[str, Any]:
    samples: list[list[Any]] = []
    ok_ttft = ok_tpot = ok_both = 0
    for r in run.records:
        ttft = None if r.ttft is None else round(r.ttft * 1000, 2)
        tpot = None if r.tpot is None else round(r.tpot * 1000, 2)
        samples.append([r.kind, round(r.sent - run.t0, 3), ttft, tpot, r.ok])
        t_ok = r.ok and ttft is not None and ttft <= slo["ttft_ms"][r.kind]
        p_ok = r.ok and (tpot is None or tpot <= slo["tpot_ms"])  # one-token outputs have no TPOT
        ok_ttft += t_ok
        ok_tpot += p_ok
        ok_both += t_ok and p_ok
    n = len(run.records)
    kinds = sorted({r.kind for r in run.records})
    return {
        "rate_rps": run.rate, "window_s": run.window_s, "sent": n, "finished": sum(r.ok for r in run.records),
        "attainment_ttft": round(ok_ttft / n, 4) if n else 0.0,
        "attainment_tpot": round(ok_tpot / n, 4) if n else 0.0,
        "attainment": round(ok_both / n, 4) if n else 0.0,
        "goodput_rps": round(ok_both / run.window_s, 4),
        "throughput_rps": round(sum(r.ok for r in run.records) / run.window_s, 4),
        "ttft_ms": {k: summarize([s[2] for s in samples if s[0] == k and s[2] is not None]) for k in kinds},
        "tpot_ms": {k: summarize([s[3] for s in samples if s[0] == k and s[3] is not None]) for k in kinds},
        "samples": samples,
    }


def build_doc(runs: Mapping[str, ModeRun], plan: Plan, configs: Mapping[str, Any],
              machine_info: Mapping[str, Any] | None = None, note: str = "") -> dict[str, Any]:
    slo = slos({m: r.baseline for m, r in runs.items()}, plan)
    modes = {m: {"baseline": r.baseline, "rates": [rate_point(x, slo) for x in r.rates],
                 "server_metrics": r.server_metrics, "load_avg_1m_end": r.load_avg_1m} for m, r in runs.items()}
    setup = {"description": SETUP_TEXT + "; open loop, Poisson arrivals, mixed profile (90% chat 100→128 tokens, "
                            "10% long 2,000→64 tokens, stratified), same seeded schedule for every mode"
                            + (f"; {note}" if note else ""),
             "plan": asdict(plan), "modes": list(runs)}
    return result_doc("goodput", setup, configs, {"slo": slo, "modes": modes}, machine_info)


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates: list[float] = []
    for name, m in res["modes"].items():
        xs = [p["rate_rps"] for p in m["rates"]]
        rates += xs
        ax1.plot(xs, [p["goodput_rps"] for p in m["rates"]], marker="o", label=name)
        ax2.plot(xs, [p["attainment"] * 100 for p in m["rates"]], marker="o", label=name)
    if rates:
        ax1.plot([0, max(rates)], [0, max(rates)], color="0.7", ls="--", lw=1, label="offered rate")
    ax1.set(xlabel="offered rate (requests/s)", ylabel="goodput (requests/s meeting both SLOs)", title="Goodput")
    ax2.set(xlabel="offered rate (requests/s)", ylabel="requests meeting both SLOs (%)", title="SLO attainment",
            ylim=(-3, 103))
    for ax in (ax1, ax2):
        ax.set_xlim(left=0, right=max(rates, default=1.0) * 1.08)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    slo = res["slo"]
    machine = doc["machine"]
    fig.suptitle(textwrap.fill(
        f"mixed profile, open loop — SLO: TTFT ≤ {slo['ttft_ms']['chat']:g} ms (chat) / {slo['ttft_ms']['long']:g} ms "
        f"(long), TPOT ≤ {slo['tpot_ms']:g} ms — {machine.get('cpu', '?')}, {machine.get('cpus', '?')} cores; "
        + doc["setup"]["description"], 160), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_mode(name: str, plan: Plan) -> ModeRun:
    log(f"{name}: starting pdserve serve --config {MODES[name]}")
    with ServerProcess(REPO / MODES[name]) as server:
        log(f"{name}: ready at {server.base_url}; warm-up, baseline, rates {plan.rates}")
        run = asyncio.run(drive(server.base_url, plan))
        run.server_metrics = server_metrics(server.base_url)
        run.load_avg_1m = round(os.getloadavg()[0], 2)
    log(f"{name}: baseline {run.baseline}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in Plan.rates), help="requests/s, comma-separated")
    p.add_argument("--window-s", type=float, default=Plan.window_s)
    p.add_argument("--drain-s", type=float, default=Plan.drain_s)
    p.add_argument("--note", default="", help="appended to setup.description (e.g. what else was running)")
    p.add_argument("--out", type=Path, default=RESULTS / "goodput.json")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(modes) - set(MODES))}")
    plan = Plan(rates=tuple(float(r) for r in args.rates.split(",")), window_s=args.window_s, drain_s=args.drain_s)
    from loadtests.bench_common import machine

    info = machine()
    runs = {m: run_mode(m, plan) for m in modes}
    doc = build_doc(runs, plan, {m: yaml_config(REPO / MODES[m]) for m in modes}, info, args.note)
    write_result(args.out, doc, GOODPUT_SCHEMA)
    plot(doc, args.out.with_suffix(".png"))
    slo = doc["results"]["slo"]
    log(f"SLO: TTFT {slo['ttft_ms']} ms, TPOT {slo['tpot_ms']} ms")
    for m, r in doc["results"]["modes"].items():
        log(f"{m}: " + ", ".join(f"{p['rate_rps']:g}/s → goodput {p['goodput_rps']:.2f}/s ({p['attainment']:.0%})"
                                 for p in r["rates"]))
    log(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
