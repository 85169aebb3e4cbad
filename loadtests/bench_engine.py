"""`make bench-engine`: prefill and decode speed of the engine vs transformers, with this machine's limits.

Writes ``results/engine.json`` (schema: `loadtests.schemas.ENGINE_SCHEMA`) and ``results/engine.png``.
Medians of repeated runs; every ratio divides numbers measured in this same run: the matmul peak
and matrix-vector read bandwidth (`loadtests.machine`; the decode targets use the same matrix-vector
product timed between each config's decode steps, so host-wide bandwidth drift hits both alike),
transformers on the same weights, and the bf16 engine next to its int8 twin. Sections: limits,
per-dtype prefill/decode/transformers, int8 (speed; greedy agreement and log-likelihood from
`loadtests.int8_accuracy`), a `torch.profiler` summary of decode steps, targets.

FLOPs are the useful ones: every token's layer matmuls, causal attention over the keys each query
sees, and the lm_head for the one row whose logits a prefill returns (transformers is asked for the
same one row, ``logits_to_keep=1``). ``--quick`` runs tiny sizes for a smoke test.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVCache
from engine.loading.weights import load_weights
from engine.model.model import build_model
from engine.runner import DecodeSeq, ModelRunner, PrefillChunk
from loadtests import machine as mach
from loadtests.int8_accuracy import int8_accuracy, prompt_ids, text_ids


@dataclass(frozen=True)
class Sizes:
    prefill: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    gen_tokens: int  # greedy continuation length for the int8 agreement check


FULL = Sizes(prefill=(128, 512, 2048), batches=(1, 8, 32), contexts=(256, 1024), gen_tokens=64)
QUICK = Sizes(prefill=(16, 64), batches=(1, 4), contexts=(16, 48), gen_tokens=8)


def useful_flops(eng: Engine, n: int) -> float:
    """FLOPs a prefill of ``n`` tokens (from position 0, last row's logits) must do."""
    c = eng.model_config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    matmul = 2 * c.num_layers * per_layer * n + 2 * c.vocab_size * c.hidden_size
    attn = 2 * 2 * c.num_layers * c.q_size * n * (n + 1) / 2  # QK and PV over the keys each query sees
    return float(matmul + attn)


def _timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    return mach.median_time(fn, repeats, warmup)


def bench_prefill(eng: Engine, runner: ModelRunner, n: int, repeats: int) -> float:
    vocab = eng.model_config.vocab_size
    ids = torch.randint(3, min(1000, vocab), (n,), generator=torch.Generator().manual_seed(n)).tolist()
    blocks = eng.pool.allocate(eng.blocks_for(n))
    try:
        return _timed(lambda: runner.prefill([PrefillChunk(ids, 0, blocks)]), repeats)
    finally:
        eng.pool.free(blocks)


def _decode_seqs(eng: Engine, batch: int, context: int) -> list[DecodeSeq]:
    tables = [eng.pool.allocate(eng.blocks_for(context + 1)) for _ in range(batch)]
    return [DecodeSeq((100 + i) % eng.model_config.vocab_size, context, t) for i, t in enumerate(tables)]


def _free(eng: Engine, seqs: Sequence[DecodeSeq]) -> None:
    for s in seqs:
        eng.pool.free(list(s.block_table))


def bench_decode(eng: Engine, runners: dict[str, ModelRunner], batch: int, context: int, repeats: int,
                 probe: mach.MatvecProbe | None = None) -> dict[str, float]:
    """Median step seconds of each runner, interleaved step by step so load hits them alike; with a
    ``probe``, also the median seconds of its matrix-vector product, timed between the steps
    (key ``"matvec_probe"``: the faster kernel's per call; ``"matvec_probe_<kernel>"``: each kernel's)."""
    seqs = _decode_seqs(eng, batch, context)
    try:
        times: dict[str, list[float]] = {k: [] for k in runners}
        probe_s: list[float] = []
        by_kernel: dict[str, list[float]] = {}
        for r in runners.values():
            r.decode(seqs)
            r.decode(seqs)
        for _ in range(repeats):
            for k, r in runners.items():
                t0 = time.perf_counter()
                r.decode(seqs)
                times[k].append(time.perf_counter() - t0)
            if probe is not None:
                probe_s.append(probe())
                for name, sec in probe.last.items():
                    by_kernel.setdefault(name, []).append(sec)
        out = {k: statistics.median(v) for k, v in times.items()}
        if probe_s:
            out["matvec_probe"] = statistics.median(probe_s)
            out.update({f"matvec_probe_{name}": statistics.median(v) for name, v in by_kernel.items()})
        return out
    finally:
        _free(eng, seqs)


def profile_decode(eng: Engine, runner: ModelRunner, batch: int, context: int, steps: int = 3,
                   top: int = 10) -> dict[str, Any]:
    """Where a decode step's time goes: the top ops by self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    seqs = _decode_seqs(eng, batch, context)
    try:
        runner.decode(seqs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.decode(seqs)
    finally:
        _free(eng, seqs)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ops = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "calls_per_step": e.count / steps, "share": e.self_cpu_time_total / total} for e in events[:top]]
    return {"batch": batch, "context": context, "profiled_step_ms": total / 1e3 / steps, "top_ops": ops}


def bench_transformers(model_dir: Path, dtype: torch.dtype, sizes: Sizes, repeats: int) -> dict[str, Any]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    top = min(1000, hf.config.vocab_size)
    out: dict[str, Any] = {"prefill_s": {}, "decode_step_s": {}}
    # transformers 5.x names the KV cache argument and output `cache`, 4.x `past_key_values`.
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.inference_mode():
        for n in sizes.prefill:
            ids = torch.randint(3, top, (1, n))

            def prefill(ids: torch.Tensor = ids) -> None:
                hf(ids, logits_to_keep=1)

            out["prefill_s"][str(n)] = _timed(prefill, repeats)
        for batch in sizes.batches:
            for ctx in sizes.contexts:
                ids = torch.randint(3, top, (batch, ctx))
                past = getattr(hf(ids, use_cache=True, logits_to_keep=1), cache_kw)
                nxt = torch.randint(3, top, (batch, 1))

                def step(nxt: torch.Tensor = nxt, past: Any = past) -> None:
                    hf(nxt, use_cache=True, **{cache_kw: past})
                    past.crop(-1)  # drop the token just added: the context stays fixed across repeats

                out["decode_step_s"][f"{batch}x{ctx}"] = _timed(step, repeats)
    return out


# -- the run ----------------------------------------------------------------------------------------


def measure_limits(quick: bool) -> dict[str, float]:
    if not quick:
        lim = mach.measure_limits()
    else:
        lim = {"matmul_fp32_gflops": mach.matmul_peak_gflops(torch.float32, 256),
               "matmul_bf16_gflops": mach.matmul_peak_gflops(torch.bfloat16, 256),
               "read_gbs": mach.read_bandwidth_gbs(16 * 2**20),
               "matvec_fp32_gbs": mach.matvec_bandwidth_gbs(torch.float32, 1024, 1024),
               "matvec_bf16_gbs": mach.matvec_bandwidth_gbs(torch.bfloat16, 1024, 1024)}
    lim["matvec_best_gbs"] = max(lim["matvec_fp32_gbs"], lim["matvec_bf16_gbs"])
    return lim


def run_dtype(eng: Engine, limits: dict[str, float], sizes: Sizes, repeats: int, with_hf: bool,
              with_profile: bool) -> dict[str, Any]:
    dt = "bf16" if eng.config.torch_dtype == torch.bfloat16 else "fp32"
    runner, model = eng.runner, eng.runner.model
    wbytes = model.weight_nbytes()
    kv_tok = eng.model_config.kv_bytes_per_token(eng.config.torch_dtype)
    bw = limits[f"matvec_{dt}_gbs"] * 1e9
    # The floor's bandwidth again, timed between the decode steps themselves (`bench_decode`).
    probe = mach.MatvecProbe(eng.config.torch_dtype, 1024, 1024) if sizes is QUICK else mach.MatvecProbe(
        eng.config.torch_dtype)
    report = model.attention.report()
    out: dict[str, Any] = {"dtype": eng.config.dtype, "weight_bytes": wbytes, "kv_bytes_per_token": kv_tok,
                           "backend": report["backend"], "linear_kernels": report.get("linear_kernels", []),
                           "decode_attention": report.get("decode_attention"), "prefill": [], "decode": []}
    for n in sizes.prefill:
        t = bench_prefill(eng, runner, n, repeats)
        gflops = useful_flops(eng, n) / t / 1e9
        out["prefill"].append({"tokens": n, "seconds": t, "tokens_per_s": n / t, "gflops": gflops,
                               "peak_fraction": gflops / limits[f"matmul_{dt}_gflops"]})
    for batch in sizes.batches:
        for ctx in sizes.contexts:
            res = bench_decode(eng, {"x": runner}, batch, ctx, repeats, probe)
            t = res["x"]
            floor = wbytes / bw
            kv = batch * (ctx + 1) * kv_tok
            side: dict[str, float] = {}
            if "matvec_probe" in res:
                bw_side = probe.nbytes / res["matvec_probe"]
                side = {"matvec_gbs_interleaved": bw_side / 1e9, "vs_weight_floor_interleaved": t / (wbytes / bw_side),
                        **{f"matvec_{name}_gbs_interleaved": probe.nbytes / res[f"matvec_probe_{name}"] / 1e9
                           for name in probe.kernels}}
            out["decode"].append({
                "batch": batch, "context": ctx, "step_ms": t * 1e3, "tokens_per_s": batch / t,
                "weight_floor_ms": floor * 1e3, "vs_weight_floor": t / floor, **side,
                "vs_weight_floor_best_bw": t / (wbytes / (limits["matvec_best_gbs"] * 1e9)),
                "weight_kv_floor_ms": (wbytes + kv) / bw * 1e3,
            })
    del probe
    if with_hf:
        out["transformers"] = bench_transformers(eng.model_dir, eng.config.torch_dtype, sizes, repeats)
    if with_profile:
        out["profile"] = [profile_decode(eng, runner, 1, sizes.contexts[0]),
                          profile_decode(eng, runner, sizes.batches[-1], sizes.contexts[-1])]
    return out


def run_int8(eng: Engine, base_run: dict[str, Any], sizes: Sizes, repeats: int, with_profile: bool
             ) -> dict[str, Any]:
    """int8 (bf16 activations) next to the unquantized engine ``eng``, sharing its cache."""
    cfg, dtype = eng.model_config, eng.config.torch_dtype
    model = build_model(cfg, load_weights(eng.model_dir, cfg, dtype), eng.max_model_len,
                        replace(eng.config, quantization="int8"))
    q8 = ModelRunner(model, eng.cache)
    out: dict[str, Any] = {"base_dtype": eng.config.dtype, "weight_bytes": model.weight_nbytes(),
                           "base_weight_bytes": base_run["weight_bytes"], "decode": []}
    for batch, ctx in [(1, c) for c in sizes.contexts] + [(sizes.batches[-1], sizes.contexts[-1])]:
        t = bench_decode(eng, {"base": eng.runner, "int8": q8}, batch, ctx, repeats)
        out["decode"].append({"batch": batch, "context": ctx, "step_ms": t["int8"] * 1e3,
                              "base_step_ms": t["base"] * 1e3, "tokens_per_s": batch / t["int8"],
                              "vs_base": t["int8"] / t["base"]})
    out["prefill"] = [{"tokens": n, "seconds": bench_prefill(eng, q8, n, repeats)} for n in sizes.prefill[-1:]]
    fp32 = None
    if dtype != torch.float32:
        cfg32 = load_weights(eng.model_dir, cfg, torch.float32)
        need = max(len(p) for p in prompt_ids(eng, 24)) + sizes.gen_tokens + len(text_ids(eng))
        fp32 = ModelRunner(build_model(cfg, cfg32, eng.max_model_len, replace(eng.config, dtype="float32")),
                           KVCache.allocate(cfg, eng.blocks_for(need), eng.block_size, torch.float32))
    out["accuracy"] = int8_accuracy(eng, eng.runner, q8, sizes.gen_tokens, fp32)
    if with_profile:
        out["profile"] = [profile_decode(eng, q8, 1, sizes.contexts[0])]
    return out


def _target(name: str, description: str, value: float | None, threshold: float, direction: str
            ) -> dict[str, Any]:
    met = None if value is None else (value <= threshold if direction == "<=" else value >= threshold)
    return {"name": name, "description": description, "value": value, "threshold": threshold,
            "direction": direction, "met": met}


def targets(res: dict[str, Any], sizes: Sizes) -> list[dict[str, Any]]:
    out = []
    c0, c1, bmax = sizes.contexts[0], sizes.contexts[-1], sizes.batches[-1]
    for r in res["runs"]:
        dt = r["dtype"]
        d1 = next(d for d in r["decode"] if d["batch"] == 1 and d["context"] == c0)
        dmax = next(d for d in r["decode"] if d["batch"] == bmax and d["context"] == c1)
        out.append(_target(f"decode_b1_vs_weight_floor_{dt}",
                           f"decode step, batch 1, context {c0} ÷ (weight bytes ÷ the {dt} matvec bandwidth "
                           "timed between the same steps)",
                           d1.get("vs_weight_floor_interleaved", d1["vs_weight_floor"]), 1.5, "<="))
        hf = r.get("transformers", {}).get("decode_step_s", {})
        for d, thr in ((d1, 2.0), (dmax, 3.0)):
            key = f"{d['batch']}x{d['context']}"
            ratio = d["tokens_per_s"] / (d["batch"] / hf[key]) if key in hf else None
            out.append(_target(f"decode_b{d['batch']}_ctx{d['context']}_vs_transformers_{dt}",
                               f"decode tokens/s, batch {d['batch']}, context {d['context']} ÷ transformers'",
                               ratio, thr, ">="))
        for p, thr in zip(r["prefill"][-2:], (0.75, 0.60), strict=True):
            out.append(_target(f"prefill_{p['tokens']}_peak_fraction_{dt}",
                               f"prefill of {p['tokens']} tokens: useful GFLOP/s ÷ this run's {dt} matmul peak",
                               p["peak_fraction"], thr, ">="))
    if "int8" in res:
        q = res["int8"]
        d1 = next(d for d in q["decode"] if d["batch"] == 1 and d["context"] == c0)
        out.append(_target("int8_decode_b1_vs_base",
                           f"int8 decode step, batch 1, context {c0} ÷ the {q['base_dtype']} step (interleaved)",
                           d1["vs_base"], 0.6, "<="))
        out.append(_target("int8_greedy_agreement",
                           f"teacher-forced top-1 agreement with {q['base_dtype']} over {q['accuracy']['prompts']} "
                           f"prompts × {q['accuracy']['tokens_per_prompt']} greedy tokens",
                           q["accuracy"]["greedy_agreement"], 0.95, ">="))
    return out


def run(model: str, dtypes: list[str], sizes: Sizes, repeats: int, with_hf: bool, with_int8: bool,
        with_profile: bool, quick: bool) -> dict[str, Any]:
    loads = [os.getloadavg()[0]]
    res: dict[str, Any] = {"limits": measure_limits(quick), "runs": []}
    num_blocks = sizes.batches[-1] * (sizes.contexts[-1] // 16 + 2) + sizes.prefill[-1] // 16 + 64
    for dt in dtypes:
        eng = Engine.load(model, EngineConfig(dtype=dt, num_blocks=num_blocks, block_size=16))
        res["runs"].append(run_dtype(eng, res["limits"], sizes, repeats, with_hf, with_profile))
        loads.append(os.getloadavg()[0])
        if with_int8 and (dt in ("bfloat16", "bf16") or (dt == dtypes[-1] and "int8" not in res)):
            res["int8"] = run_int8(eng, res["runs"][-1], sizes, repeats, with_profile)
            loads.append(os.getloadavg()[0])
        del eng
    res["targets"] = targets(res, sizes)
    res["load_avg_1m"] = loads
    return res


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    res = doc["results"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in res["runs"]:
        ax1.plot([p["tokens"] for p in r["prefill"]], [p["tokens_per_s"] for p in r["prefill"]], "o-",
                 label=f"pdserve {r['dtype']}")
        hf = r.get("transformers", {})
        if hf:
            ax1.plot([int(k) for k in hf["prefill_s"]], [int(k) / v for k, v in hf["prefill_s"].items()], "x--",
                     label=f"transformers {r['dtype']}")
        for ctx in sorted({d["context"] for d in r["decode"]}):
            pts = [d for d in r["decode"] if d["context"] == ctx]
            ax2.plot([d["batch"] for d in pts], [d["tokens_per_s"] for d in pts], "o-",
                     label=f"pdserve {r['dtype']} ctx {ctx}")
            if hf:
                ax2.plot([d["batch"] for d in pts], [d["batch"] / hf["decode_step_s"][f"{d['batch']}x{ctx}"]
                                                     for d in pts], "x--", label=f"transformers {r['dtype']} ctx {ctx}")
    if "int8" in res:
        pts = [d for d in res["int8"]["decode"] if d["batch"] == 1]
        ax2.plot([1] * len(pts), [d["tokens_per_s"] for d in pts], "k*", label="int8 batch 1")
    ax1.set(title="prefill", xlabel="prompt tokens", ylabel="tokens/s", xscale="log")
    ax2.set(title="decode", xlabel="batch size", ylabel="output tokens/s", xscale="log", yscale="log")
    tg = [t for t in res["targets"] if t["value"] is not None]
    # value relative to its threshold, oriented so that > 1 always means "target met"
    rel = [t["value"] / t["threshold"] if t["direction"] == ">=" else t["threshold"] / t["value"] for t in tg]
    ax3.barh([t["name"] for t in tg], rel, color=["tab:green" if t["met"] else "tab:red" for t in tg])
    ax3.axvline(1.0, color="k", lw=1)
    ax3.set(title="targets (>1 = met)", xlabel="value vs threshold")
    ax3.tick_params(axis="y", labelsize=6)
    for ax, sizes in ((ax1, doc["setup"]["sizes"]["prefill"]), (ax2, doc["setup"]["sizes"]["batches"])):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        ax.set_xticks(sizes, [str(n) for n in sizes])  # the measured sizes, not log-scale minor ticks
        ax.xaxis.set_minor_locator(NullLocator())
    m = doc["machine"]
    load_s = ", ".join(f"{x:.2f}" for x in res["load_avg_1m"])  # a list (ENGINE_SCHEMA)
    fig.suptitle(f"{doc['setup']['model']} on {m['cpu']} ({m['threads']} threads, 1-min load {load_s})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> Path:
    from loadtests.bench_common import machine, result_doc, write_result
    from loadtests.schemas import ENGINE_SCHEMA

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="bundled name, .gguf or HF folder")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, numbers meaningless")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-int8", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default="results/engine.json")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("PDSERVE_BENCH_THREADS", "2")))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 5)
    dtypes = args.dtypes.split(",")
    res = run(args.model, dtypes, sizes, repeats, not args.no_transformers, not args.no_int8,
              not args.no_profile, args.quick)
    setup = {"description": "engine prefill/decode vs transformers and this machine's limits, one process",
             "model": args.model, "dtypes": dtypes, "quick": args.quick, "repeats": repeats,
             "threads": args.threads, "sizes": {"prefill": list(sizes.prefill), "batches": list(sizes.batches),
                                                "contexts": list(sizes.contexts)}}
    info = machine()
    info["threads"] = torch.get_num_threads()
    doc = result_doc("engine", setup, {}, res, machine_info=info)
    out = write_result(Path(args.out), doc, ENGINE_SCHEMA)
    plot(doc, out.with_suffix(".png"))
    for t in res["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        print(f"{'MET ' if t['met'] else 'MISS'} {t['name']}: {v} (target {t['direction']} {t['threshold']})")
    return out


if __name__ == "__main__":
    main()
