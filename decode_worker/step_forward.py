"""What one decode step runs on the model thread: its forwards and its one `sample` call.

Owns the device-touching half of a `decode_worker.worker.DecodeWorker` step: the batched decode
forward over the running sequences (`decode_seq` describes each), the prefill forward over the
chunks of the prompts prefilled here (their prompt log-probs scored with it), and the sampling of
every row the step produces, decode rows first, then each completed prompt's row once per choice of
its group (token 0 of each, each with its own sampler state).

Why one call on one thread: the model runs on the engine's `ModelThread`, one forward at a time,
and the step's sampling with it, so the event loop never waits on the device; `sample` is the step's
one wait for the device (it reads the sampled ids back).

Invariants: the sampler states passed in are those of this step's rows, which only this call reads
and records into; nothing else of the worker's state is touched here. Rows come back in the order
they went in: ``decode`` first, then ``ending``'s rows in order, ``len(states)`` rows each.
"""

from __future__ import annotations

import time

import torch

from decode_worker.seq_state import SeqState
from decode_worker.stream import Stream
from engine.runner import DecodeSeq, ModelRunner, PrefillChunk
from engine.sampling.prompt_logprobs import PromptLogprobs, ScoreAsk
from engine.sampling.sampler import Sampled, SamplerState, sample


def forward_and_sample(
    runner: ModelRunner, seqs: list[DecodeSeq], chunks: list[PrefillChunk], asks: list[ScoreAsk | None],
    decode: list[SamplerState], ending: list[tuple[int, list[SamplerState]]],
) -> tuple[Sampled, list[PromptLogprobs | None]]:
    """The decode and prefill forwards, then one `sample` call over the decode rows (``decode``:
    their states) and, for each prefill row in ``ending`` (row, its choices' states), that row once
    per choice. Returns the sampled rows and each chunk's scored prompt log-probs."""
    rows = [runner.decode(seqs)] if seqs else []  # [B, V]
    scored: list[PromptLogprobs | None] = []
    if chunks:
        pre, scored = runner.prefill_scored(chunks, asks)  # [len(chunks), V]
        rows += [pre[row : row + 1].expand(len(states), -1) for row, states in ending]  # [n, V] each
    states = decode + [s for _, group in ending for s in group]
    x = rows[0].contiguous() if len(rows) == 1 else torch.cat(rows) if rows else None  # [rows, V]
    out = sample(x, states) if x is not None else Sampled([], [], [])
    return out, scored


def decode_seq(st: Stream, seq: SeqState, rope_recompute_position: int | None) -> DecodeSeq:
    """The step's row for a running stream: its next token at the sequence's position. At the
    model's ``rope_recompute_position`` (Phi-3 longrope) the step recomputes the whole sequence, so
    the row carries the tokens before this one."""
    assert st.next_token is not None
    if st.decode_started is None:
        st.decode_started = time.monotonic()
    history = None
    if seq.num_tokens == rope_recompute_position:
        history = (*st.req.prompt_token_ids, *st.generated[:-1])
    return DecodeSeq(st.next_token, seq.num_tokens, seq.block_ids, history)


def split_firsts(sampled: Sampled, at: int, ending: list[tuple[int, list[SamplerState]]]) -> dict[int, Sampled]:
    """Per prefill row in ``ending``, its choices' tokens 0: ``sampled``'s rows from ``at`` on, in order."""
    firsts = {}
    for row, states in ending:
        firsts[row] = sampled.rows(at, at + len(states))
        at += len(states)
    return firsts
