"""`make bench-interference`: do long prompts stall other users' decoding? Colocated vs chunked vs disaggregated.

Owns the interference proof: per mode (``default``: ``deploy/local.yaml`` as shipped, each request's
prefill path chosen at the router; ``colocated``: whole-prompt prefill in the decode engine;
``colocated-chunked``: 256 prompt tokens per step; ``disaggregated``: a prefill pool and a decode
pool) it starts ``pdserve serve --config`` its YAML (`MODES`) on a free port, warms it up,
then runs ``chat_users`` closed-loop chat streams (~100-token prompts, 128 tokens out, each user
sending its next request when its stream ends) through two phases: **chat only**, then **mixed**,
where a ~2,000-token prompt (64 tokens out) arrives every ``long_interval_s`` seconds. Every token
chunk's arrival time is recorded client-side; the ITL of the chat streams per phase (p50 / p99),
their TTFT, TPOT, and the long prompts' TTFT are reported per mode, with the issue's targets.

Writes ``results/interference.json`` (schema `loadtests.schemas.INTERFERENCE_SCHEMA`) and
``results/interference.png`` (one subplot per mode: every chat token gap vs time, long-prompt
arrivals as vertical lines; `loadtests.interference_plot`). The results builder (`mode_result`,
`build_doc`) and the plot are pure functions of the records, so tests run them on synthetic samples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
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
    replica_affinity,
    result_doc,
    server_metrics,
    summarize,
    warm_up,
    write_result,
    yaml_config,
)
from loadtests.interference_plot import fmt_ms, plot
from loadtests.profiles import Workload, chat_body
from loadtests.schemas import INTERFERENCE_SCHEMA

MODES: dict[str, str] = {
    "default": "deploy/local.yaml",
    "colocated": "deploy/bench-colocated.yaml",
    "colocated-chunked": "deploy/bench-colocated-chunked.yaml",
    "disaggregated": "deploy/bench-disaggregated.yaml",
}
SETUP_TEXT = ("2-core CPU machine, SmolLM2-135M; default: deploy/local.yaml as shipped (its dtype, per-request "
              "prefill path, no pinning); the bench YAMLs fp32, disaggregated: prefill process pinned to core 0, "
              "decode process to core 1, 1 torch thread each; colocated: one engine on cores [0,1] with 2 threads; "
              "router, Serve proxy, Ray and this load generator unpinned")


@dataclass(frozen=True)
class Plan:
    chat_users: int = 8
    chat_prompt_tokens: int = 100
    chat_max_tokens: int = 128
    long_prompt_tokens: int = 2000
    long_max_tokens: int = 64
    long_interval_s: float = 6.0
    settle_s: float = 6.0  # users start staggered over this, before the chat-only window opens
    chat_only_s: float = 20.0
    mixed_s: float = 48.0
    seed: int = 0


@dataclass
class ModeRun:
    """What one mode's run produced (times relative to ``t0``, the start of the chat users)."""

    t0: float
    chat_only_start: float
    mixed_start: float
    end: float
    chat: list[RequestRecord] = field(default_factory=list)
    long: list[RequestRecord] = field(default_factory=list)
    server_metrics: dict[str, Any] = field(default_factory=dict)
    replica_affinity: dict[str, Any] = field(default_factory=dict)
    load_avg_1m: float | None = None  # at the end of the run: what else was loading the machine


async def drive(base_url: str, plan: Plan) -> ModeRun:
    """Warm up, then the chat users through both phases with the long prompts in the second."""
    limits = httpx.Limits(max_connections=plan.chat_users + 64, max_keepalive_connections=plan.chat_users + 64)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        await warm_up(client, plan.chat_users, plan.long_prompt_tokens)
        t0 = time.perf_counter()
        run = ModeRun(t0=t0, chat_only_start=t0 + plan.settle_s, mixed_start=t0 + plan.settle_s + plan.chat_only_s,
                      end=t0 + plan.settle_s + plan.chat_only_s + plan.mixed_s)
        chat = Workload("chat", plan.chat_prompt_tokens, plan.chat_max_tokens)
        long = Workload("long", plan.long_prompt_tokens, plan.long_max_tokens)

        async def user(i: int) -> None:
            rng = random.Random(f"{plan.seed}-chat-{i}")
            await asyncio.sleep(i * plan.settle_s / max(1, plan.chat_users))
            while time.perf_counter() < run.end:
                body = chat_body(MODEL, chat, rng)
                rec = new_record("chat", body, user=i, prompt_tokens=chat.prompt_tokens)
                run.chat.append(rec)
                await fill_stream(client, body, rec)
                if rec.error is not None:
                    await asyncio.sleep(0.5)  # a failing server must not turn this into a busy loop

        async def long_prompts() -> None:
            rng = random.Random(f"{plan.seed}-long")
            await asyncio.sleep(max(0.0, run.mixed_start - time.perf_counter()))
            tasks = []
            k = 0
            while (at := run.mixed_start + k * plan.long_interval_s) < run.end:
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                body = chat_body(MODEL, long, rng)
                rec = new_record("long", body, prompt_tokens=long.prompt_tokens)
                run.long.append(rec)
                tasks.append(asyncio.create_task(fill_stream(client, body, rec)))
                k += 1
            await asyncio.gather(*tasks)

        tasks = [asyncio.create_task(user(i)) for i in range(plan.chat_users)]
        tasks.append(asyncio.create_task(long_prompts()))
        await asyncio.sleep(max(0.0, run.end - time.perf_counter()))
        for t in tasks:  # streams still open at the end are cut; their tokens so far count
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    return run


def _ms(xs: Sequence[float]) -> list[float]:
    return [x * 1000 for x in xs]


def phase_result(run: ModeRun, start: float, end: float, with_long: bool) -> dict[str, Any]:
    gaps = [g for r in run.chat for t, g in r.itls() if start <= t < end]
    tokens = sum(1 for r in run.chat for a in r.arrivals if start <= a < end)
    sent = [r for r in run.chat if start <= r.sent < end]
    out: dict[str, Any] = {
        "window_s": [round(start - run.t0, 3), round(end - run.t0, 3)],
        "chat_itl_ms": summarize(_ms(gaps)),
        "chat_ttft_ms": summarize(_ms([r.ttft for r in sent if r.ttft is not None])),
        "chat_tpot_ms": summarize(_ms([r.tpot for r in sent if r.tpot is not None])),
        "chat_requests": len(sent),
        "chat_tokens_per_s": round(tokens / max(1e-9, end - start), 3),
        "errors": sum(1 for r in sent if r.error is not None),
    }
    if with_long:
        longs = [r for r in run.long if start <= r.sent < end]
        out["long_ttft_ms"] = summarize(_ms([r.ttft for r in longs if r.ttft is not None]))
        out["long_itl_ms"] = summarize(_ms([g for r in longs for _, g in r.itls()]))
        out["long_sent"] = len(longs)
        out["long_first_token"] = sum(1 for r in longs if r.arrivals)
        out["errors"] += sum(1 for r in longs if r.error is not None)
    return out


def mode_result(run: ModeRun) -> dict[str, Any]:
    chat_only = phase_result(run, run.chat_only_start, run.mixed_start, with_long=False)
    mixed = phase_result(run, run.mixed_start, run.end, with_long=True)
    points = sorted((t - run.t0, g * 1000) for r in run.chat for t, g in r.itls() if t < run.end)
    return {
        "phases": {"chat_only": chat_only, "mixed": mixed},
        "chat_only_p99_itl_ms": chat_only["chat_itl_ms"]["p99"],
        "mixed_p99_itl_ms": mixed["chat_itl_ms"]["p99"],
        "server_metrics": run.server_metrics,
        "replica_affinity": run.replica_affinity,
        "load_avg_1m_end": run.load_avg_1m,
        "timeline": {
            "itl_t_s": [round(t, 3) for t, _ in points],
            "itl_ms": [round(g, 2) for _, g in points],
            "long_sent_s": [round(r.sent - run.t0, 3) for r in run.long],
            "long_first_token_s": [round(r.arrivals[0] - run.t0, 3) for r in run.long if r.arrivals],
            "chat_only_start_s": round(run.chat_only_start - run.t0, 3),
            "mixed_start_s": round(run.mixed_start - run.t0, 3),
            "end_s": round(run.end - run.t0, 3),
        },
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(modes: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The issues' targets (#33's for the default, the older three across modes), each with the measured
    value (None where a mode did not run)."""
    def p99(mode: str, key: str) -> float | None:
        m = modes.get(mode)
        return None if m is None else m[key]

    def ttft_p50(mode: str, phase: str) -> float | None:
        m = modes.get(mode)
        return None if m is None else m["phases"][phase]["chat_ttft_ms"]["p50"]

    dis_mixed, dis_alone = p99("disaggregated", "mixed_p99_itl_ms"), p99("disaggregated", "chat_only_p99_itl_ms")
    colo, chunked = p99("colocated", "mixed_p99_itl_ms"), p99("colocated-chunked", "mixed_p99_itl_ms")
    rows = [
        ("default_chat_ttft", "default: chat TTFT p50, mixed ÷ its chat-only value (≤ 2)",
         _ratio(ttft_p50("default", "mixed"), ttft_p50("default", "chat_only")), 2.0, "le"),
        ("default_isolation", "default: p99 ITL, mixed ÷ its chat-only p99 ITL (≤ 1.25)",
         _ratio(p99("default", "mixed_p99_itl_ms"), p99("default", "chat_only_p99_itl_ms")), 1.25, "le"),
        ("disaggregated_isolation", "disaggregated p99 ITL, mixed ÷ its own chat-only p99 ITL (≤ 1.25)",
         _ratio(dis_mixed, dis_alone), 1.25, "le"),
        ("colocated_vs_disaggregated", "colocated unchunked p99 ITL ÷ disaggregated p99 ITL, mixed load (≥ 5)",
         _ratio(colo, dis_mixed), 5.0, "ge"),
        ("chunked_vs_disaggregated", "colocated chunked p99 ITL ÷ disaggregated p99 ITL, mixed load (> 1)",
         _ratio(chunked, dis_mixed), 1.0, "gt"),
    ]
    out = []
    for name, desc, value, threshold, op in rows:
        met = None if value is None else {"le": value <= threshold, "ge": value >= threshold,
                                          "gt": value > threshold}[op]
        out.append({"name": name, "description": desc, "value": value, "threshold": threshold, "met": met})
    return out


def build_doc(runs: Mapping[str, ModeRun], plan: Plan, configs: Mapping[str, Any],
              machine_info: Mapping[str, Any] | None = None, note: str = "") -> dict[str, Any]:
    modes = {name: mode_result(run) for name, run in runs.items()}
    setup = {"description": SETUP_TEXT + (f"; {note}" if note else ""), "plan": asdict(plan),
             "modes": list(runs), "measured": "client side, per token chunk (httpx, one asyncio loop)"}
    return result_doc("interference", setup, configs, {"modes": modes, "targets": targets(modes)}, machine_info)


def run_mode(name: str, plan: Plan) -> ModeRun:
    config = REPO / MODES[name]
    log(f"{name}: starting pdserve serve --config {MODES[name]}")
    with ServerProcess(config) as server:
        log(f"{name}: ready at {server.base_url}; warm-up, then {plan.chat_only_s:g} s chat-only, "
            f"{plan.mixed_s:g} s mixed")
        run = asyncio.run(drive(server.base_url, plan))
        run.server_metrics = server_metrics(server.base_url)
        run.replica_affinity = replica_affinity(server)
        run.load_avg_1m = round(os.getloadavg()[0], 2)
    res = mode_result(run)
    log(f"{name}: p99 ITL chat-only {fmt_ms(res['chat_only_p99_itl_ms'])} ms, "
        f"mixed {fmt_ms(res['mixed_p99_itl_ms'])} ms")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--chat-only-s", type=float, default=Plan.chat_only_s)
    p.add_argument("--mixed-s", type=float, default=Plan.mixed_s)
    p.add_argument("--long-interval-s", type=float, default=Plan.long_interval_s)
    p.add_argument("--note", default="", help="appended to setup.description (e.g. what else was running)")
    p.add_argument("--out", type=Path, default=RESULTS / "interference.json")
    args = p.parse_args(argv)
    plan = Plan(chat_only_s=args.chat_only_s, mixed_s=args.mixed_s, long_interval_s=args.long_interval_s)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}")
    from loadtests.bench_common import machine

    info = machine()
    runs = {m: run_mode(m, plan) for m in modes}
    configs = {m: yaml_config(REPO / MODES[m]) for m in modes}
    doc = build_doc(runs, plan, configs, info, args.note)
    write_result(args.out, doc, INTERFERENCE_SCHEMA)
    plot(doc, args.out.with_suffix(".png"))
    for t in doc["results"]["targets"]:
        verdict = "n/a (a mode or phase without the figure)" if t["met"] is None else "met" if t["met"] else "MISSED"
        log(f"target {t['name']}: {t['value']} (threshold {t['threshold']}) → {verdict}")
    log(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
