"""Hand-built attention inputs for backend tests: a spec, a paged cache and the batches a runner would build.

Owns: `make_spec` (an `AttentionSpec` over tiny RoPE tables: one per distinct partial-rotary factor
of the layers), `make_cache` (a cache whose every slot holds random values, so a slot read that
should not be shows in the output), `scattered_tables` (block tables of distinct, shuffled,
non-consecutive ids), `prefill_batch` and `decode_batch` (what `engine.runner` builds from
per-sequence descriptions: positions, slots, host lengths, padded tables).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.base import AttentionSpec, LayerAttention
from engine.batch import DecodeBatch, PrefillBatch
from engine.kv_cache import KVCache
from engine.model.config import ModelConfig
from engine.model.rope import RopeTables, RotaryEmbedding
from engine.model.rope_params import RopeParams, RopeScaling

MAX_POSITIONS = 256


def model_config(num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=32, hidden_size=num_heads * head_dim, intermediate_size=32,
                       num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=False, attention_bias=False)


def make_spec(layers: Sequence[LayerAttention], partial_factors: Sequence[float] = (1.0,), num_heads: int = 4,
              num_kv_heads: int = 2, head_dim: int = 16, dtype: torch.dtype = torch.float32,
              device: str = "cpu", scaling: RopeScaling | None = None) -> AttentionSpec:
    """A spec whose ``ropes[i]`` rotates the first ``partial_factors[i]`` share of each head."""
    cfg = model_config(num_heads, num_kv_heads, head_dim, len(layers))
    dev = torch.device(device)
    params = [RopeParams(10000.0, scaling, f) for f in partial_factors]
    ropes = [RopeTables(RotaryEmbedding(cfg, MAX_POSITIONS, dev, p), dtype) for p in params]
    return AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, layers=tuple(layers),
                         ropes=ropes, length_dependent=any(p.length_dependent for p in params), device=dev,
                         dtype=dtype)


def make_cache(spec: AttentionSpec, num_blocks: int, block_size: int, seed: int = 0) -> KVCache:
    """Random contents in every slot (the cached prefixes, and garbage elsewhere), scaled up so a leak shows."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    def one() -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 2).to(spec.device, spec.dtype)

    n = len(spec.layers)
    return KVCache(k=[one() for _ in range(n)], v=[one() for _ in range(n)], block_size=block_size)


def scattered_tables(blocks_per_seq: Sequence[int], num_blocks: int, seed: int = 0,
                     shared: int = 0) -> list[torch.Tensor]:
    """Disjoint block tables of shuffled ids drawn from ``1..num_blocks-1``; the first ``shared``
    blocks of every table are the same ids (a prefix-cache hit shared by the sequences)."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    common, rest = ids[:shared], ids[shared:]
    tables = []
    for n in blocks_per_seq:
        own, rest = rest[: n - shared], rest[n - shared:]
        tables.append(torch.tensor(common + own, dtype=torch.long))
    return tables


def slots_of(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size


def prefill_batch(starts: Sequence[int], lens: Sequence[int], tables: Sequence[torch.Tensor],
                  block_size: int, device: str = "cpu") -> PrefillBatch:
    """Chunk i: ``lens[i]`` tokens from position ``starts[i]`` of the sequence with ``tables[i]``."""
    positions = [torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]
    slots = [slots_of(t, p, block_size) for t, p in zip(tables, positions, strict=True)]
    ends = [s + n for s, n in zip(starts, lens, strict=True)]
    return PrefillBatch(
        token_ids=torch.zeros(sum(lens), dtype=torch.long, device=device), positions=torch.cat(positions).to(device),
        slots=torch.cat(slots).to(device), seq_lens=list(lens), prompt_lens=list(ends), start_positions=list(starts),
        block_tables=[t[: -(-e // block_size)].to(device) for t, e in zip(tables, ends, strict=True)],
        logits_index=(torch.tensor(lens, dtype=torch.long).cumsum(0) - 1).to(device),
    )


def decode_batch(positions: Sequence[int], tables: Sequence[torch.Tensor], block_size: int,
                 width: int, device: str = "cpu") -> DecodeBatch:
    """Row i: the token at ``positions[i]`` of the sequence with ``tables[i]``; tables padded with block 0."""
    pos = torch.tensor(list(positions), dtype=torch.long)
    table = torch.zeros(len(positions), width, dtype=torch.long)
    for i, (t, p) in enumerate(zip(tables, positions, strict=True)):
        table[i, : p // block_size + 1] = t[: p // block_size + 1]
    slots = torch.stack([slots_of(t, p, block_size) for t, p in zip(tables, pos, strict=True)])
    return DecodeBatch(token_ids=torch.arange(len(positions), device=device), positions=pos.to(device),
                       slots=slots.to(device), block_table=table.to(device), context_lens=[p + 1 for p in positions],
                       row_blocks=[p // block_size + 1 for p in positions])
