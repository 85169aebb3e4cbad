"""`make bench-serving`: pdserve in each mode and vLLM's CPU build, driven by the same client.

Owns: the serving benchmark. For every server (the shipped disaggregated YAML, the colocated YAML,
any ``--config`` given, and vLLM's CPU build through `loadtests.vllm_peer` unless ``--no-vllm``) it
runs the same `loadtests.serving_client` levels (prompt length × output length × concurrent users,
closed loop, token-id prompts, ``ignore_eos``) and records TTFT / TPOT / ITL medians and output
tokens/s. Beside each pdserve figure stands the engine's own decode step at the same batch and
context, measured in a process configured like the YAML's decode pool (its dtype, threads and
cores) before any server starts, so the serving overhead is a number (``tpot / engine step``).

Output: ``results/serving.json`` (setup, YAMLs, every level of every server, the targets of issue
#24 with their verdicts) and ``results/serving.png`` (TPOT and output tok/s per level and server).

Invariants: servers run one at a time on the same machine; every server gets byte-identical
requests (same seeds); a peer that cannot be installed or started is skipped with its reason in
the JSON, never reported as a zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests.bench_common import (
    MODEL,
    REPO,
    RESULTS,
    ServerProcess,
    log,
    machine,
    metric_totals,
    result_doc,
    write_result,
    yaml_config,
)
from loadtests.schemas import SERVING_SCHEMA
from loadtests.serving_client import Level, random_prompts, run_level
from loadtests.vllm_peer import VENV as VLLM_VENV

#: the shipped layouts compared: name -> YAML
PDSERVE_CONFIGS = {"disaggregated": "deploy/local.yaml", "colocated": "deploy/local-colocated.yaml"}

FULL_LEVELS = (
    Level(128, 64, 1, 6), Level(128, 64, 8, 24), Level(128, 64, 32, 64),
    Level(1024, 32, 1, 4), Level(1024, 32, 8, 16), Level(4000, 32, 1, 2),
)
QUICK_LEVELS = (Level(128, 64, 1, 4), Level(128, 64, 8, 16), Level(1024, 32, 1, 3))
SEED = 2024
STATS_LAG_S = 2.5  # > the replicas' routing-stats period (1 s in the shipped YAMLs), which carries the counters


# -- the engine's own step, in a process configured like the decode pool -------------------------

def engine_steps(config: str, levels: Sequence[Level], repeats: int = 9) -> dict[str, Any]:
    """Median decode step (ms) per (batch, context) of ``levels`` and the 1,024-token prefill, in a
    subprocess with the YAML's decode-pool engine settings (dtype, threads, affinity)."""
    shapes = sorted({(lv.users, lv.prompt_len + lv.output_len // 2) for lv in levels})
    cmd = [sys.executable, "-m", "loadtests.bench_serving", "--engine-steps-of", config,
           "--shapes", json.dumps(shapes), "--repeats", str(repeats)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"engine step run failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _engine_steps_main(config: str, shapes: list[tuple[int, int]], repeats: int) -> None:
    import torch

    from cluster.config import ClusterConfig, Environment
    from engine.engine import Engine
    from loadtests import bench_engine as be

    cfg = ClusterConfig.from_yaml(REPO / config, Environment())
    ec = cfg.decode_worker_config().engine
    if ec.num_threads:
        torch.set_num_threads(ec.num_threads)
    need = max(b * ((c + 2) // ec.block_size + 2) for b, c in shapes) + 8
    eng = Engine.load(cfg.model, _with_blocks(ec, max(need, 64)), cfg.model_cache_dir)
    steps = {f"{b}x{c}": round(be.bench_decode(eng, {"e": eng.runner}, b, c, repeats)["e"] * 1e3, 3)
             for b, c in shapes}
    prefill = round(be.bench_prefill(eng, eng.runner, 1024, 3) * 1e3, 1)
    print(json.dumps({"dtype": ec.dtype, "num_threads": ec.num_threads, "cpu_affinity": list(ec.cpu_affinity),
                      "decode_step_ms": steps, "prefill_1024_ms": prefill}))


def _with_blocks(ec: Any, n: int) -> Any:
    import dataclasses

    return dataclasses.replace(ec, num_blocks=max(ec.num_blocks or 0, n), max_num_seqs=max(ec.max_num_seqs, 64))


# -- one server ------------------------------------------------------------------------------------

_COUNTERS = tuple(f"pdserve:engine_{n}_total" for n in ("steps", "step_seconds", "step_sequences",
                                                         "step_cpu_seconds"))


def engine_counters(base_url: str) -> tuple[float, float, float, float] | None:
    """Decode-side engine steps, seconds in their forwards, sequences decoded and the model thread's
    CPU seconds, summed over the replicas in ``/metrics`` (pdserve only; None for other servers)."""
    totals = metric_totals(base_url, _COUNTERS)
    if not totals:
        return None
    steps, seconds, seqs, cpu = (totals.get(n, 0.0) for n in _COUNTERS)
    return steps, seconds, seqs, cpu


async def _run_levels(base_url: str, levels: Sequence[Level], vocab: int) -> list[dict[str, Any]]:
    warm = Level(128, 8, 4, 4)
    await run_level(base_url, MODEL, warm, random_prompts(4, 128, vocab, SEED - 1))
    out = []
    for i, lv in enumerate(levels):
        prompts = random_prompts(lv.num_requests, lv.prompt_len, vocab, SEED + i)
        await asyncio.sleep(STATS_LAG_S)  # the replicas' load reports catch up with the last level
        before = await asyncio.to_thread(engine_counters, base_url)
        res = (await run_level(base_url, MODEL, lv, prompts)).as_json()
        await asyncio.sleep(STATS_LAG_S)
        after = await asyncio.to_thread(engine_counters, base_url)
        if before is not None and after is not None and after[0] > before[0]:
            n = after[0] - before[0]
            res["in_server_step_ms"] = round((after[1] - before[1]) / n * 1e3, 3)
            res["in_server_batch"] = round((after[2] - before[2]) / n, 2)
            res["in_server_step_cpu_ms"] = round((after[3] - before[3]) / n * 1e3, 3)
        log(f"  {lv.name}: TTFT p50 {res['ttft_ms']['p50']} ms, TPOT p50 {res['tpot_ms']['p50']} ms, "
            f"{res['output_tok_s']} tok/s, in-server step {res.get('in_server_step_ms')} ms, "
            f"{res['num_errors']} errors")
        out.append(res)
    return out


def run_pdserve(config: str, levels: Sequence[Level], vocab: int) -> dict[str, Any]:
    log(f"pdserve {config}: engine step alone")
    steps = engine_steps(config, levels)
    log(f"pdserve {config}: serving")
    with ServerProcess(REPO / config) as srv:
        res = asyncio.run(_run_levels(srv.base_url, levels, vocab))
    for r in res:
        key = f"{r['users']}x{r['prompt_len'] + r['output_len'] // 2}"
        step = steps["decode_step_ms"].get(key)
        r["engine_step_ms"] = step
        tpot = r["tpot_ms"]["p50"]
        r["tpot_over_engine_step"] = round(tpot / step, 3) if step and tpot else None
        inside = r.get("in_server_step_ms")
        r["tpot_over_in_server_step"] = round(tpot / inside, 3) if inside and tpot else None
    return {"kind": "pdserve", "config": yaml_config(REPO / config), "engine": steps, "levels": res}


def run_vllm(levels: Sequence[Level], vocab: int, venv: Path) -> dict[str, Any]:
    from loadtests.vllm_peer import PeerUnavailable, VllmPeer

    try:
        peer = VllmPeer.prepare(venv)
    except PeerUnavailable as e:
        log(f"vLLM peer skipped: {e}")
        return {"kind": "vllm", "skipped": str(e)}
    log(f"vLLM {peer.version}: serving")
    try:
        with peer.serve() as base_url:
            res = asyncio.run(_run_levels(base_url, levels, vocab))
    except PeerUnavailable as e:
        log(f"vLLM peer skipped: {e}")
        return {"kind": "vllm", "skipped": str(e)}
    return {"kind": "vllm", "version": peer.version, "setup": peer.describe(), "levels": res}


# -- targets ---------------------------------------------------------------------------------------

def _level(server: dict[str, Any], prompt_len: int, users: int) -> dict[str, Any] | None:
    for r in server.get("levels", []):
        if r["prompt_len"] == prompt_len and r["users"] == users:
            return dict(r)
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def targets(servers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue #24's targets that this run's levels can judge; value and verdict None where a figure is missing."""
    out: list[dict[str, Any]] = []

    def add(name: str, description: str, value: float | None, threshold: float, at_most: bool) -> None:
        met = None if value is None else (value <= threshold if at_most else value >= threshold)
        out.append({"name": name, "description": f"{description} ({'<=' if at_most else '>='} {threshold:g})",
                    "value": value, "threshold": threshold, "met": met})

    def p50(server: str, metric: str, prompt_len: int, users: int) -> float | None:
        lv = _level(servers.get(server, {}), prompt_len, users)
        if lv is None:
            return None
        return lv["output_tok_s"] if metric == "output_tok_s" else lv[metric]["p50"]

    for mode in PDSERVE_CONFIGS:
        for users in (1, 8):
            lv = _level(servers.get(mode, {}), 128, users)
            add(f"{mode}_tpot_over_engine_step_{users}u", f"{mode}: TPOT / the engine's own step, {users} user(s)",
                lv["tpot_over_engine_step"] if lv else None, 1.15, True)
    v = "vllm"
    add("colocated_ttft_1024_vs_vllm", "colocated vs vLLM: TTFT at 1,024 tokens, 1 user",
        _ratio(p50("colocated", "ttft_ms", 1024, 1), p50(v, "ttft_ms", 1024, 1)), 1.0, True)
    add("colocated_tpot_1u_vs_vllm", "colocated vs vLLM: TPOT, 1 user",
        _ratio(p50("colocated", "tpot_ms", 128, 1), p50(v, "tpot_ms", 128, 1)), 1.0, True)
    add("colocated_tok_s_8u_vs_vllm", "colocated vs vLLM: output tok/s, 8 users",
        _ratio(p50("colocated", "output_tok_s", 128, 8), p50(v, "output_tok_s", 128, 8)), 1.0, False)
    for users in (1, 8):
        add(f"disaggregated_tpot_{users}u_vs_vllm", f"disaggregated vs vLLM: TPOT, {users} user(s)",
            _ratio(p50("disaggregated", "tpot_ms", 128, users), p50(v, "tpot_ms", 128, users)), 1.0, True)
    add("disaggregated_tok_s_8u_vs_vllm", "disaggregated vs vLLM: output tok/s, 8 users",
        _ratio(p50("disaggregated", "output_tok_s", 128, 8), p50(v, "output_tok_s", 128, 8)), 1.0, False)
    add("disaggregated_ttft_1024_vs_vllm", "disaggregated vs vLLM: TTFT at 1,024 tokens, 1 user",
        _ratio(p50("disaggregated", "ttft_ms", 1024, 1), p50(v, "ttft_ms", 1024, 1)), 1.7, True)
    return out


# -- plot ------------------------------------------------------------------------------------------

def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = {k: s for k, s in doc["results"]["servers"].items() if s.get("levels")}
    names = [lv["name"] for lv in doc["setup"]["levels"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / max(1, len(servers))
    for i, (sname, s) in enumerate(servers.items()):
        by = {f"{r['prompt_len']}in-{r['output_len']}out-{r['users']}u": r for r in s["levels"]}
        xs = [j + i * width for j in range(len(names))]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "output_tok_s"), strict=True):
            vals = [(by[n]["output_tok_s"] if key == "output_tok_s" else by[n][key]["p50"]) if n in by else 0
                    for n in names]
            ax.bar(xs, [v or 0 for v in vals], width, label=sname)
        if s["kind"] == "pdserve":
            steps = [by[n].get("engine_step_ms") if n in by else None for n in names]
            axes[1].scatter([x for x, st in zip(xs, steps, strict=True) if st],
                            [st for st in steps if st], marker="_", s=200, color="black", zorder=3)
    titles = ("TTFT p50 (ms)", "TPOT p50 (ms); black bars: the engine's own step", "output tokens/s")
    for ax, t in zip(axes, titles, strict=True):
        ax.set_title(t, fontsize=10)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log" if t.startswith("TTFT") else "linear")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"pdserve vs vLLM CPU, SmolLM2-135M, {doc['created'][:16]} UTC", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="three short levels (a few minutes)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=YAML",
                    help="another pdserve layout to measure (repeatable)")
    ap.add_argument("--only", default="", help="comma-separated server names to run (default: all)")
    ap.add_argument("--no-vllm", action="store_true", help="leave the vLLM peer out")
    ap.add_argument("--vllm-venv", default=str(VLLM_VENV), help="where vLLM's CPU build is (installed there once)")
    ap.add_argument("--out", default=str(RESULTS / "serving.json"))
    ap.add_argument("--note", default="")
    ap.add_argument("--engine-steps-of", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=9, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_steps_of:
        _engine_steps_main(args.engine_steps_of, [tuple(s) for s in json.loads(args.shapes)], args.repeats)
        return 0
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    levels = QUICK_LEVELS if args.quick else FULL_LEVELS
    configs = dict(PDSERVE_CONFIGS)
    configs.update(dict(c.split("=", 1) for c in args.config))
    only = {s for s in args.only.split(",") if s}
    vocab = _vocab_size()
    started = time.time()
    info = machine()
    servers: dict[str, dict[str, Any]] = {}
    for name, cfg in configs.items():
        if not only or name in only:
            servers[name] = run_pdserve(cfg, levels, vocab)
    if not args.no_vllm and (not only or "vllm" in only):
        servers["vllm"] = run_vllm(levels, vocab, Path(args.vllm_venv))
    setup = {"description": "closed-loop streamed /v1/completions (token-id prompts, ignore_eos, greedy) "
                            "against each server in turn on this machine (loadtests.serving_client)",
             "levels": [{"name": lv.name, **lv.__dict__} for lv in levels], "seed": SEED, "note": args.note,
             "wall_s": round(time.time() - started, 1), "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
    config = {name: s["config"] for name, s in servers.items() if "config" in s}
    doc = result_doc("serving", setup, config, {"servers": servers, "targets": targets(servers)}, info)
    out = write_result(Path(args.out), doc, SERVING_SCHEMA)
    plot(doc, out.with_suffix(".png"))
    for t in doc["results"]["targets"]:
        log(f"{'MET ' if t['met'] else 'MISS' if t['met'] is False else 'n/a '} {t['description']}: {t['value']}")
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _vocab_size() -> int:
    from engine.loading.bundled import prepare_model
    from engine.model.config import ModelConfig

    return ModelConfig.from_dir(prepare_model(MODEL, progress=False)).vocab_size


if __name__ == "__main__":
    raise SystemExit(main())
