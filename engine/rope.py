"""Rotary position embeddings (Hugging Face ``rotate_half`` convention), with llama3, linear and
yarn scaling.

Owns: the cos/sin tables and their application to q and k (`RotaryEmbedding`), and the same tables
in the fast path's formats (`RopeTables`: one signed sine table for a roll, the native store's).
Invariant: tables are computed in fp32 and cast to the activation dtype on use, as transformers does.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from engine.native_rope import RopeStore
from engine.rope_params import RopeParams, RopeScaling


def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), more than ``beta_fast`` times extrapolated (kept), a linear
    ramp between (transformers' ``_compute_yarn_parameters``)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (inv_freq / s.factor) * (1 - keep) + inv_freq * keep


class RotaryEmbedding:
    """Precomputed ``cos``/``sin`` of shape ``[max_positions, head_dim]``, for ``params`` (default:
    the config's ``rope_theta`` and ``rope_scaling``, every layer's but where `ModelConfig.layer_rope`
    says otherwise)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device,
                 params: RopeParams | None = None) -> None:
        theta, scaling = (cfg.rope_theta, cfg.rope_scaling) if params is None else (params.theta, params.scaling)
        inv_freq = _inv_freq(cfg.head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        gain = scaling.attention_factor if scaling is not None else 1.0  # yarn's
        self.cos = (emb.cos() * gain).to(device)
        self.sin = (emb.sin() * gain).to(device)
        self.max_positions = max_positions

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KV, D], positions: [T] → rotated (q, k), same shapes and dtype."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RopeTables:
    """One `RotaryEmbedding` and its tables in the fast path's formats (the model holds one per
    distinct `RopeParams` of its layers)."""

    def __init__(self, rope: RotaryEmbedding, dtype: torch.dtype) -> None:
        self.rope = rope
        half = rope.cos.shape[1] // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin | sin]: one table, no negation per step.
        self.cos = rope.cos.to(dtype)  # [P, D]
        self.sin_signed32 = torch.cat([-rope.sin[:, :half], rope.sin[:, half:]], -1)  # [P, D] fp32
        self.sin_signed = self.sin_signed32.to(dtype)

    def gathered(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin at ``positions`` [T] → [T, 1, D] each, in the activation dtype."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def store(self, positions: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
              cache_slots: int) -> RopeStore:
        """The native RoPE + cache store of one forward (positions and slots checked once)."""
        return RopeStore.for_batch(positions, slots, self.rope.cos, self.sin_signed32, num_heads, num_kv_heads,
                                   cache_slots)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
