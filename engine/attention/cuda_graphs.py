"""Decode steps captured as CUDA graphs, one per rung of a ladder of padded batch sizes.

Owns: `graph_ladder` and `rung_for` (which padded size a batch replays at), `padded_rows` (which
real row each padded row copies) and `DecodeGraphs` (static input buffers, capture, replay).

A batch of B rows replays the graph of the smallest rung >= B; its inputs are copied into static
buffers (token ids, positions, slots, a block table padded to a fixed width) and the step inside the
graph rebuilds its metadata from them, so nothing the graph reads is a tensor of the caller's. A
batch beyond the largest rung, or whose block table is wider than the buffers, returns None and runs
eager.

Invariants: a padded row is a copy of row 0 (same token, position, slot and block table), so it
writes the very K/V row 0 writes to row 0's slot and reads only row 0's blocks: padding never
touches another sequence's cache. Graphs share one memory pool and are captured largest first
where `DecodeGraphs.capture_all` runs; a graph reads the model and cache it was captured over, so
other ones drop the graphs; the logits returned are a copy (the graph's output buffer is rewritten
by the next replay). The step function must not read the batch's host-side lengths
(placeholders here) nor sync with the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.batch import DecodeBatch
from engine.device_copy import send

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

Step = Callable[[DecodeBatch], torch.Tensor]


def graph_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    rungs = []
    size = 1
    while size < max_num_seqs:
        rungs.append(size)
        size *= 2
    return (*rungs, max_num_seqs)


def rung_for(batch: int, ladder: tuple[int, ...]) -> int | None:
    """The smallest rung that holds ``batch`` rows (None: beyond the ladder)."""
    return next((rung for rung in ladder if rung >= batch), None)


def padded_rows(batch: int, rung: int) -> torch.Tensor:
    """[rung] int64: the real row each padded row takes its inputs from (rows ``batch..`` copy row 0)."""
    rows = torch.zeros(rung, dtype=torch.long)
    rows[:batch] = torch.arange(batch)
    return rows


class DecodeGraphs:
    """Captured decode steps for one engine (CUDA only; see the module docstring)."""

    def __init__(self, max_num_seqs: int, table_width: int, device: torch.device) -> None:
        self.ladder = graph_ladder(max_num_seqs)
        self.width = table_width
        top = self.ladder[-1]
        self.token_ids = torch.zeros(top, dtype=torch.long, device=device)  # [R] static inputs
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.zeros(top, dtype=torch.long, device=device)
        self.block_table = torch.zeros(top, table_width, dtype=torch.long, device=device)  # [R, W]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None  # shared by every rung's graph
        self.bound: tuple[object, ...] = ()  # the model and cache the graphs were captured over

    def static_batch(self, rung: int) -> DecodeBatch:
        """The static buffers' first ``rung`` rows as a batch (host lengths: upper-bound placeholders)."""
        return DecodeBatch(token_ids=self.token_ids[:rung], positions=self.positions[:rung], slots=self.slots[:rung],
                           block_table=self.block_table[:rung], context_lens=[self.width] * rung,
                           row_blocks=[self.width] * rung)

    def load(self, batch: DecodeBatch, rung: int) -> None:
        """Copy ``batch`` into the static buffers, padded to ``rung`` rows and the fixed table width."""
        rows = send(padded_rows(batch.batch, rung), self.token_ids.device)  # [rung]
        self.token_ids[:rung].copy_(batch.token_ids[rows])
        self.positions[:rung].copy_(batch.positions[rows])
        self.slots[:rung].copy_(batch.slots[rows])
        table = self.block_table[:rung]
        table.zero_()
        table[:, : batch.block_table.shape[1]].copy_(batch.block_table[rows])

    def capture(self, step: Step, rung: int) -> None:
        """Run ``step`` once eager on the loaded buffers (compiles, warms allocators), then capture it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(self.static_batch(rung))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[rung] = step(self.static_batch(rung))
        self.pool = graph.pool()
        self.graphs[rung] = graph

    def capture_all(self, step: Step, bound: tuple[object, ...]) -> None:
        """Capture every rung, largest first, on a dummy batch (slot 0 of block 0: only before serving)."""
        self.bound = bound
        for rung in reversed(self.ladder):
            if rung not in self.graphs:
                self.token_ids[:rung].zero_()
                self.positions[:rung].zero_()
                self.slots[:rung].zero_()
                self.block_table[:rung].zero_()
                self.capture(step, rung)

    def run(self, step: Step, batch: DecodeBatch, bound: tuple[object, ...]) -> torch.Tensor | None:
        """fp32 logits [B, vocab] of ``batch`` by replay (capturing its rung first if needed); None: run eager.

        ``bound``: what the step reads besides the buffers (the model, the cache); graphs captured
        over other objects are dropped first, since they read those objects' memory.
        """
        if bound != self.bound:
            self.graphs.clear()
            self.logits.clear()
            self.bound = bound
        rung = rung_for(batch.batch, self.ladder)
        if rung is None or batch.block_table.shape[1] > self.width:
            return None
        self.load(batch, rung)
        if rung not in self.graphs:
            self.capture(step, rung)
        self.graphs[rung].replay()
        return self.logits[rung][: batch.batch].clone()
