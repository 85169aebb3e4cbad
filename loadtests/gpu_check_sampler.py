"""The GPU check's sampler section: the device sampler follows the host sampler's rules.

Owns: `PARAMS` (one row per rule: greedy, temperature, top-k, top-p, min-p, penalties, logit bias,
min_tokens, top log-probs; every sampled row seeded) and `check_sampler`, which calls
`engine.sampling.sampler.sample` on the same logits twice, as device tensors (the device path) and
as ``logits.cpu()`` (the host path), with twin states, for several steps.

Invariants: a seeded row's token depends only on its seed and step, never on where it was sampled
(the sampler's own invariant), so the two paths must choose the same token in every row and every
step, and report the same log-probs within float noise. On a CPU both calls take the host path:
the section runs (its code is exercised) but says it compared nothing.
"""

from __future__ import annotations

import torch

from loadtests.gpu_check_report import Check

VOCAB = 32000
STEPS = 6
LOGPROB_ATOL = 1e-4
HOT = 64  # prompt ids, biased ids and stop ids are drawn below this


def _params() -> list[object]:
    from engine.sampling.sampler import SamplingParams as P

    return [
        P(max_tokens=64),
        P(max_tokens=64, temperature=0.8, seed=1),
        P(max_tokens=64, temperature=1.0, top_k=20, seed=2),
        P(max_tokens=64, temperature=0.6, top_p=0.9, seed=3),
        P(max_tokens=64, temperature=1.0, min_p=0.1, seed=4),
        P(max_tokens=64, temperature=0.7, top_k=50, top_p=0.8, min_p=0.05, seed=5),
        P(max_tokens=64, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
        P(max_tokens=64, temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.4, seed=6),
        P(max_tokens=64, temperature=1.0, logit_bias=((5, 30.0), (7, -100.0)), seed=7),
        P(max_tokens=64, temperature=1.0, min_tokens=3, stop_token_ids=(11, 12), seed=8),
        P(max_tokens=64, temperature=1.0, logprobs=True, top_logprobs=5, seed=9),
    ]


def _states(rows: int) -> list[object]:
    from engine.sampling.sampler import SamplerState

    params = _params()
    g = torch.Generator().manual_seed(0)
    return [SamplerState.new(params[i % len(params)],  # type: ignore[arg-type]
                             prompt_ids=torch.randint(0, HOT, (16,), generator=g).tolist(), eos_ids=(2,))
            for i in range(rows)]


def check_sampler(device: torch.device, rows: int = 44) -> Check:
    """Device path against host path on ``STEPS`` steps of random logits [rows, VOCAB]."""
    from engine.sampling.sampler import sample

    dev_states, host_states = _states(rows), _states(rows)
    gen = torch.Generator(device=device).manual_seed(1)
    token_mismatch, top_mismatch, lp_err = 0, 0, 0.0
    for _ in range(STEPS):
        logits = torch.randn(rows, VOCAB, generator=gen, device=device).mul_(3.0)  # [rows, V]
        logits[:, :HOT] += 4.0  # the prompts', biased and stop ids compete for the top: the rules matter
        a = sample(logits, dev_states)  # type: ignore[arg-type]
        b = sample(logits.cpu(), host_states)  # type: ignore[arg-type]
        token_mismatch += sum(x != y for x, y in zip(a.token_ids, b.token_ids, strict=True))
        lp_err = max(lp_err, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
        top_mismatch += sum([t for t, _ in x] != [t for t, _ in y] for x, y in zip(a.top, b.top, strict=True))
    figures: dict[str, float | int] = {"rows": rows, "steps": STEPS, "token_mismatches": token_mismatch,
                                       "top_mismatches": top_mismatch, "max_logprob_err": lp_err}
    name = "device=host rules"
    if device.type != "cuda":
        return Check("sampler", name, "skip", figures, reason="no CUDA: both calls took the host path (code "
                                                              "exercised, nothing compared)")
    if token_mismatch or top_mismatch or lp_err > LOGPROB_ATOL:
        return Check("sampler", name, "fail", figures,
                     reason=f"{token_mismatch} token(s), {top_mismatch} top list(s) differ; "
                            f"log-prob error {lp_err:.2g} (limit {LOGPROB_ATOL:g})")
    return Check("sampler", name, "pass", figures)
