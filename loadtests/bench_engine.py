"""`make bench-engine`: prefill and decode speed of the engine vs transformers, with this machine's limits.

Writes ``results/engine.json`` (schema: `loadtests.schemas.ENGINE_SCHEMA`) and ``results/engine.png``.
Medians of repeated runs; ratios come from numbers measured in this same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.engine import Engine
from engine.runner import DecodeSeq, PrefillChunk
from loadtests.machine import machine_info, measure_limits, median_time

PREFILL_LENS = (128, 512, 2048)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (256, 1024)


def model_flops_per_token(eng: Engine, context: int) -> float:
    """2 × non-embedding matmul params (+ lm_head) + attention (QK and PV) at this context."""
    c = eng.model_config
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    matmul = 2 * (c.num_layers * per_layer + c.vocab_size * c.hidden_size)
    attn = 2 * 2 * c.num_layers * c.q_size * context
    return float(matmul + attn)


def weight_bytes(eng: Engine) -> int:
    w = eng.runner.model.w
    total = sum(t.numel() * t.element_size() for t in (w.norm, w.lm_head))
    for lw in w.layers:
        total += sum(t.numel() * t.element_size() for t in (lw.qkv, lw.o_proj, lw.gate_up, lw.down))
    return total


def bench_prefill(eng: Engine, n: int, repeats: int) -> float:
    ids = torch.randint(10, 1000, (n,)).tolist()
    blocks = eng.pool.allocate(eng.blocks_for(n))
    try:
        return median_time(lambda: eng.runner.prefill([PrefillChunk(ids, 0, blocks)]), repeats, warmup=1)
    finally:
        eng.pool.free(blocks)


def bench_decode(eng: Engine, batch: int, context: int, repeats: int) -> float:
    tables = [eng.pool.allocate(eng.blocks_for(context + 1)) for _ in range(batch)]
    try:
        seqs = [DecodeSeq(100 + i, context, t) for i, t in enumerate(tables)]
        return median_time(lambda: eng.runner.decode(seqs), repeats, warmup=2)
    finally:
        for t in tables:
            eng.pool.free(t)


def bench_transformers(model_dir: Path, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out: dict[str, Any] = {"prefill_s": {}, "decode_step_s": {}}
    with torch.inference_mode():
        for n in PREFILL_LENS:
            ids = torch.randint(10, 1000, (1, n))
            out["prefill_s"][str(n)] = median_time(lambda ids=ids: hf(ids), repeats, warmup=1)
        for batch in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                ids = torch.randint(10, 1000, (batch, ctx))
                past = hf(ids, use_cache=True).past_key_values
                nxt = torch.randint(10, 1000, (batch, 1))

                def step(nxt=nxt, past=past, ctx=ctx) -> None:
                    hf(nxt, past_key_values=past, use_cache=True)
                    past.crop(ctx)  # keep the context fixed across repeats

                out["decode_step_s"][f"{batch}x{ctx}"] = median_time(step, repeats, warmup=1)
    return out


def run(model: str, dtypes: list[str], repeats: int, with_hf: bool) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "engine",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "model": model,
        "limits": measure_limits(),
        "runs": [],
    }
    steps = len(dtypes) * (len(PREFILL_LENS) + len(DECODE_BATCHES) * len(DECODE_CONTEXTS) + int(with_hf))
    bar = tqdm(total=steps, desc="bench-engine")
    for dt in dtypes:
        eng = Engine.load(model, EngineConfig(dtype=dt, num_blocks=32 * 1100 // 16 + 64, block_size=16))
        run_: dict[str, Any] = {"dtype": dt, "weight_bytes": weight_bytes(eng), "prefill": [], "decode": []}
        for n in PREFILL_LENS:
            t = bench_prefill(eng, n, repeats)
            flops = model_flops_per_token(eng, n // 2) * n
            run_["prefill"].append(
                {"tokens": n, "seconds": t, "tokens_per_s": n / t, "gflops": flops / t / 1e9}
            )
            bar.update()
        for batch in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                t = bench_decode(eng, batch, ctx, repeats)
                run_["decode"].append(
                    {"batch": batch, "context": ctx, "step_ms": t * 1e3, "tokens_per_s": batch / t}
                )
                bar.update()
        if with_hf:
            run_["transformers"] = bench_transformers(eng.model_dir, eng.config.torch_dtype, repeats)
            bar.update()
        result["runs"].append(run_)
        del eng
    bar.close()
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in result["runs"]:
        ax1.plot([p["tokens"] for p in r["prefill"]], [p["tokens_per_s"] for p in r["prefill"]], "o-",
                 label=f"pdserve {r['dtype']}")
        if "transformers" in r:
            hf = r["transformers"]["prefill_s"]
            ax1.plot([int(k) for k in hf], [int(k) / v for k, v in hf.items()], "x--",
                     label=f"transformers {r['dtype']}")
        for ctx in DECODE_CONTEXTS:
            pts = [d for d in r["decode"] if d["context"] == ctx]
            ax2.plot([d["batch"] for d in pts], [d["tokens_per_s"] for d in pts], "o-",
                     label=f"pdserve {r['dtype']} ctx {ctx}")
            if "transformers" in r:
                hf = r["transformers"]["decode_step_s"]
                ax2.plot([b for b in DECODE_BATCHES], [b / hf[f"{b}x{ctx}"] for b in DECODE_BATCHES], "x--",
                         label=f"transformers {r['dtype']} ctx {ctx}")
    ax1.set(title="prefill", xlabel="prompt tokens", ylabel="tokens/s", xscale="log")
    ax2.set(title="decode", xlabel="batch size", ylabel="output tokens/s", xscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']} on {result['machine']['cpu']} ({result['machine']['threads']} threads)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default="results/engine.json")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("PDSERVE_BENCH_THREADS", "2")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args.model, args.dtypes.split(","), args.repeats, not args.no_transformers)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
