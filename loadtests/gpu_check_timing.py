"""The GPU check's timings: a random-weight Llama-3-8B-shaped engine in bf16, its decode step and
prefill against the card's floors, and its KV budget.

Owns: `TimingPlan` (what to time: batches, context, prompt lengths, the KV budget, repeats; `GPU_PLAN`
and the CPU smoke mode's `SMOKE_PLAN`) and `run_timing`, which measures the card (copy bandwidth,
bf16 matmul peak), builds the engine from weights made in memory (`Engine.from_weights`), checks
its memory at start, then times decode steps at each batch size (every row at the plan's context)
and fresh prefills.

Invariants: timings are medians over synchronised calls after warm-up; every figure is printed next
to the floor it is read against (the measured and the nominal one); a batch the KV budget cannot
hold is skipped with the numbers, never shrunk; on a CPU (the smoke mode) every timing is reported
as a skip that keeps its figures, since a tiny CPU shape says nothing about a GPU. The memory
checks are correctness checks: the cache stays within its budget, and start-up holds nothing
beyond the weights, the cache and `OVERHEAD_SHARE` of the weights' size (no second copy of a weight).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loadtests import gpu_check_roofline as rf
from loadtests.gpu_check_models import LLAMA3_8B, SMOKE_SHAPE, engine_config, random_weights, shape_config
from loadtests.gpu_check_report import Check, guarded

OVERHEAD_SHARE = 0.10  # start-up memory beyond weights + KV cache, as a share of the weights' bytes
GiB = 2**30
HEADROOM = 4 * GiB  # activations of the largest step and CUDA graph pools, beyond weights and cache


@dataclass(frozen=True)
class TimingPlan:
    shape: dict[str, Any]
    dtype: str
    batches: tuple[int, ...]
    context: int  # tokens each decode row has seen (its new token is at this position)
    prompts: tuple[int, ...]  # fresh prefill lengths
    kv_budget: int  # bytes: EngineConfig.kv_cache_memory
    copy_bytes: int  # the bandwidth probe's buffer
    matmul_n: int  # the peak probe's square size
    repeats: int


GPU_PLAN = TimingPlan(LLAMA3_8B, "bfloat16", (1, 8, 32, 64), 1024, (1024, 4096), 10 * GiB, 2 * GiB, 8192, 20)
SMOKE_PLAN = TimingPlan(SMOKE_SHAPE, "float32", (1, 8), 64, (64, 256), 8 * 2**20, 32 * 2**20, 256, 3)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _as_timing(check: Check, device: torch.device) -> Check:
    if device.type != "cuda":
        check.status, check.reason = "skip", "CPU smoke mode: a tiny shape on a CPU, not a GPU figure"
    return check


def run_timing(plan: TimingPlan, device: torch.device, folder: Path, deadline: float) -> list[Check]:
    """Every timing and memory check of ``plan`` on ``device``; what would pass ``deadline``
    (``time.monotonic()``) is skipped, saying so."""
    from engine.engine import Engine

    checks: list[Check] = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    nominal = rf.nominal_for(name)
    bw = rf.copy_bandwidth_gbs(device, plan.copy_bytes)
    dtype = getattr(torch, plan.dtype)
    peak = rf.matmul_peak_tflops(device, plan.matmul_n, dtype)
    checks.append(_as_timing(Check("timing", "device probes", "pass", {
        "device": name, "copy_gbs": bw, "matmul_dtype": plan.dtype, "matmul_tflops": peak,
        "nominal_card": nominal and nominal.card,
        "nominal_hbm_gbs": nominal and nominal.hbm_gbs, "nominal_bf16_tflops": nominal and nominal.bf16_tflops,
    }, kind="timing"), device))

    cfg = shape_config(folder, plan.shape)
    size = torch.finfo(dtype).bits // 8
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * size  # not read by a step
    weight_bytes = rf.decode_weight_bytes(cfg, size) + embed
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        need = weight_bytes + plan.kv_budget + HEADROOM
        if free < need:
            return [*checks, Check("timing", "8B-shaped engine", "skip", {"free_bytes": free, "needed_bytes": need},
                                   reason=f"{free / GiB:.1f} GiB free on this card, the shape needs {need / GiB:.1f}",
                                   kind="timing")]
        torch.cuda.reset_peak_memory_stats(device)
    before = _allocated(device)
    t0 = time.perf_counter()
    config = engine_config(str(device), plan.dtype, "torch", device.type == "cuda", kv_cache_memory=plan.kv_budget)
    engine = Engine.from_weights(cfg, random_weights(cfg, dtype, device), config, folder)
    start_s = time.perf_counter() - t0
    cache_bytes = engine.cache.num_blocks * engine.cache.block_nbytes
    held = _allocated(device) - before
    peak_start = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    mem = {"kv_budget": plan.kv_budget, "cache_bytes": cache_bytes, "num_blocks": engine.cache.num_blocks,
           "weight_bytes": weight_bytes, "held_after_start": held, "peak_during_start": peak_start, "start_s": start_s}
    fits = cache_bytes <= plan.kv_budget
    checks.append(Check("budget", "kv cache within kv_cache_memory", "pass" if fits else "fail", mem,
                        reason="" if fits else f"the cache holds {cache_bytes} bytes, over {plan.kv_budget}"))
    limit = weight_bytes + cache_bytes + OVERHEAD_SHARE * weight_bytes
    if device.type != "cuda":
        checks.append(Check("budget", "start-up memory", "skip", reason="device memory is measured on CUDA only"))
    else:
        worst = max(held, peak_start)
        checks.append(Check("budget", "start-up memory", "pass" if worst <= limit else "fail",
                            {"limit": int(limit), "held_after_start": held, "peak_during_start": peak_start},
                            reason="" if worst <= limit else f"start-up took {worst / GiB:.2f} GiB beyond what was "
                            f"held before, over weights + cache + {OVERHEAD_SHARE:.0%} ({limit / GiB:.2f} GiB): "
                            "a second copy of a weight?"))
    checks += guarded("timing", "decode steps",
                      lambda: _decode_timings(plan, engine, cfg, dtype, device, bw, nominal, deadline))
    checks += guarded("timing", "prefills",
                      lambda: _prefill_timings(plan, engine, cfg, device, peak, nominal, deadline))
    return checks


def _decode_timings(plan: TimingPlan, engine: Any, cfg: Any, dtype: torch.dtype, device: torch.device, bw: float,
                    nominal: rf.Nominal | None, deadline: float) -> list[Check]:
    from engine.runner import DecodeSeq

    checks = []
    per_row = engine.blocks_for(plan.context + 1)
    for b in plan.batches:
        name = f"decode step b{b} ctx{plan.context}"
        if time.monotonic() > deadline:
            checks.append(Check("timing", name, "skip", reason="out of time (the run's budget)", kind="timing"))
            continue
        if b * per_row > engine.pool.num_free_blocks:
            checks.append(Check("timing", name, "skip", {"blocks_needed": b * per_row,
                                "blocks_free": engine.pool.num_free_blocks},
                                reason="the KV budget cannot hold this batch", kind="timing"))
            continue
        tables = [engine.pool.allocate(per_row) for _ in range(b)]
        try:
            seqs = [DecodeSeq(3 + i, plan.context, t) for i, t in enumerate(tables)]
            step = rf.timed_median_s(lambda seqs=seqs: engine.runner.decode(seqs), device, plan.repeats, warmup=3)
        finally:
            for t in tables:
                engine.pool.free(t)
        nbytes = rf.decode_bytes(cfg, dtype, [plan.context + 1] * b)
        floor = rf.decode_floor_s(nbytes, bw)
        nom = rf.decode_floor_s(nbytes, nominal.hbm_gbs) if nominal else None
        figs: dict[str, Any] = {"step_ms": step * 1e3, "floor_ms": floor * 1e3, "of_floor": floor / step,
                                "nominal_floor_ms": nom and nom * 1e3, "bytes": nbytes, "tokens_per_s": b / step}
        c = Check("timing", name, "pass", figs, kind="timing")
        if nom is not None and step < nom and device.type == "cuda":
            c = Check("timing", name, "fail", figs, kind="timing",
                      reason="faster than the card's nominal bandwidth allows: the timer or the byte count is wrong")
        checks.append(_as_timing(c, device))
    return checks


def _prefill_timings(plan: TimingPlan, engine: Any, cfg: Any, device: torch.device, peak: float,
                     nominal: rf.Nominal | None, deadline: float) -> list[Check]:
    from engine.runner import PrefillChunk

    checks = []
    for n in plan.prompts:
        name = f"prefill {n} tokens"
        if time.monotonic() > deadline:
            checks.append(Check("timing", name, "skip", reason="out of time (the run's budget)", kind="timing"))
            continue
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        table = engine.pool.allocate(engine.blocks_for(n))
        try:
            chunk = [PrefillChunk(ids, 0, table)]
            reps = max(3, plan.repeats // 4)
            t = rf.timed_median_s(lambda chunk=chunk: engine.runner.prefill(chunk), device, reps, warmup=2)
        finally:
            engine.pool.free(table)
        flops = rf.prefill_flops(cfg, n)
        nom = rf.prefill_floor_s(flops, nominal.bf16_tflops) if nominal else None
        tflops = flops / t / 1e12
        figs: dict[str, Any] = {"prefill_ms": t * 1e3, "tflops": tflops, "of_measured_peak": tflops / peak,
                                "floor_ms": rf.prefill_floor_s(flops, peak) * 1e3,
                                "nominal_floor_ms": nom and nom * 1e3, "tokens_per_s": n / t}
        checks.append(_as_timing(Check("timing", name, "pass", figs, kind="timing"), device))
    return checks
