"""`python -m loadtests.spot_decode`: spot figures for the decode targets of issue #7, one run, ~2 min.

Engine decode b1 ctx 256 (fp32, bf16, int8 next to bf16) and b32 ctx 1,024 fp32, the matvec probe
timed between the steps (torch's and the native kernel), transformers b1 ctx 256 in the same run;
medians. Writes results/engine_spot.json. The full benchmark is `make bench-engine` (~35 min here).
"""
import json
import statistics
import time
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loading.weights import load_weights
from engine.model.model import build_model
from engine.runner import ModelRunner
from loadtests import bench_engine as be
from loadtests import machine as mach

torch.set_num_threads(2)
out = {}
def hf_b1(path, dtype, ctx=256, reps=7):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    ids = torch.randint(3, 1000, (1, ctx))
    with torch.inference_mode():
        past = m(ids, use_cache=True, logits_to_keep=1).past_key_values
        nxt = torch.tensor([[5]])
        ts = []
        for _ in range(reps + 2):
            t = time.perf_counter()
            m(nxt, past_key_values=past, use_cache=True)
            ts.append(time.perf_counter() - t)
            past.crop(-1)  # the context stays at ctx
    return statistics.median(ts[2:])
for dt in ("float32", "bfloat16"):
    eng = Engine.load("smollm2-135m-instruct", EngineConfig(dtype=dt, num_blocks=32 * 66 + 64, block_size=16))
    probe = mach.MatvecProbe(eng.config.torch_dtype)
    wb = eng.runner.model.weight_nbytes()
    r = be.bench_decode(eng, {"x": eng.runner}, 1, 256, 9, probe)
    bw = {k: probe.nbytes / r[f"matvec_probe_{k}"] / 1e9 for k in probe.kernels}
    best = probe.nbytes / r["matvec_probe"] / 1e9
    hf = hf_b1(eng.model_dir, eng.config.torch_dtype)
    d = {"b1_step_ms": r["x"] * 1e3, "weight_bytes": wb, "matvec_gbs": bw, "matvec_best_gbs": best,
         "vs_floor_best_bw": r["x"] / (wb / best / 1e9), "vs_floor_torch_bw": r["x"] / (wb / bw["torch"] / 1e9),
         "hf_b1_step_ms": hf * 1e3, "vs_transformers_b1": hf / r["x"],
         "kernels": eng.runner.model.attention.report()}
    if dt == "float32":
        d["b32_ctx1024_step_ms"] = be.bench_decode(eng, {"x": eng.runner}, 32, 1024, 3)["x"] * 1e3
    else:
        cfg = eng.model_config
        weights = load_weights(eng.model_dir, cfg, torch.bfloat16)
        q8 = ModelRunner(build_model(cfg, weights, eng.max_model_len, replace(eng.config, quantization="int8")),
                         eng.cache)
        t = be.bench_decode(eng, {"base": eng.runner, "int8": q8}, 1, 256, 9)
        d["int8_b1_step_ms"], d["int8_vs_bf16"] = t["int8"] * 1e3, t["int8"] / t["base"]
    out[dt] = d
    print(dt, json.dumps(d), flush=True)
    del eng, probe
with open("results/engine_spot.json", "w") as f:
    json.dump(out, f, indent=1)
