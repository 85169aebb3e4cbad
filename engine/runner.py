"""Turns per-sequence descriptions (tokens, positions, block tables) into model batches.

Owns: the only translation from block tables to cache slots, and the calls into `LlamaModel`.
Workers describe *what* to run with `PrefillChunk` / `DecodeSeq`; this module decides *how*.

Invariants: a block table must cover every position it is asked to write (checked, with a clear
error); the runner never allocates or frees blocks — that is the caller's `BlockPool`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.model import DecodeBatch, LlamaModel, PrefillBatch


@dataclass(frozen=True)
class PrefillChunk:
    """``token_ids`` are positions ``start_pos .. start_pos + len - 1`` of one sequence."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class DecodeSeq:
    """Feed ``token_id`` at ``position`` (the KV of positions ``< position`` is cached)."""

    token_id: int
    position: int
    block_table: Sequence[int]


class ModelRunner:
    """The device-touching half of a worker: a model and its KV cache."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = model.device

    def _slots(self, block_table: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        needed = int(positions.max()) // self.block_size + 1 if positions.numel() else 0
        if needed > len(block_table):
            raise ValueError(
                f"block table of {len(block_table)} blocks cannot hold position {int(positions.max())} "
                f"(block_size {self.block_size})"
            )
        bt = torch.tensor(list(block_table), dtype=torch.long, device=self.device)
        return bt[positions // self.block_size] * self.block_size + positions % self.block_size

    def prefill(self, chunks: Sequence[PrefillChunk], all_logits: bool = False) -> torch.Tensor:
        """Run the chunks in one forward.

        Returns fp32 logits: ``[len(chunks), vocab]`` for each chunk's last token, or
        ``[sum of lens, vocab]`` for every token when ``all_logits``.
        """
        if not chunks:
            raise ValueError("prefill of an empty batch")
        tokens: list[int] = []
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        ctx_slots: list[torch.Tensor | None] = []
        seq_lens: list[int] = []
        starts: list[int] = []
        last_rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("prefill chunk with no tokens")
            positions = torch.arange(c.start_pos, c.start_pos + n, device=self.device)
            pos_parts.append(positions)
            slot_parts.append(self._slots(c.block_table, positions))
            if c.start_pos > 0:
                all_pos = torch.arange(0, c.start_pos + n, device=self.device)
                ctx_slots.append(self._slots(c.block_table, all_pos))
            else:
                ctx_slots.append(None)
            tokens.extend(c.token_ids)
            seq_lens.append(n)
            starts.append(c.start_pos)
            last_rows.append(len(tokens) - 1)
        total = len(tokens)
        batch = PrefillBatch(
            token_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            positions=torch.cat(pos_parts),
            slots=torch.cat(slot_parts),
            seq_lens=seq_lens,
            start_positions=starts,
            context_slots=ctx_slots,
            logits_index=(
                torch.arange(total, device=self.device)
                if all_logits
                else torch.tensor(last_rows, dtype=torch.long, device=self.device)
            ),
        )
        return self.model.prefill(batch, self.cache)

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """One decode step for every sequence. Returns fp32 logits ``[len(seqs), vocab]``."""
        if not seqs:
            raise ValueError("decode of an empty batch")
        bs = self.block_size
        positions = torch.tensor([s.position for s in seqs], dtype=torch.long, device=self.device)
        max_len = int(positions.max()) + 1
        n_blocks = (max_len + bs - 1) // bs
        table = torch.zeros((len(seqs), n_blocks), dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            need = s.position // bs + 1
            if need > len(s.block_table):
                raise ValueError(
                    f"block table of {len(s.block_table)} blocks cannot hold position {s.position} "
                    f"(block_size {bs})"
                )
            table[i, :need] = torch.tensor(list(s.block_table[:need]), dtype=torch.long)
        cols = torch.arange(max_len, device=self.device)  # [L]
        slot_table = table[:, cols // bs] * bs + cols % bs  # [B, L]
        valid = cols.unsqueeze(0) <= positions.unsqueeze(1)  # [B, L]
        slots = slot_table.gather(1, positions.unsqueeze(1)).squeeze(1)  # [B]
        batch = DecodeBatch(
            token_ids=torch.tensor([s.token_id for s in seqs], dtype=torch.long, device=self.device),
            positions=positions,
            slots=slots,
            slot_table=slot_table,
            valid=valid,
        )
        return self.model.decode(batch, self.cache)
