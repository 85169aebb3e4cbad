"""`make bench-sampler`: what the sampler costs next to the decode step it follows.

Writes ``results/sampler.json`` (schema: `loadtests.schemas.SAMPLER_SCHEMA`) and ``results/sampler.png``.
One process configured like the decode pool of ``deploy/local.yaml`` (bf16 where the CPU computes in it,
one torch thread): the engine's decode step at batch 8 (context 160) and `engine.sampling.sampler.sample` on
that step's own logits for 8 rows under each case below, the step and the cases interleaved round by
round so load hits them alike; medians. Cases: greedy (the plain request), greedy with 5 top log-probs,
seeded top-p sampling, seeded sampling over the whole vocabulary (temperature 1, OpenAI's defaults),
unseeded top-k sampling, and every penalty at once (repetition, presence, frequency, a logit bias,
min-p, min_tokens) over a 160-token prompt and 32 output tokens; then structured outputs under a
JSON schema (strings, an integer, an array), each row at a different point of one answer (in a key,
a string, a number, the array): the grammar's mask stage alone (`engine.sampling.grammar.mask_logits`, the
matchers held where they are) and a whole greedy `sample` under it (the matchers rebuilt, untimed,
before each call). Issue #27's target: the sampler and the grammar mask at most 10% of the step, and
plain requests paying nothing measurable for the pipeline's other stages. ``--model`` (a folder with
a ``tokenizer.json``) / ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling.grammar import GrammarMatcher, GrammarSpec, compile_grammar, grammar_vocab, mask_logits
from engine.sampling.sampler import SamplerState, SamplingParams, sample
from engine.tokenizer import Tokenizer
from loadtests import bench_engine as be
from loadtests.bench_common import MODEL, RESULTS, log, result_doc, write_result
from loadtests.schemas import SAMPLER_SCHEMA

BATCH, CONTEXT, OUTPUT = 8, 160, 32
TARGET_FRACTION = 0.10


def cases(vocab: int) -> dict[str, SamplingParams]:
    """The sampling settings compared, by name (each row of a case's batch gets its own seed)."""
    bias = tuple((t, 2.0) for t in range(10, 20))
    return {
        "greedy": SamplingParams(temperature=0.0, max_tokens=64),
        "greedy_top5_logprobs": SamplingParams(temperature=0.0, max_tokens=64, logprobs=True, top_logprobs=5),
        "seeded_top_p": SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=64),
        "seeded_temperature": SamplingParams(temperature=1.0, seed=1, max_tokens=64),  # OpenAI's defaults
        "unseeded_top_k": SamplingParams(temperature=0.8, top_k=50, max_tokens=64),
        "all_penalties": SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=256, repetition_penalty=1.1,
                                        presence_penalty=0.5, frequency_penalty=0.5, logit_bias=bias, min_p=0.05,
                                        min_tokens=OUTPUT + 64, stop_token_ids=(min(2, vocab - 1),)),
    }


GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "city": {"type": "string"}},
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}
GRAMMAR_ANSWER = '{"name": "Ann Smith", "age": 30, "tags": ["red", "blue"], "city": "Paris"}'
Timed = tuple[Callable[[], None], Callable[[], object]]  # (untimed set-up, timed call)


def _nothing() -> None:
    pass


def grammar_calls(logits: torch.Tensor, folder: Path) -> dict[str, Timed]:
    """The structured-output cases over ``logits`` [B, V]: row i has generated the first i/B of
    `GRAMMAR_ANSWER`'s tokens."""
    tok = Tokenizer.from_dir(folder)
    vocab = grammar_vocab(folder, tok.eos_token_ids)
    spec = GrammarSpec("json_schema", json.dumps(GRAMMAR_SCHEMA))
    compiled = compile_grammar(vocab, spec)
    answer = tok.encode(GRAMMAR_ANSWER)
    prefixes = [answer[: i * (len(answer) - 1) // BATCH] for i in range(BATCH)]
    held: list[GrammarMatcher | None] = [GrammarMatcher(compiled, p) for p in prefixes]
    params = SamplingParams(temperature=0.0, max_tokens=64, grammar=spec)
    fresh: list[list[SamplerState]] = [[]]

    def rebuild() -> None:
        fresh[0] = [SamplerState.new(params, (), p, tok.eos_token_ids, vocab) for p in prefixes]

    return {"json_schema_mask": (_nothing, lambda: mask_logits(logits, held)),
            "json_schema_greedy": (rebuild, lambda: _call(logits, fresh[0]))}


def _states(params: SamplingParams, vocab: int) -> list[SamplerState]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(BATCH):
        p = dataclasses.replace(params, seed=None if params.seed is None else params.seed + i)
        prompt = torch.randint(3, vocab, (CONTEXT,), generator=g).tolist()
        output = torch.randint(3, vocab, (OUTPUT,), generator=g).tolist()
        out.append(SamplerState.new(p, prompt, output))
    return out


def _call(logits: torch.Tensor, states: list[SamplerState]) -> None:
    sample(logits, states)


STEP = "decode_step"  # the key of the decode step's own time among time_cases' results


def time_cases(logits: torch.Tensor, named: dict[str, SamplingParams], repeats: int,
               step: Callable[[], object] | None = None, extra: dict[str, Timed] | None = None) -> dict[str, float]:
    """Median milliseconds of one `sample` call over ``logits`` [B, V] per case, and of each of
    ``extra``'s calls (after its untimed set-up), interleaved; with a ``step``, also that step's
    median (key `STEP`), timed in the same rounds so load hits it alike."""
    vocab = logits.shape[1]
    fns: dict[str, Timed] = {} if step is None else {STEP: (_nothing, step)}
    for name, params in named.items():
        states = _states(params, vocab)
        fns[name] = (_nothing, functools.partial(_call, logits, states))
    fns.update(extra or {})
    times: dict[str, list[float]] = {name: [] for name in fns}
    for setup, fn in fns.values():
        setup()
        fn()  # warm-up (builds the penalty books)
    for _ in range(repeats):
        for name, (setup, fn) in fns.items():
            setup()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    names = list(res["cases"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.bar(names, [res["cases"][n]["ms"] for n in names], color="tab:blue")
    ax.axhline(res["decode_step_ms"] * TARGET_FRACTION, color="black", linestyle="--",
               label=f"{TARGET_FRACTION:.0%} of the batch-{BATCH} decode step ({res['decode_step_ms']:.1f} ms)")
    ax.set_ylabel("ms per sample() call, batch 8")
    ax.set_title(f"sampler cost, {doc['created'][:16]} UTC")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    ap.add_argument("--out", default=str(RESULTS / "sampler.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 5 if args.quick else 41
    eng = Engine.load(args.model, EngineConfig(dtype=args.dtype, num_threads=1, max_num_seqs=BATCH,
                                               num_blocks=BATCH * (CONTEXT // 16 + 2) + 8, block_size=16))
    seqs = be._decode_seqs(eng, BATCH, CONTEXT)
    try:
        logits = eng.runner.decode(seqs).float()  # [BATCH, V]: the step's own output, not random numbers
        log(f"decode step (batch {BATCH}, context {CONTEXT}, {eng.config.dtype}, 1 thread) and the sampler "
            f"cases on its logits [{BATCH}, {logits.shape[1]}], interleaved")
        ms = time_cases(logits, cases(logits.shape[1]), repeats, step=lambda: eng.runner.decode(seqs),
                        extra=grammar_calls(logits, eng.model_dir))
    finally:
        be._free(eng, seqs)
    step_ms = ms.pop(STEP)
    results = {
        "decode_step_ms": round(step_ms, 3),
        "cases": {n: {"ms": round(v, 3), "of_step": round(v / step_ms, 4)} for n, v in ms.items()},
        "targets": [
            {"name": f"{n}_of_step", "value": round(ms[n] / step_ms, 4), "threshold": TARGET_FRACTION,
             "met": ms[n] / step_ms <= TARGET_FRACTION}
            for n in ("all_penalties", "seeded_top_p", "seeded_temperature", "json_schema_greedy")
        ],
    }
    setup = {"description": __doc__.split("\n\n")[1].replace("\n", " "), "model": args.model,
             "dtype": eng.config.dtype, "batch": BATCH, "context": CONTEXT, "output_tokens": OUTPUT,
             "repeats": repeats}
    doc = result_doc("sampler", setup, {}, results)
    out = write_result(Path(args.out), doc, SAMPLER_SCHEMA)
    plot(doc, out.with_suffix(".png"))
    for n, v in ms.items():
        log(f"{n}: {v:.2f} ms ({v / step_ms:.1%} of the {step_ms:.1f} ms step)")
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return out


if __name__ == "__main__":
    main()
