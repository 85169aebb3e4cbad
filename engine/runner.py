"""Turns per-sequence descriptions (tokens, positions, block tables) into model batches.

Owns: the only translation from block tables to cache slots, and the calls into `LlamaModel`
(a prefill's prompt log-probs included: `prefill_scored`, through `engine.sampling.prompt_logprobs`).
Workers describe *what* to run with `PrefillChunk` / `DecodeSeq`; this module decides *how*.

Invariants: a block table must cover every position it is asked to write (checked, with a clear
error); the runner never allocates or frees blocks — that is the caller's `BlockPool`. Everything a
step's layers share (slots, block tables, the decode mask) is built here once per step, in Python
lists packed into one host tensor and sent to the device in one pinned, non-blocking copy
(`engine.device_copy`): building a step never waits for the device, and the batch's tensors are views
of that one copy. Never per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import DecodeBatch, PrefillBatch
from engine.device_copy import host_tensor
from engine.kv_cache import KVCache
from engine.model.model import LlamaModel
from engine.sampling.prompt_logprobs import PromptLogprobs, ScoreAsk, score_rows


@dataclass(frozen=True)
class PrefillChunk:
    """``token_ids`` are positions ``start_pos .. start_pos + len - 1`` of one sequence whose prompt
    has ``prompt_len`` tokens (None: this chunk ends it). A chunked prefill must say it: a
    length-dependent RoPE (longrope, dynamic NTK) rotates every prompt token by the table of the
    whole prompt's length, as transformers' one prefill call does."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    prompt_len: int | None = None


@dataclass(frozen=True)
class DecodeSeq:
    """Feed ``token_id`` at ``position`` (the KV of positions ``< position`` is cached). ``history``:
    the tokens at positions ``0 .. position - 1``, needed only at the model's
    `ModelConfig.rope_recompute_position`, where the step recomputes the whole sequence."""

    token_id: int
    position: int
    block_table: Sequence[int]
    history: Sequence[int] | None = None


class ModelRunner:
    """The device-touching half of a worker: a model and its KV cache."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.device = model.device

    def _check_table(self, block_table: Sequence[int], last_pos: int) -> int:
        """Blocks needed to hold positions ``0..last_pos``; raises if the table is too short."""
        need = last_pos // self.block_size + 1
        if need > len(block_table):
            raise ValueError(
                f"block table of {len(block_table)} blocks cannot hold position {last_pos} "
                f"(block_size {self.block_size})"
            )
        return need

    def prefill(self, chunks: Sequence[PrefillChunk], all_logits: bool = False) -> torch.Tensor:
        """Run the chunks in one forward.

        Returns fp32 logits: ``[len(chunks), vocab]`` for each chunk's last token, or
        ``[sum of lens, vocab]`` for every token when ``all_logits``.
        """
        return self.model.prefill(self._prefill_batch(chunks, all_logits), self.cache)

    def prefill_scored(
        self, chunks: Sequence[PrefillChunk], asks: Sequence[ScoreAsk | None]
    ) -> tuple[torch.Tensor, list[PromptLogprobs | None]]:
        """`prefill` (each chunk's last-row logits, the same values), and the prompt log-probs of
        the chunks whose ask is not None (`engine.sampling.prompt_logprobs`); the others pay nothing more."""
        if len(asks) != len(chunks):
            raise ValueError(f"{len(asks)} asks for {len(chunks)} chunks")
        if all(a is None for a in asks):
            return self.prefill(chunks), [None] * len(chunks)
        batch = self._prefill_batch(chunks, all_logits=False)
        h = self.model.prefill_hidden(batch, self.cache)  # [T, hidden]
        scored: list[PromptLogprobs | None] = []
        offset = 0
        for chunk, ask in zip(chunks, asks, strict=True):
            n = len(chunk.token_ids)
            scored.append(None if ask is None else score_rows(self.model.logits, h[offset : offset + n], ask))
            offset += n
        return self.model.logits(h[batch.logits_index]), scored

    def _prefill_batch(self, chunks: Sequence[PrefillChunk], all_logits: bool) -> PrefillBatch:
        if not chunks:
            raise ValueError("prefill of an empty batch")
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        prompt_lens: list[int] = []
        starts: list[int] = []
        last_rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("prefill chunk with no tokens")
            end = c.start_pos + n
            if c.prompt_len is not None and c.prompt_len < end:
                raise ValueError(f"a prefill chunk ends at {end}, past its prompt of {c.prompt_len} tokens")
            need = self._check_table(c.block_table, end - 1)
            table = list(c.block_table[:need])
            positions.extend(range(c.start_pos, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start_pos, end))
            tables.append(table)
            tokens.extend(c.token_ids)
            seq_lens.append(n)
            prompt_lens.append(end if c.prompt_len is None else c.prompt_len)
            starts.append(c.start_pos)
            last_rows.append(len(tokens) - 1)
        total = len(tokens)
        token_ids, pos, slot_t, last, *table_ts = self._send(tokens, positions, slots, last_rows, *tables)
        return PrefillBatch(
            token_ids=token_ids,
            positions=pos,
            slots=slot_t,
            seq_lens=seq_lens,
            prompt_lens=prompt_lens,
            start_positions=starts,
            block_tables=table_ts,
            logits_index=torch.arange(total, device=self.device) if all_logits else last,
        )

    def _send(self, *rows: Sequence[int]) -> list[torch.Tensor]:
        """Int lists → int64 tensors on the device: one host tensor, one pinned non-blocking copy, and
        a view of it per list (`engine.device_copy.host_tensor`)."""
        flat = host_tensor([v for row in rows for v in row], self.device)  # [sum of lens]
        return list(flat.split([len(row) for row in rows]))

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """One decode step for every sequence. Returns fp32 logits ``[len(seqs), vocab]``.

        Rows run sorted by context length (backends may group similar lengths), then the logits are
        put back in the caller's order (a normal tensor, not an inference-mode one: callers may
        modify it in place).
        """
        if not seqs:
            raise ValueError("decode of an empty batch")
        redo = self.model.cfg.rope_recompute_position
        if redo is not None and any(s.position == redo for s in seqs):
            return self._decode_recomputing(seqs, redo)
        logits, order = self._decode_sorted(seqs)  # [B, vocab], sorted rows
        inverse = [0] * len(order)
        for row, i in enumerate(order):
            inverse[i] = row
        return logits[host_tensor(inverse, logits.device)]

    def _decode_recomputing(self, seqs: Sequence[DecodeSeq], redo: int) -> torch.Tensor:
        """A step in which the rows at position ``redo`` run as a prefill of their whole sequence
        (every position's KV rewritten, with the table of ``redo + 1`` tokens), the others decode."""
        whole = [i for i, s in enumerate(seqs) if s.position == redo]
        rest = [i for i, s in enumerate(seqs) if s.position != redo]
        chunks = []
        for i in whole:
            s = seqs[i]
            if s.history is None or len(s.history) != s.position:
                got = None if s.history is None else len(s.history)
                raise ValueError(f"a decode step at position {redo} recomputes its sequence: it needs the "
                                 f"{redo} tokens before it as history, got {got}")
            chunks.append(PrefillChunk([*s.history, s.token_id], 0, s.block_table))
        out = torch.empty(len(seqs), self.model.cfg.vocab_size, device=self.device)  # [B, vocab]
        out[host_tensor(whole, self.device)] = self.prefill(chunks)
        if rest:
            out[host_tensor(rest, self.device)] = self.decode([seqs[i] for i in rest])
        return out

    @torch.inference_mode()  # the step's tensors match the model's (a compiled kernel's guards read it)
    def _decode_sorted(self, seqs: Sequence[DecodeSeq]) -> tuple[torch.Tensor, list[int]]:
        bs = self.block_size
        needs = [self._check_table(s.block_table, s.position) for s in seqs]
        order = sorted(range(len(seqs)), key=lambda i: needs[i])
        seqs = [seqs[i] for i in order]
        needs = [needs[i] for i in order]
        n_blocks = needs[-1]
        # Padding blocks (block 0, always a valid id) lie beyond every position and are masked out.
        rows = [[*s.block_table[:need], *([0] * (n_blocks - need))] for s, need in zip(seqs, needs, strict=True)]
        pos_list = [s.position for s in seqs]
        slots = [row[p // bs] * bs + p % bs for row, p in zip(rows, pos_list, strict=True)]
        token_ids, positions, slot_t, table = self._send([s.token_id for s in seqs], pos_list, slots,
                                                         [b for row in rows for b in row])
        batch = DecodeBatch(
            token_ids=token_ids,  # [B]
            positions=positions,  # [B]
            slots=slot_t,  # [B]
            block_table=table.view(len(seqs), n_blocks),  # [B, n_blocks]
            context_lens=[p + 1 for p in pos_list],
            row_blocks=needs,
        )
        return self.model.decode(batch, self.cache), order

