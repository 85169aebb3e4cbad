"""The sampler's last stages: temperature, min-p, top-k and top-p as one cut per row, and the draw.

Owns `truncate` (a row's min-p, top-k and top-p at its temperature → the logit value ``cut``: the
row keeps every token whose logit is at least it), `draw` (a token among those kept, drawn by
inverse CDF in token-id order from one uniform number) and `argmax` (the greedy rows).

Why one cut per row: min-p, top-k (ties with the k-th kept, as transformers keeps them) and top-p
each keep a head of the row sorted by value, so together they keep a head too, and "every token at
or above ``cut``" names that set without an order among equal logits. Ties are common (bf16 logits
take a few thousand distinct values over a vocabulary of tens of thousands), and an order among
them would depend on how a sort or top-k happened to break them. top-p keeps every token tied with
the one its mass ends on; without ties its set is transformers' (the smallest head whose mass
reaches ``top_p``: a token is dropped when the mass strictly before it already reaches it). The
temperature is folded into the arithmetic (``exp((x - max) / T)``); no divided copy of a row is made.

Why the host (numpy): the cut needs the row's largest values in order, and the draw the kept tokens'
ids. numpy's partition, sort and argmax are vectorized (SIMD); torch's CPU top-k, sort and argmax
are many times slower on one thread. The cuts come from the tokens min-p leaves where it leaves
every truncated row fewer than `HEAD` (a comparison), else from each row's `HEAD` largest values
(a partition, then a sort of only those); a row whose nucleus reaches deeper sorts its whole row.
The draw's running sum goes over block sums, then one block. Logits on an accelerator take the
same rules as torch ops where they are (`engine.sampling.device`) and never come here.

Invariants: a row's cut and draw depend only on that row's logits, its params and its uniform
number ``u`` in [0, 1), never on the other rows; ``draw`` picks kept token ``j`` with probability
``w_j / sum(w)``, ``w = exp((x - max) / T)`` over the kept tokens in token-id order, as the first
token whose running sum of ``w`` exceeds ``u * sum(w)``. So a seeded row (``u`` from its own
generator, seeded from ``(seed, t)``) draws the same token in any batch and any process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

HEAD = 2048  # the largest values a row's cut is looked for among before its whole row is sorted


class Truncation(Protocol):
    """What a row's cut reads of its request (`engine.sampling.sampler.SamplingParams` has these)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...


def host(x: torch.Tensor) -> np.ndarray:
    """x: [B, V] fp32 → the same numbers as a numpy array (a view when x is on the CPU)."""
    return x.detach().cpu().numpy()


def argmax(x: torch.Tensor) -> np.ndarray:
    """x: [B, V] → [B] int64, each row's first largest logit (numpy's argmax is vectorized)."""
    if x.device.type == "cpu":
        return host(x).argmax(-1)
    return x.argmax(-1).cpu().numpy()


def truncate(a: np.ndarray, params: Sequence[Truncation]) -> np.ndarray:
    """a: [b, V] fp32 logits of sampled rows (temperature > 0) → [b] cuts, fp32 values held as
    float64: row ``i`` keeps the tokens ``j`` with ``a[i, j] >= cut[i]`` (``-inf``: every token)."""
    b, V = a.shape
    top = a.max(-1).astype(np.float64)  # [b]
    temp = np.array([p.temperature for p in params], dtype=np.float64)
    cut = np.full(b, -np.inf)
    min_p = np.array([p.min_p for p in params])
    on = min_p > 0  # p_j >= min_p * p_max  <=>  x_j >= x_max + T * log(min_p)
    cut[on] = _ceil32(top[on] + temp[on] * np.log(min_p[on]))
    ks = np.array([p.top_k if 0 < p.top_k < V else 0 for p in params])
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    rows = np.flatnonzero((ks > 0) | (top_p < 1.0))
    if rows.size == 0:
        return cut
    x = a if rows.size == b else a[rows]  # [n, V]
    heads = _survivors(x, cut[rows], int(ks.max()))  # [n, H] descending
    if heads is None:
        heads = _sorted_head(x, max(HEAD, int(ks.max())))
    k = ks[rows]
    on = k > 0  # ties with the k-th are kept: the cut is the k-th largest value
    cut[rows[on]] = np.maximum(cut[rows[on]], heads[on, k[on] - 1])
    on = top_p[rows] < 1.0
    if on.any():
        sel = rows[on]
        args = (top[sel], temp[sel], cut[sel], top_p[sel])
        cuts, done = _top_p_cut(_rows(heads, on), _rows(x, on), *args)
        deep = ~done  # the nucleus reaches past the head: sort those rows whole
        if deep.any():
            y = _rows(x, on)[deep]
            cuts[deep] = _top_p_cut(_sorted_head(y, V), y, *(v[deep] for v in args))[0]
        cut[sel] = cuts
    return cut


def _rows(a: np.ndarray, on: np.ndarray) -> np.ndarray:
    """a: [n, ...], on: [n] bool → the rows where on (a itself, not a copy, when that is all)."""
    return a if on.all() else a[on]


def _ceil32(v: np.ndarray) -> np.ndarray:
    """float64 → the smallest fp32 values >= them (as float64): for fp32 logits x, ``x >= v``
    and ``x >= _ceil32(v)`` agree, so a cut can be compared in fp32."""
    c = v.astype(np.float32)
    return np.where(c < v, np.nextafter(c, np.float32(np.inf)), c).astype(np.float64)


def _survivors(a: np.ndarray, lo: np.ndarray, need: int) -> np.ndarray | None:
    """a: [n, V], lo: [n] min-p's cuts → [n, W] float64, each row's values at or above its cut in
    descending order, padded with -inf to W (more than any row's count, and at least ``need``);
    None unless every row has a cut leaving fewer than `HEAD` tokens. min-p usually leaves a few:
    a comparison finds them for less than a partition costs."""
    if not np.isfinite(lo).all():
        return None
    alive = a >= lo.astype(np.float32)[:, None]  # [n, V]; lo holds fp32 values: exact
    counts = alive.sum(-1)
    if counts.max() >= HEAD:
        return None
    out = np.full((len(a), max(int(counts.max()) + 1, need)), -np.inf)
    for i, (row, keep) in enumerate(zip(a, alive, strict=True)):
        out[i, : counts[i]] = np.sort(row[keep])[::-1]
    return out


def _sorted_head(a: np.ndarray, h: int) -> np.ndarray:
    """a: [n, V] → [n, min(h, V)] float64, each row's largest values in descending order."""
    V = a.shape[1]
    part = np.partition(a, V - h, axis=-1)[:, V - h :] if h < V else a
    return np.sort(part, axis=-1)[:, ::-1].astype(np.float64)


def _top_p_cut(heads: np.ndarray, a: np.ndarray, top: np.ndarray, temp: np.ndarray, lo: np.ndarray,
               top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """heads: [n, H] descending largest values of a: [n, V], top / temp / lo (the cut so far) /
    top_p: [n] → ([n] cuts, [n] bool: the nucleus ended inside the head, so the cut is exact).

    The mass is renormalized over the tokens at or above ``lo`` (what min-p and top-k left): summed
    in the head where they are fewer than `HEAD`, else over the whole row. Which sum a row takes
    depends on the row alone, never on the head's width (the batch's largest top-k widens it), so
    its cut is the same in any batch to the last bit."""
    n, H = heads.shape
    w = np.exp((heads - top[:, None]) / temp[:, None])  # [n, H]
    alive = heads >= lo[:, None]
    w[~alive] = 0.0
    mass = np.cumsum(w, axis=-1)  # [n, H]
    total = mass[:, -1].copy()  # [n]
    many = alive.sum(-1) >= HEAD  # [n]: survivors may lie past the head
    if many.any():
        total[many] = _mass(_rows(a, many), top[many], temp[many], lo[many])
    goal = top_p * total  # [n]
    kept = (alive & (mass - w < goal[:, None])).sum(-1)  # [n] >= 1: mass strictly before < goal
    cut = np.maximum(lo, heads[np.arange(n), kept - 1])
    return cut, (mass[:, -1] >= goal) | (a.shape[1] <= H)


def _mass(a: np.ndarray, top: np.ndarray, temp: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """a: [n, V], top / temp / lo: [n] → [n] float64, the sum of ``exp((x - top) / T)`` over x >= lo
    (torch: its elementwise passes over whole rows are vectorized and allocate from its own pool)."""
    x = torch.from_numpy(a)
    e = x.sub(torch.from_numpy(top).float()[:, None]).div_(torch.from_numpy(temp).float()[:, None]).exp_()
    if (lo > -np.inf).any():
        e.masked_fill_(x < torch.from_numpy(lo).float()[:, None], 0.0)  # lo: fp32 values, exact
    return e.sum(-1).double().numpy()


def draw(a: np.ndarray, cut: np.ndarray, temps: np.ndarray, u: np.ndarray) -> np.ndarray:
    """a: [b, V] fp32 logits, cut / temps / u: [b] → [b] int64 token ids, each drawn among its
    row's tokens at or above its cut with probability ``exp((x - max) / T)`` normalized over them,
    by inverse CDF in token-id order at ``u`` (uniform in [0, 1))."""
    kept = a >= cut.astype(np.float32)[:, None]  # [b, V]; cuts are fp32 values, so this is exact
    out = np.empty(len(a), dtype=np.int64)
    for i, row in enumerate(a):
        ids = None if cut[i] == -np.inf else np.flatnonzero(kept[i])  # [n] ascending token ids
        x = row if ids is None else row[ids]
        w = np.exp((x - x.max()) / np.float32(temps[i]))  # [n] the kept tokens' weights
        j = _invert(w, u[i])
        out[i] = j if ids is None else ids[j]
    return out


BLOCK = 256  # the inverse CDF walks block sums, then one block: a whole vocabulary is ~200 blocks


def _invert(w: np.ndarray, u: float) -> int:
    """w: [n] weights (>= 0, some > 0), u in [0, 1) → the first ``j`` whose running sum of ``w``
    exceeds ``u * sum(w)``: the block sums' running sum finds the block, then the block's own."""
    if len(w) <= BLOCK:
        cdf = np.cumsum(w, dtype=np.float64)
        return int(np.searchsorted(cdf, u * cdf[-1], side="right"))  # u < 1: a weight > 0
    sums = np.cumsum(np.add.reduceat(w, np.arange(0, len(w), BLOCK), dtype=np.float64))  # [n / BLOCK]
    target = u * sums[-1]
    b = int(np.searchsorted(sums, target, side="right"))  # the first block past the target: sum > 0
    inner = w[b * BLOCK : (b + 1) * BLOCK]
    j = int(np.searchsorted(np.cumsum(inner, dtype=np.float64), target - (sums[b - 1] if b else 0.0),
                            side="right"))
    if j == len(inner):  # the block's own sum rounded below the target left in it: its last weight
        j = int(np.flatnonzero(inner)[-1])
    return b * BLOCK + j
