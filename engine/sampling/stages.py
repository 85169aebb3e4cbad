"""What the two sampling paths share: the step's result type, its logit adjustments and its uniforms.

Owns: `Sampled` (a step's chosen ids, their log-probs and the most likely alternatives),
`bias_and_min_tokens` and `penalties` (stages 1 and 2 of
`engine.sampling.sampler`'s pipeline, a scatter over only the ids a row names), and `uniforms`
(each sampled row's one number of the draw).

Both the host path (`engine.sampling.sampler.sample`, numpy after these stages) and the device path
(`engine.sampling.device`) call the same functions here, so a logit is adjusted by the same
arithmetic wherever the logits live, and a row's uniform is the same number either way.

Invariants: host metadata reaches a device only through `engine.device_copy.send` (pinned, copied
without blocking the host), so building a step's metadata never waits for the device. On the CPU
`send` returns its tensor, so the host path's numbers are unchanged.
A uniform is drawn on the host in both paths: a seeded row's from its own generator seeded from
``(seed, step)``, so its text depends on the seed alone, not on where the logits were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from engine.device_copy import send

if TYPE_CHECKING:
    from engine.sampling.grammar import GrammarMatcher
    from engine.sampling.params import PenaltyBook, SamplerState

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, log-prob), the most likely first


class Sampled(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]  # of the chosen tokens, under the unmodified distribution
    top: list[TopLogprobs]  # per row, its params' top_logprobs most likely tokens (() for none)

    def rows(self, start: int, stop: int) -> Sampled:
        """Rows ``start:stop`` of the step (one caller's part of a batch it shared)."""
        return Sampled(self.token_ids[start:stop], self.logprobs[start:stop], self.top[start:stop])


def bias_and_min_tokens(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """logits: [B, V] → a copy with the biases added and, below min_tokens, the stop ids at -inf.

    Ids past the logits' width (a tokenizer larger than the model's head) have no logit to move."""
    V = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, st in enumerate(states):
        for tid, bias in st.params.logit_bias:
            if tid < V:
                rows.append(i)
                cols.append(tid)
                vals.append(bias)
        if st.step < st.params.min_tokens:
            for tid in st.min_tokens_mask_ids:
                if tid < V:
                    rows.append(i)
                    cols.append(tid)
                    vals.append(float("-inf"))
    if not rows:
        return logits
    dev = logits.device
    index = send(torch.tensor([rows, cols]), dev)  # [2, N]
    return logits.index_put((index[0], index[1]), send(torch.tensor(vals), dev), accumulate=True)


def penalties(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """logits: [B, V] → a copy with, for the rows that ask, the repetition penalty and then the
    frequency and presence penalties applied to the ids in each row's book (a gather, the
    penalties on those values, a scatter back); every other logit is left as it was."""
    V = logits.shape[1]
    rows: list[int] = []
    books: list[PenaltyBook] = []
    per_row: list[tuple[float, float, float]] = []
    for i, st in enumerate(states):
        p = st.params
        if p.repetition_penalty != 1.0 or p.counts_output:
            rows.append(i)
            books.append(st.book(V))
            per_row.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    sizes = np.array([b.size for b in books], dtype=np.int64)
    if not sizes.sum():
        return logits
    dev = logits.device
    where = np.stack([np.repeat(np.array(rows, dtype=np.int64), sizes), np.concatenate([b.ids for b in books])])
    row, col = send(torch.from_numpy(where), dev)  # [N] each
    c = send(torch.from_numpy(np.concatenate([b.counts for b in books])), dev)  # [N]
    each = send(torch.from_numpy(np.repeat(np.array(per_row, dtype=np.float32), sizes, axis=0)), dev)  # [N, 3]
    rep, freq, pres = each.unbind(1)  # [N] each
    v = logits[row, col]  # [N]
    v = torch.where(v < 0, v * rep, v / rep)  # transformers' repetition penalty
    v = v - c * freq - (c > 0).float() * pres  # OpenAI's frequency and presence penalties
    return logits.index_put((row, col), v)


def adjusted(raw: torch.Tensor, states: Sequence[SamplerState],
             grammar_mask: Callable[[torch.Tensor, list[GrammarMatcher | None]], torch.Tensor]) -> torch.Tensor:
    """The pipeline's first stages on ``raw`` [B, V] fp32, each only where a row needs it: logit_bias
    and min_tokens, the grammar mask (``grammar_mask``: the host's or the device's form of the same
    mask), then the penalties. Returns ``raw`` itself where no stage applies."""
    params = [st.params for st in states]
    x = raw
    if any(p.logit_bias or st.step < p.min_tokens for p, st in zip(params, states, strict=True)):
        x = bias_and_min_tokens(x, states)
    if any(st.grammar is not None for st in states):
        x = grammar_mask(x, [st.grammar for st in states])
    if any(p.repetition_penalty != 1.0 or p.counts_output for p in params):
        x = penalties(x, states)
    return x


def uniforms(states: Sequence[SamplerState]) -> np.ndarray:
    """[b] float64 in [0, 1): a seeded row's from its own generator (one number per token), the
    other rows' from torch's default generator in one call."""
    u = torch.rand(len(states), dtype=torch.float64).tolist()
    for i, st in enumerate(states):
        gen = st.generator()
        if gen is not None:
            u[i] = float(torch.rand(1, generator=gen, dtype=torch.float64)[0])
    return np.array(u)
