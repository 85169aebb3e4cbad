"""Rotary position embeddings (Hugging Face ``rotate_half`` convention), with llama3, linear, yarn,
longrope and dynamic NTK scaling, over whole heads or their first rotary dims (partial rotary).

Owns: the cos/sin tables, which table each token takes (`RotaryEmbedding.lookup`: a length-dependent
RoPE's table is the one of the token's forward call, `engine.model.rope_params`) and their application to
q and k (`RotaryEmbedding.apply`), and the same tables in the fast path's formats (`RopeTables`: one
signed sine table for a roll, the native store's).

Invariants: tables are computed in fp32 as transformers computes them (its operations on its
operand types, so its rounding) and cast to the activation dtype on use; a table is ``[rows, R]``
with R the rotated width (``2 * ceil(dim / 2)``, ``dim = int(head_dim * partial_rotary_factor)``),
the head's dims from R on pass through unrotated.
"""

from __future__ import annotations

import math

import torch

from engine.kernels.native_rope import RopeStore
from engine.model.config import ModelConfig
from engine.model.rope_params import RopeParams, RopeScaling


def inv_freq(dim: int, theta: float, scaling: RopeScaling | None, key: int = 0) -> torch.Tensor:
    """[ceil(dim / 2)] fp32 inverse frequencies of the table ``key`` (`RopeParams.table_key`)."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    if scaling is not None and scaling.rope_type == "longrope":
        ext = torch.tensor(scaling.long_factor if key else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (ext * theta**shape)
    if scaling is not None and scaling.rope_type == "dynamic":
        return 1.0 / (_ntk_base(dim, theta, scaling, key) ** shape)
    freq = 1.0 / (theta**shape)
    if scaling is None:
        return freq
    if scaling.rope_type == "linear":
        return freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(freq, dim, theta, scaling)
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / scaling.factor, freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _ntk_base(dim: int, theta: float, s: RopeScaling, key: int) -> float | torch.Tensor:
    """Dynamic NTK's base for a call of ``key`` tokens (0: up to max_position_embeddings). transformers
    computes the first at load in Python floats and a grown one from the call's length as an int64
    tensor (so in fp32): both are reproduced."""
    exponent = dim / (dim - 2)
    if key == 0:
        n = s.max_position_embeddings
        return theta * ((s.factor * n / s.max_position_embeddings) - (s.factor - 1)) ** exponent
    seq_len = torch.tensor(key, dtype=torch.int64)
    return theta * ((s.factor * seq_len / s.max_position_embeddings) - (s.factor - 1)) ** exponent


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
    """Precomputed fp32 ``cos``/``sin`` of shape ``[K * max_positions, R]``: the table every forward
    call uses (K = 1), or longrope's short then long tables (K = 2), for ``params`` (default: the
    config's full-attention RoPE). Dynamic NTK's grown tables are computed per forward, for the
    tokens that need them (`lookup`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device,
                 params: RopeParams | None = None) -> None:
        self.params = params if params is not None else RopeParams(cfg.rope_theta, cfg.rope_scaling,
                                                                   cfg.partial_rotary_factor)
        self.dim = self.params.rotary_dim(cfg.head_dim)
        self.max_positions = max_positions
        self.device = device
        keys = (0, 1) if self.params.scaling is not None and self.params.scaling.rope_type == "longrope" else (0,)
        t = torch.arange(max_positions, dtype=torch.float32)
        tables = [self._table(t, k) for k in keys]
        self.cos = torch.cat([c for c, _ in tables]).to(device)  # [K * P, R]
        self.sin = torch.cat([s for _, s in tables]).to(device)

    @property
    def rotary_width(self) -> int:
        return self.cos.shape[1]

    def _table(self, positions: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, R] fp32 of table ``key`` at float ``positions`` [N] (transformers' forward)."""
        p = self.params
        freqs = positions.unsqueeze(1) * inv_freq(self.dim, p.theta, p.scaling, key).to(positions.device)  # [N, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, R]
        gain = p.scaling.attention_factor if p.scaling is not None else 1.0  # yarn's, longrope's
        return emb.cos() * gain, emb.sin() * gain

    def lookup(self, positions: torch.Tensor, lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
        """(cos [N, R], sin [N, R], rows [T]): token t is rotated by row ``rows[t]`` of the tables.
        ``lens`` [T]: the length of each token's forward call (None: a RoPE that ignores it)."""
        s = self.params.scaling
        if lens is None or not self.params.length_dependent:
            return self.cos, self.sin, positions
        assert s is not None
        if s.rope_type == "longrope":
            return self.cos, self.sin, positions + self.max_positions * (lens > s.original_max_position_embeddings)
        grown = lens > s.max_position_embeddings  # dynamic NTK: these tokens' calls grew the base
        if not bool(grown.any()):
            return self.cos, self.sin, positions
        cos, sin = self.cos[positions], self.sin[positions]  # [T, R], rows replaced below
        for key in torch.unique(lens[grown]).tolist():
            at = lens == key
            cos[at], sin[at] = self._table(positions[at].float(), int(key))
        return cos, sin, torch.arange(positions.shape[0], device=positions.device)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KV, D], positions, lens: [T] → rotated (q, k), same shapes and dtype."""
        cos, sin, rows = self.lookup(positions, lens)
        cos, sin = cos[rows].unsqueeze(1).to(q.dtype), sin[rows].unsqueeze(1).to(q.dtype)  # [T, 1, R]
        r = cos.shape[-1]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x_rot = x[..., :r]
            return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x[..., r:]], dim=-1)

        return rotate(q), rotate(k)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """rotate_half(x) * sin == roll(x, R/2) * [-sin | sin]: one table, no negation per step."""
    half = sin.shape[1] // 2
    return torch.cat([-sin[:, :half], sin[:, half:]], -1)


class RopeTables:
    """One `RotaryEmbedding` and its tables in the fast path's formats (the model holds one per
    distinct `RopeParams` of its layers)."""

    def __init__(self, rope: RotaryEmbedding, dtype: torch.dtype) -> None:
        self.rope = rope
        self.dtype = dtype
        self.cos = rope.cos.to(dtype)  # [K * P, R]
        self.sin_signed32 = _signed(rope.sin)  # [K * P, R] fp32
        self.sin_signed = self.sin_signed32.to(dtype)

    def _lookup(self, positions: torch.Tensor, lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """(cos [N, R] fp32, signed sin [N, R] fp32, rows [T]) as `RotaryEmbedding.lookup`."""
        cos, sin, rows = self.rope.lookup(positions, lens)
        return cos, (self.sin_signed32 if sin is self.rope.sin else _signed(sin)), rows

    def gathered(self, positions: torch.Tensor, lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin at ``positions`` [T] → [T, 1, R] each, in the activation dtype."""
        cos, sin, rows = self._lookup(positions, lens)
        if cos is self.rope.cos:  # the precomputed tables, already in the activation dtype
            return self.cos[rows].unsqueeze(1), self.sin_signed[rows].unsqueeze(1)
        return cos[rows].unsqueeze(1).to(self.dtype), sin[rows].unsqueeze(1).to(self.dtype)

    def store(self, positions: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
              cache_slots: int, lens: torch.Tensor | None = None) -> RopeStore:
        """The native RoPE + cache store of one forward (positions and slots checked once)."""
        cos, sin, rows = self._lookup(positions, lens)
        return RopeStore.for_batch(positions, slots, cos, sin, num_heads, num_kv_heads, cache_slots,
                                   head_dim=head_dim, rows=rows)


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by gathered (cos, signed sin) [T, 1, R] (`RopeTables.gathered`): each head's
    first R dims become ``x * cos + roll(x, R/2) * sin``, the rest pass through (partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return torch.addcmul(x * cos, torch.roll(x, r // 2, dims=-1), sin)
    part = x[..., :r]
    return torch.cat([torch.addcmul(part * cos, torch.roll(part, r // 2, dims=-1), sin), x[..., r:]], -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
