"""The sampling pipeline as batched torch ops on the logits' own device, with one copy back per step.

Owns `choose` (a step's logits and states → `Sampled`, recording nothing), `grammar_mask` (the
grammar stage from the matchers' packed bits) and `fetch` (the step's one device→host copy).
`engine.sampling.sampler.sample` calls `choose` for logits off the CPU; tests call it on the CPU,
so CI runs the code a GPU runs.

The rules are the host path's (engine/sampling/sampler.py and engine/sampling/draw.py say why),
stage by stage: ``logit_bias`` and ``min_tokens``, the grammar mask and the penalties by the same
functions (`engine.sampling.stages`); greedy rows take the first largest logit; a sampled row's cut
is the largest of min-p's (``x_max + T * log(min_p)`` rounded up to an fp32 value, its offset
computed on the host by the same numpy expression), top-k's (the k-th largest value, ties kept) and
top-p's (the value where the mass strictly before a token, summed in float64 over the row sorted in
descending order and renormalized over what min-p and top-k left, first reaches ``top_p``: ties
with the last kept); the draw is the first token, in id order, whose float64 running sum of the
fp32 weights ``exp((x - x_max) / T)`` over the kept tokens exceeds ``u`` times their total, with
``u`` the host's number for the row (`engine.sampling.stages.uniforms`). The log-probs are the
unmodified distribution's. No op depends on how a sort orders equal values.

Where the two paths may differ (rounding, never a rule): the host sums top-p's mass in fp32 over
the whole row where min-p and top-k leave `engine.sampling.draw.HEAD` tokens or more (here always
float64); running sums associate differently (a GPU's scan, the host's blocks of
`engine.sampling.draw.BLOCK`); torch's and numpy's ``exp`` may differ in the last bit. A row's
token can differ only where its ``u * total`` or top-p's goal lies within that rounding of a
boundary between two tokens.

Invariants: the host reads nothing computed from the logits except in `fetch`, once per step
(ids, log-probs and the top alternatives packed into one float64 tensor: ids below 2**53 are exact);
no op has a shape that depends on values (no boolean indexing, no ``nonzero``), so nothing else
waits on the device; host metadata (per-row parameters and uniforms, bias and penalty entries,
mask bits) reaches the device by `engine.device_copy.send`. A row's cut and draw read that row alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.device_copy import send
from engine.sampling.grammar import GrammarMatcher, mask_words
from engine.sampling.stages import Sampled, adjusted, uniforms

if TYPE_CHECKING:
    from engine.sampling.draw import Truncation
    from engine.sampling.params import SamplerState


def choose(logits: torch.Tensor, states: Sequence[SamplerState]) -> Sampled:
    """logits: [B, V], one row per state → the chosen ids, their log-probs and the top alternatives."""
    raw = logits.float()  # [B, V]
    B = raw.shape[0]
    dev = raw.device
    params = [st.params for st in states]
    x = adjusted(raw, states, grammar_mask)
    hot = [i for i, p in enumerate(params) if not p.greedy]
    if len(hot) == B:
        ids = _draw(x, params, uniforms(states))  # [B]
    else:
        ids = x.argmax(dim=-1)  # [B] the first largest
        if hot:
            index = send(torch.tensor(hot), dev)  # [b]
            drawn = _draw(x.index_select(0, index), [params[i] for i in hot], uniforms([states[i] for i in hot]))
            ids = ids.index_copy(0, index, drawn)
    lse = raw.logsumexp(dim=-1)  # [B]
    chosen = raw.gather(1, ids[:, None])[:, 0] - lse  # [B]
    ks = [p.top_logprobs for p in params]
    k = max(ks, default=0)
    cols = [ids.double()[:, None], chosen.double()[:, None]]
    if k:
        vals, idx = raw.topk(k, dim=-1)  # [B, k]
        cols += [(vals - lse[:, None]).double(), idx.double()]
    back = fetch(torch.cat(cols, dim=1))  # B rows of [id, log-prob, k log-probs, k ids]
    top = [tuple(zip((int(t) for t in r[2 + k : 2 + k + n]), r[2 : 2 + n], strict=True))
           for r, n in zip(back, ks, strict=True)]
    return Sampled([int(r[0]) for r in back], [r[1] for r in back], top)


def fetch(packed: torch.Tensor) -> list[list[float]]:
    """packed: [B, C] float64 on the device → its rows on the host: the step's one device→host copy."""
    return packed.cpu().tolist()


def grammar_mask(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """logits: [B, V] → a copy with every live matcher's disallowed tokens (and ids past its
    vocabulary) at -inf, as `engine.sampling.grammar.mask_logits`; the mask crosses as packed bits."""
    rows = [i for i, m in enumerate(matchers) if m is not None and m.live]
    if not rows:
        return logits
    live = [m for m in matchers if m is not None and m.live]
    dev = logits.device
    V = logits.shape[1]
    words = send(torch.from_numpy(mask_words(live)), dev)  # [b, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=dev)  # [32]
    bits = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)  # [b, 32 W]: bit t is token t
    n = min(V, live[0].vocab.size)
    allowed = torch.zeros(len(rows), V, dtype=torch.bool, device=dev)  # [b, V]
    allowed[:, :n] = bits[:, :n]
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    index = send(torch.tensor(rows), dev)  # [b]
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))


def _draw(a: torch.Tensor, params: Sequence[Truncation], u: np.ndarray) -> torch.Tensor:
    """a: [b, V] fp32 logits of sampled rows, u: [b] their uniforms → [b] int64 drawn ids."""
    b, V = a.shape
    temp = np.array([p.temperature for p in params], dtype=np.float64)
    min_p = np.array([p.min_p for p in params])
    off = np.full(b, -np.inf)  # min-p's cut less x_max (-inf: no min-p)
    on = min_p > 0  # p_j >= min_p * p_max  <=>  x_j >= x_max + T * log(min_p)
    off[on] = temp[on] * np.log(min_p[on])
    k = np.array([p.top_k if 0 < p.top_k < V else 0 for p in params], dtype=np.float64)
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    meta = send(torch.from_numpy(np.stack([temp, off, k, top_p, u])), a.device)  # [5, b] float64
    temp_d, off_d, k_d, top_p_d, u_d = meta.unbind(0)  # [b] each
    top = a.max(dim=-1).values  # [b] fp32
    cut = _ceil32(top.double() + off_d)  # [b] float64 holding fp32 values
    deep = np.flatnonzero((k > 0) | (top_p < 1.0))  # rows whose cut needs their values in order
    if deep.size == b:
        cut = _sorted_cut(a, top, cut, temp_d, k_d, top_p_d)
    elif deep.size:
        index = send(torch.from_numpy(deep), a.device)  # [n]
        sub = _sorted_cut(*(t.index_select(0, index) for t in (a, top, cut, temp_d, k_d, top_p_d)))
        cut = cut.index_copy(0, index, sub)
    w = a.sub(top[:, None]).div_(temp_d.float()[:, None]).exp_()  # [b, V] fp32 weights
    w.masked_fill_(a < cut.float()[:, None], 0.0)  # cuts are fp32 values: exact
    cdf = w.double().cumsum(dim=-1)  # [b, V]
    total = cdf[:, -1:].contiguous()  # [b, 1]
    j = torch.searchsorted(cdf, u_d[:, None] * total, right=True)  # the first running sum past u * total
    last = torch.searchsorted(cdf, total)  # the last weight > 0, where rounding left u * total at the total
    return torch.minimum(j, last)[:, 0]


def _ceil32(v: torch.Tensor) -> torch.Tensor:
    """[n] float64 → the smallest fp32 values >= them, as float64 (`engine.sampling.draw._ceil32`)."""
    c = v.float()
    return torch.where(c.double() < v, torch.nextafter(c, torch.full_like(c, float("inf"))), c).double()


def _sorted_cut(a: torch.Tensor, top: torch.Tensor, cut: torch.Tensor, temp: torch.Tensor, k: torch.Tensor,
                top_p: torch.Tensor) -> torch.Tensor:
    """a: [n, V] fp32, top: [n] fp32 row maxima, cut (min-p's) / temp / k / top_p: [n] float64 →
    [n] float64 cuts after top-k (the k-th largest, ties kept) and top-p (ties with its last kept)."""
    s = a.sort(dim=-1, descending=True).values  # [n, V] fp32
    kth = s.gather(1, (k.long() - 1).clamp(min=0)[:, None])[:, 0].double()  # [n]
    lo = torch.where(k > 0, torch.maximum(cut, kth), cut)  # [n] float64 holding fp32 values
    alive = s >= lo.float()[:, None]  # [n, V]; exact
    w = s.double().sub_(top.double()[:, None]).div_(temp[:, None]).exp_().masked_fill_(~alive, 0.0)  # [n, V]
    before = w.cumsum(dim=-1)  # [n, V]
    goal = top_p * before[:, -1]  # [n]: renormalized over what min-p and top-k left
    before.sub_(w)  # the mass strictly before each token
    kept = (alive & (before < goal[:, None])).sum(dim=-1)  # [n] >= 1
    nucleus = torch.maximum(lo, s.gather(1, (kept - 1)[:, None])[:, 0].double())
    return torch.where(top_p < 1.0, nucleus, lo)
