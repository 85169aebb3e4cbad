"""A whole prefill forward with each prefill attention side by side: the C++ kernel and torch's SDPA.

Owns: `main`, which loads the bundled model twice in one process (fp32 where ``dtype: auto`` gives
it, one torch thread as a prefill replica of deploy/local.yaml runs), the first engine with the
prefill attention pinned to the C++ kernel and the second to SDPA, times one prefill forward from an
empty cache at each prompt length, engines interleaved, best of ``--repeats``, and writes
``results/prefill_attention_choice.json`` with what `engine.kernels.prefill_choice` picked at load.

Invariants: both engines load the same weights and run the same tokens; only the prefill attention
differs (both compute the same causal attention up to fp32 rounding, tested in tests/engine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from cluster.planner.measure import synthetic_prompt
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kernels import prefill_choice
from engine.kernels.prefill_choice import PrefillChoice
from engine.runner import PrefillChunk
from loadtests.machine import machine_info

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _prefill_s(eng: Engine, n: int) -> float:
    ids = synthetic_prompt(n, eng.model_config.vocab_size)
    blocks = eng.pool.allocate(eng.blocks_for(n))
    try:
        t0 = time.perf_counter()
        eng.runner.prefill([PrefillChunk(ids, 0, blocks)])
        return time.perf_counter() - t0
    finally:
        eng.pool.free(blocks)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "prefill_attention_choice.json"))
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.set_num_threads(1)
    config = EngineConfig(device="cpu", dtype="auto", num_threads=1, num_blocks=max(lengths) // 16 + 8)
    m = Engine.load(args.model, config).model_config  # its load makes this machine's choice
    key = (m.num_heads, m.num_kv_heads, m.head_dim, torch.get_num_threads())
    auto = prefill_choice._REMEMBERED.get(key) or PrefillChoice(False, reason="not fp32 here: SDPA untimed")
    engines: dict[str, Engine] = {}
    for name, native in (("native", True), ("sdpa", False)):
        prefill_choice._REMEMBERED[key] = PrefillChoice(native, reason="pinned by the comparison")
        engines[name] = Engine.load(args.model, config)
    results: dict[str, dict[str, float]] = {}
    for n in lengths:
        best = {name: float("inf") for name in engines}
        for _ in range(args.repeats):
            for name, eng in engines.items():
                best[name] = min(best[name], _prefill_s(eng, n))
        results[str(n)] = {**{k: round(v, 3) for k, v in best.items()},
                           "sdpa_over_native": round(best["sdpa"] / best["native"], 3)}
        print(f"{n} tokens: {results[str(n)]}", flush=True)
    out = {"benchmark": "prefill_attention_choice",
           "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": machine_info(),
           "setup": {"model": args.model, "torch_threads": 1, "repeats": args.repeats,
                     "auto_choice_at_load": auto.summary()},
           "results": {"prefill_s": results}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
