"""`KVLayout`: the fingerprint of a paged KV cache, compared before any byte moves.

Owns: the six numbers and names that decide whether the bytes of one process's KV blocks mean the
same thing in another (architecture family, layers, KV heads, head dim, dtype, block size), the
byte/block arithmetic derived from them, and their wire form.

Invariants: a `KVLayout` is frozen and valid (positive bounded sizes, a canonical dtype name such as
``"float32"`` / ``"bfloat16"``); two layouts are compatible iff they are equal; a mismatch is
refused naming every differing field, never reinterpreted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.config import parse_dtype
from engine.kv_cache import KVCache
from engine.model.config import ModelConfig
from kv_transfer.errors import CodecError, TransferRefused
from kv_transfer.wire import NAME_RE, Fields

#: Canonical dtype names a layout may carry (``str(torch.dtype)`` without ``torch.``).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_MAX_LAYERS = 1024
_MAX_HEADS = 1024
_MAX_HEAD_DIM = 4096
_MAX_BLOCK_SIZE = 4096


def dtype_name(dtype: str | torch.dtype) -> str:
    """``"bf16"`` / ``torch.bfloat16`` → ``"bfloat16"``; dtypes a layout cannot carry raise ValueError."""
    name = str(parse_dtype(dtype)).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"KV dtype {name!r} is not transferable; expected one of {sorted(DTYPES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """What a block of KV means: per block, per layer, K and V of ``[block_size, kv_heads, head_dim]``."""

    arch: str  # model family ("llama", "qwen2", ...): same shapes but different models must not mix
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # canonical name, see DTYPES
    block_size: int

    def __post_init__(self) -> None:
        if type(self.arch) is not str or not NAME_RE.fullmatch(self.arch):
            raise ValueError(f"KVLayout.arch must match {NAME_RE.pattern}, got {self.arch!r}")
        for name, hi in (("num_layers", _MAX_LAYERS), ("num_kv_heads", _MAX_HEADS),
                         ("head_dim", _MAX_HEAD_DIM), ("block_size", _MAX_BLOCK_SIZE)):
            v = getattr(self, name)
            if type(v) is not int or not 1 <= v <= hi:
                raise ValueError(f"KVLayout.{name} must be an integer in [1, {hi}], got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_cache(cls, cache: KVCache, arch: str) -> KVLayout:
        block_size, kv_heads, head_dim = cache.block_shape
        return cls(arch=arch, num_layers=cache.num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                   dtype=dtype_name(cache.dtype), block_size=block_size)

    @classmethod
    def from_model(cls, model_cfg: ModelConfig, dtype: str | torch.dtype, block_size: int) -> KVLayout:
        return cls(arch=model_cfg.family, num_layers=model_cfg.num_layers,
                   num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
                   dtype=dtype_name(dtype), block_size=block_size)

    # --- arithmetic ---------------------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``[block_size, kv_heads, head_dim]``: one block of one layer, K or V."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers, K and V (same as `KVCache.block_nbytes`)."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for_tokens(self, n_tokens: int) -> int:
        """``ceil(n_tokens / block_size)``: the blocks that hold a prompt of ``n_tokens``."""
        return -(-n_tokens // self.block_size)

    def nbytes_for_tokens(self, n_tokens: int) -> int:
        """Bytes moved to hand off ``n_tokens`` (whole blocks travel, the last one maybe partial)."""
        return self.blocks_for_tokens(n_tokens) * self.block_nbytes

    def staging_shape(self, n_blocks: int) -> tuple[int, ...]:
        """Shape of `KVCache.gather_blocks` output: ``[num_layers, 2, n_blocks, block_size, H, D]``."""
        return (self.num_layers, 2, n_blocks, *self.block_shape)

    # --- checks -------------------------------------------------------------------------------

    def mismatched_fields(self, other: KVLayout) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))

    def check_compatible(self, other: KVLayout) -> None:
        """Raise `TransferRefused` naming every field where ``other`` differs from ``self``."""
        bad = self.mismatched_fields(other)
        if bad:
            detail = ", ".join(f"{n}: {getattr(self, n)!r} vs {getattr(other, n)!r}" for n in bad)
            raise TransferRefused(f"KV layout mismatch ({detail})", fields=bad)

    def check_cache(self, cache: KVCache) -> None:
        """Raise ValueError if ``cache`` does not have this layout (a wiring bug, not a peer's fault)."""
        actual = KVLayout.from_cache(cache, self.arch)
        bad = self.mismatched_fields(actual)
        if bad:
            raise ValueError(f"KV cache does not match its declared layout in {bad}: {actual} vs {self}")

    # --- wire ---------------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, f: Fields) -> KVLayout:
        layout = cls(
            arch=f.get_str("arch", pattern=NAME_RE, max_len=64),
            num_layers=f.get_int("num_layers", lo=1, hi=_MAX_LAYERS),
            num_kv_heads=f.get_int("num_kv_heads", lo=1, hi=_MAX_HEADS),
            head_dim=f.get_int("head_dim", lo=1, hi=_MAX_HEAD_DIM),
            dtype=_wire_dtype(f),
            block_size=f.get_int("block_size", lo=1, hi=_MAX_BLOCK_SIZE),
        )
        f.finish()
        return layout


def _wire_dtype(f: Fields) -> str:
    name = f.get_str("dtype", pattern=NAME_RE, max_len=32)
    if name not in DTYPES:
        raise CodecError(f"{f.what}: field 'dtype' must be one of {sorted(DTYPES)}, got {name!r}")
    return name
