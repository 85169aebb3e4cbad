"""The GPU check's correctness sections on tiny models: each family against transformers, the
``torch`` backend against ``reference``, CUDA graphs on against off.

Owns: `SCENARIO` (one fixed workload: a fresh prefill, the same prompt in three chunks, three prompts
prefilled together, then four batched decode steps fed fixed tokens), `run_scenario` (its logits
through an engine) and `hf_scenario` (the same logits from transformers, every one a full forward:
the oracle), the comparisons and `check_family` (every check of one family).

Invariants: both sides of a comparison see the same inputs (decode steps are fed fixed tokens, not
their own argmax, so one near-tie cannot make the rest incomparable); fp32 greedy tokens must equal
transformers' exactly, the only excuse being a first divergence at a near tie (top-two gap under
`TIE_EPS` in transformers' logits), which the check names; bf16 is judged against transformers in
fp32 with a tolerance of `BF16_FACTOR` times transformers' own bf16 error on the same inputs.
Every block an engine takes from its pool is given back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loadtests.gpu_check_models import engine_config, load_hf
from loadtests.gpu_check_report import Check, guarded

FP32_ATOL = 1e-4  # logits of two fp32 implementations (tiny models' logits are O(1))
TIE_EPS = 1e-5  # a top-two gap this small may flip between two correct fp32 implementations
BF16_FACTOR = 3.0
N_NEW = 24  # greedy tokens per family


@dataclass(frozen=True)
class Scenario:
    prompts: tuple[tuple[int, ...], ...]  # prompt 0 also runs alone, fresh and chunked
    chunks: tuple[int, ...]  # chunk boundaries of prompt 0 (not block-aligned on purpose)
    fed: tuple[tuple[int, ...], ...]  # per prompt, the tokens fed to its decode steps


def _ids(n: int, seed: int, vocab: int = 256) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (n,), generator=g).tolist())


SCENARIO = Scenario(prompts=(_ids(37, 1), _ids(5, 2), _ids(20, 3)), chunks=(16, 29),
                    fed=(_ids(4, 4), _ids(4, 5), _ids(4, 6)))


def run_scenario(engine: Any, sc: Scenario = SCENARIO) -> dict[str, torch.Tensor]:
    """name → fp32 logits on the host: ``prefill`` [S0, V], ``chunked`` [S0, V], ``batched`` [3, V],
    ``decode`` [steps, 3, V]."""
    from engine.runner import DecodeSeq, PrefillChunk

    p0, out = sc.prompts[0], {}
    tables = [engine.pool.allocate(engine.blocks_for(len(p) + len(f))) for p, f in zip(sc.prompts, sc.fed, strict=True)]
    try:
        out["prefill"] = engine.runner.prefill([PrefillChunk(list(p0), 0, tables[0])], all_logits=True)
        bounds = [0, *sc.chunks, len(p0)]
        parts = [engine.runner.prefill([PrefillChunk(list(p0[lo:hi]), lo, tables[0], len(p0))], all_logits=True)
                 for lo, hi in itertools.pairwise(bounds)]
        out["chunked"] = torch.cat(parts)
        out["batched"] = engine.runner.prefill(
            [PrefillChunk(list(p), 0, t) for p, t in zip(sc.prompts, tables, strict=True)])
        steps = []
        for k in range(len(sc.fed[0])):
            seqs = [DecodeSeq(f[k], len(p) + k, t) for p, f, t in zip(sc.prompts, sc.fed, tables, strict=True)]
            steps.append(engine.runner.decode(seqs))
        out["decode"] = torch.stack(steps)
    finally:
        for t in tables:
            engine.pool.free(t)
    return {k: v.float().cpu() for k, v in out.items()}


@torch.no_grad()
def hf_scenario(hf: Any, device: torch.device, sc: Scenario = SCENARIO) -> dict[str, torch.Tensor]:
    """The same names as `run_scenario`, each logit from one full transformers forward."""
    def last(ids: tuple[int, ...]) -> torch.Tensor:
        return hf(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()  # [V]

    full = hf(torch.tensor([sc.prompts[0]], device=device)).logits[0].float().cpu()  # [S0, V]
    decode = torch.stack([torch.stack([last(p + f[: k + 1]) for p, f in zip(sc.prompts, sc.fed, strict=True)])
                          for k in range(len(sc.fed[0]))])
    return {"prefill": full, "chunked": full, "batched": torch.stack([last(p) for p in sc.prompts]),
            "decode": decode}


def max_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max()) for k in a}


def compare(name: str, section: str, ours: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor],
            atol: float) -> Check:
    diffs = max_diffs(ours, oracle)
    worst = max(diffs, key=lambda k: diffs[k])
    figures: dict[str, Any] = {f"max_abs_{k}": v for k, v in diffs.items()}
    if diffs[worst] <= atol:
        return Check(section, name, "pass", {**figures, "atol": atol})
    return Check(section, name, "fail", {**figures, "atol": atol},
                 reason=f"{worst} logits differ by {diffs[worst]:.3g} > {atol:g}")


@torch.no_grad()
def hf_greedy(hf: Any, prompt: tuple[int, ...], n: int, device: torch.device) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after ``prompt`` (full forwards) and the top-two gap of each step."""
    ids, gaps = list(prompt), []
    for _ in range(n):
        logits = hf(torch.tensor([ids], device=device)).logits[0, -1].float()  # [V]
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], gaps


def greedy_check(name: str, ours: list[int], theirs: list[int], gaps: list[float]) -> Check:
    figures: dict[str, Any] = {"tokens": len(theirs), "min_gap": min(gaps)}
    if ours == theirs:
        return Check("families", name, "pass", figures)
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    figures.update(diverged_at=at, ours=ours[: at + 1], transformers=theirs[: at + 1])
    if at < len(gaps) and gaps[at] < TIE_EPS:
        return Check("families", name, "pass", {**figures, "gap_at_divergence": gaps[at]},
                     reason=f"diverged at token {at}, a near tie (gap {gaps[at]:.2g} < {TIE_EPS:g})")
    return Check("families", name, "fail", figures, reason=f"greedy tokens diverge from transformers at token {at}")


def engine_greedy(engine: Any, prompt: tuple[int, ...], n: int) -> list[int]:
    from engine.generate import generate
    from engine.sampling.sampler import SamplingParams

    return generate(engine, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True)).token_ids


def check_family(family: str, path: Path, device: torch.device) -> list[Check]:
    """fp32 greedy and logits against transformers (reference and torch backends), bf16 within
    tolerance, torch = reference, and on CUDA graphs on = off."""
    from engine.engine import Engine

    dev, cuda = str(device), device.type == "cuda"
    checks: list[Check] = []
    hf32 = load_hf(path, device, torch.float32)
    oracle32 = hf_scenario(hf32, device)
    theirs, gaps = hf_greedy(hf32, SCENARIO.prompts[0], N_NEW, device)
    runs: dict[str, dict[str, torch.Tensor]] = {}
    engines: dict[str, Any] = {}
    for backend in ("reference", "torch"):
        def one(backend: str = backend) -> list[Check]:
            graphs = cuda and backend == "torch"  # CUDA graphs are the torch backend's, on CUDA only
            eng = Engine.from_dir(path, engine_config(dev, "float32", backend, graphs, num_blocks=64))
            engines[backend] = eng
            runs[backend] = run_scenario(eng)
            ours = engine_greedy(eng, SCENARIO.prompts[0], N_NEW)
            return [compare(f"{family}/fp32-logits/{backend}", "families", runs[backend], oracle32, FP32_ATOL),
                    greedy_check(f"{family}/fp32-greedy/{backend}", ours, theirs, gaps)]
        checks += guarded("families", f"{family}/fp32/{backend}", one)
    if len(runs) == 2:
        checks.append(compare(f"{family}/torch=reference", "backends", runs["torch"], runs["reference"], FP32_ATOL))

    def bf16() -> list[Check]:
        hf16 = load_hf(path, device, torch.bfloat16)
        ref_err = max(max_diffs(hf_scenario(hf16, device), oracle32).values())
        eng = Engine.from_dir(path, engine_config(dev, "bfloat16", "torch", cuda, num_blocks=64))
        c = compare(f"{family}/bf16-logits/torch", "families", run_scenario(eng), oracle32, BF16_FACTOR * ref_err)
        c.figures["transformers_bf16_err"] = ref_err
        return [c]
    checks += guarded("families", f"{family}/bf16/torch", bf16)

    if not cuda:
        checks.append(Check("graphs", f"{family}/graphs-on=off", "skip", reason="CUDA graphs need a CUDA device"))
    elif "torch" in engines:
        def graphs() -> list[Check]:
            off = Engine.from_dir(path, engine_config(dev, "float32", "torch", False, num_blocks=64))
            c = compare(f"{family}/graphs-on=off", "graphs", runs["torch"], run_scenario(off), FP32_ATOL)
            p0 = SCENARIO.prompts[0]
            same = engine_greedy(off, p0, N_NEW) == engine_greedy(engines["torch"], p0, N_NEW)
            c.figures["greedy_equal"] = same
            if not same and c.status == "pass":
                c.status, c.reason = "fail", "greedy tokens differ with CUDA graphs on and off"
            return [c]
        checks += guarded("graphs", f"{family}/graphs-on=off", graphs)
    return checks
