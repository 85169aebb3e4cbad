"""A replica's measured (or estimated) speed, as the capacity planner reads it: the profile JSON format
and the time models fitted to it.

Owns: `ReplicaProfile` (what one replica is: its hardware, model, KV capacity and transfer speed, and
the timed points: prefill forward seconds against prompt tokens, decode step seconds against batch
and per-sequence context), its JSON form (``format: pdserve-profile/1``; unknown keys refused, named),
`PrefillTimeModel`, and `fit`, which turns a profile into the models the simulator runs: a prefill
forward's time, and the decode replica's `engine.step_model.StepTimeModel` that the path decision
reads too.

``source`` says where the numbers come from (``measured`` by `pdserve profile`, ``roofline estimate``,
``published``): a plan from an estimate is a plan from an estimate, and the output says so.

Why these fits: a prefill forward costs a fixed part, a per-token part (matmuls) and a per-token-pair
part (causal attention); a decode step is linear in batch and total context (`engine.step_model`).
Coefficients are fitted by least squares held non-negative (a negative one is dropped and the rest
refitted), so times never fall as work grows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from engine.step_model import StepTimeModel

FORMAT = "pdserve-profile/1"
Source = Literal["measured", "roofline estimate", "published"]


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int  # one prompt's tokens in one forward, from an empty cache
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # sequences in the step
    context: int  # each sequence's context (tokens attended)
    seconds: float


@dataclass(frozen=True)
class ReplicaProfile:
    label: str
    source: Source
    hardware: str
    model: str
    gpus_per_replica: int  # devices one replica occupies (a CPU replica: 1)
    block_size: int
    kv_blocks: int  # KV blocks of a decode replica
    max_num_seqs: int
    kv_bytes_per_token: int
    transfer_bytes_per_s: float  # KV transfer between a prefill and a decode replica
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    notes: str = ""

    def __post_init__(self) -> None:
        if self.source not in ("measured", "roofline estimate", "published"):
            raise ValueError(f"profile source must be 'measured', 'roofline estimate' or 'published', "
                             f"got {self.source!r}")
        if min(self.gpus_per_replica, self.block_size, self.kv_blocks, self.max_num_seqs) < 1:
            raise ValueError("gpus_per_replica, block_size, kv_blocks and max_num_seqs must be >= 1")
        if self.kv_bytes_per_token < 0 or not self.transfer_bytes_per_s > 0:
            raise ValueError("kv_bytes_per_token must be >= 0 and transfer_bytes_per_s > 0")
        if len(self.prefill) < 2 or len(self.decode) < 3:
            raise ValueError(f"a profile needs >= 2 prefill and >= 3 decode points, got "
                             f"{len(self.prefill)}, {len(self.decode)}")
        if any(p.tokens < 1 or not p.seconds > 0 for p in self.prefill) or any(
                d.batch < 1 or d.context < 0 or not d.seconds > 0 for d in self.decode):
            raise ValueError("profile points need tokens/batch >= 1, context >= 0 and seconds > 0")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["prefill"] = [asdict(p) for p in self.prefill]
        data["decode"] = [asdict(d) for d in self.decode]
        return {"format": FORMAT, **data}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "profile") -> ReplicaProfile:
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: format must be {FORMAT!r}, got {data.get('format')!r}")
        known = {f.name for f in fields(cls)} | {"format"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {unknown} (allowed: {sorted(known)})")
        body = {k: v for k, v in data.items() if k != "format"}
        try:
            body["prefill"] = tuple(PrefillPoint(**p) for p in body["prefill"])
            body["decode"] = tuple(DecodePoint(**d) for d in body["decode"])
            return cls(**body)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> ReplicaProfile:
        return cls.from_json(json.loads(Path(path).read_text()), str(path))


@dataclass(frozen=True)
class PrefillTimeModel:
    """Seconds of one prefill forward of ``t`` tokens: ``base_s + per_token_s * t + per_pair_s * t * t``."""

    base_s: float
    per_token_s: float
    per_pair_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_pair_s * tokens * tokens

    def rate_tps(self, tokens: int) -> float:
        """Prompt tokens per second in forwards of ``tokens`` tokens."""
        return tokens / self.seconds(tokens)


@dataclass(frozen=True)
class FittedProfile:
    profile: ReplicaProfile
    prefill: PrefillTimeModel
    step: StepTimeModel

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.profile.kv_bytes_per_token / self.profile.transfer_bytes_per_s


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative, refit, until none is."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        coef[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        worst = min(keep, key=lambda i: coef[i])
        if coef[worst] >= 0 or len(keep) == 1:
            return np.maximum(coef, 0.0)
        keep.remove(worst)


def fit(profile: ReplicaProfile) -> FittedProfile:
    """The prefill and decode step models fitted to the profile's points (relative error weighted)."""
    t = np.array([p.tokens for p in profile.prefill], dtype=float)
    y = np.array([p.seconds for p in profile.prefill])
    w = 1.0 / y  # each point's relative error counts alike
    pc = _nonneg_lstsq(np.stack([np.ones_like(t), t, t * t], 1) * w[:, None], y * w)
    prefill = PrefillTimeModel(float(max(pc[0], 1e-9)), float(pc[1]), float(pc[2]))
    b = np.array([d.batch for d in profile.decode], dtype=float)
    ctx = np.array([d.batch * d.context for d in profile.decode], dtype=float)
    y = np.array([d.seconds for d in profile.decode])
    w = 1.0 / y
    dc = _nonneg_lstsq(np.stack([np.ones_like(b), b, ctx], 1) * w[:, None], y * w)
    step = StepTimeModel(base_s=float(max(dc[0], 1e-9)), per_seq_s=float(dc[1]), per_context_token_s=float(dc[2]),
                         per_prefill_token_s=prefill.per_token_s)
    return FittedProfile(profile, prefill, step)
