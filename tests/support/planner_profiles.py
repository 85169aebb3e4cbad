"""Profiles and workloads for the capacity planner's tests, built from known time models (the oracle
the fits and the simulations are checked against).

Owns: `STEP` and `PREFILL` (the models), `known_profile` (a `ReplicaProfile` whose points lie exactly on
them), `spec` (a small `WorkloadSpec` with two objective classes).
"""

from __future__ import annotations

from typing import Any

from cluster.planner.profile import DecodePoint, PrefillPoint, PrefillTimeModel, ReplicaProfile
from cluster.planner.workload import WorkloadSpec
from engine.step_model import StepTimeModel

PREFILL = PrefillTimeModel(base_s=0.01, per_token_s=2e-4, per_pair_s=1e-8)
STEP = StepTimeModel(base_s=0.02, per_seq_s=5e-4, per_context_token_s=2e-6, per_prefill_token_s=PREFILL.per_token_s)


def known_profile(kv_blocks: int = 256, max_num_seqs: int = 16) -> ReplicaProfile:
    prefill = tuple(PrefillPoint(t, PREFILL.seconds(t)) for t in (16, 64, 256, 512, 1024))
    decode = tuple(DecodePoint(b, c, STEP.step_s(b, b * c)) for b in (1, 4, 16) for c in (32, 256, 1024))
    return ReplicaProfile(label="known models", source="measured", hardware="the test's oracle", model="none",
                          gpus_per_replica=1, block_size=16, kv_blocks=kv_blocks, max_num_seqs=max_num_seqs,
                          kv_bytes_per_token=1000, transfer_bytes_per_s=1e8, prefill=prefill, decode=decode)


def spec(requests: int = 60, **extra: Any) -> WorkloadSpec:
    """At least ``requests`` arrivals (a one-second window: more only at rates above ``requests``/s)."""
    data: dict[str, Any] = {
        "objectives": {"classes": [{"name": "chat", "ttft_s": 0.5, "tpot_s": 0.1, "max_prompt_tokens": 128},
                                   {"name": "long", "ttft_s": 3.0, "tpot_s": 0.15}]},
        "duration_s": 1.0, "min_requests": requests, "seed": 1,
        "mix": [{"share": 0.8, "prompt": {"uniform": [10, 60]}, "output": {"fixed": 8}},
                {"share": 0.2, "prompt": {"fixed": 600}, "output": {"fixed": 8}}]}
    data.update(extra)
    return WorkloadSpec.model_validate(data)
