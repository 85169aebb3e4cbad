"""Which decode attention method this machine runs fastest, measured at load.

Owns: the choice among `attention.DECODE_METHODS` for the fast path's decode steps, and the
timings behind it. The gathered methods (sdpa / per_head / block_diagonal) differ in how batched
fp32 steps (and small bf16 steps, which run in fp32) multiply the gathered blocks; ``"compiled"``
(`engine.kernels.compiled_attention`) and ``"native"`` (`engine.kernels.native_attention`) read the blocks in
place. Why measure: the fastest, and the order of the others, differs between CPUs of the same
kind of machine (results/engine.json records what each host picked).

How: `paged_decode_attention` itself (gather included) runs with every method on synthetic paged
caches of the model's head geometry and dtype, one per "layer", enough layers that they stream from
memory as a real step's do, at a short and a long step (`SIZES`, the batch halved until one layer's
context fits `MAX_BUFFER_BYTES`), methods interleaved, best of ``repeats``. The fastest at the long
step serves every step, unless another one was fastest at the short step: that one then serves
the steps up to the geometric mean of the two sizes' rows (`AttentionChoice.method_for`).
``"compiled"`` and ``"native"`` (`engine.kernels.native_attention`, a C++ kernel built here) are only
candidates when ``allow_compiled`` and they build and run (the compiled one's first call compiles
it); a failure (no C++ compiler, an inductor error) is logged and leaves the others.

Once per process: an engine's backend asks `remembered_decode_attention`, which times each head
geometry, dtype and torch thread count the first time it is asked and hands the same choice to every
later engine of that shape (a process holding several engines, as tests and benchmarks do, would
otherwise measure the same machine again for each).

Invariants: every method computes the same attention up to float reassociation (tested against
the reference `attention.decode_attention`), so the choice changes speed only; a pinned method is
never timed (a pinned ``"compiled"`` is tried once and refused with the reason if it cannot run);
off-CPU devices are not timed here (no sync point in the loop) and get ``"sdpa"``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from engine.config import DECODE_ATTENTION
from engine.kernels.gathered_decode import (
    GATHERED_METHODS,
    SOFTCAP_METHODS,
    PagedDecodeMeta,
    Workspace,
    paged_decode_attention,
)
from engine.kernels.kernel_choice import best_of_interleaved
from engine.kernels.native_attention import native_error

log = logging.getLogger(__name__)

SIZES = ((8, 272), (32, 1040))  # (sequences, positions) of the timed steps
MAX_BUFFER_BYTES = 64 * 2**20  # one layer's K (or V) context at most
STREAM_BYTES = 256 * 2**20  # the K + V caches of all timed layers together, at least (up to MAX_LAYERS)
MAX_LAYERS = 16
BLOCK = 16


@dataclass(frozen=True)
class AttentionChoice:
    """The method decode steps use, and its timings (empty when pinned).

    ``method`` serves every step, except that with a ``small_method`` the steps of at most
    ``split_rows`` (sequence, position) rows take that one: the fastest method for a short step and
    for a long one can differ (the compiled one has a fixed cost per call and reads no gather).
    """

    method: str
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # method → "BxL" → best ms of one call
    small_method: str | None = None
    split_rows: int = 0

    def method_for(self, rows: int) -> str:
        """The method for a step (or group) of ``rows`` = sequences x padded positions."""
        return self.small_method if self.small_method is not None and rows <= self.split_rows else self.method

    def summary(self) -> str:
        if not self.ms:
            return self.method
        times = ", ".join(f"{m} " + "/".join(f"{t:.2f}" for t in by.values()) for m, by in self.ms.items())
        pick = self.method
        if self.small_method:
            pick = f"{self.small_method} up to {self.split_rows} rows, then {self.method}"
        return f"{pick} (ms at {'/'.join(next(iter(self.ms.values())))}: {times})"


@dataclass
class _Step:
    """A synthetic decode step over ``layers`` paged caches: scattered block tables, padded rows.

    One call runs it on every layer's cache in turn, as a decode step does, so the caches stream
    from memory instead of staying in the CPU's cache (`STREAM_BYTES`): a gather that reads a hot
    cache is several times cheaper than one in a real step, and the choice would favour it.
    """

    q: torch.Tensor  # [B, H, D]
    k_caches: list[torch.Tensor]  # per layer [num_blocks, BLOCK, KV, D]
    v_caches: list[torch.Tensor]
    meta: PagedDecodeMeta

    @classmethod
    def make(cls, batch: int, length: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             g: torch.Generator, layers: int | None = None) -> _Step:
        nb = -(-length // BLOCK)
        n = batch * nb + 1
        k = torch.randn(n, BLOCK, kv_heads, head_dim, generator=g).to(dtype)  # [num_blocks, BLOCK, KV, D]
        v = torch.randn(n, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
        if layers is None:
            layers = min(MAX_LAYERS, max(1, -(-STREAM_BYTES // (2 * k.numel() * k.element_size()))))
        table = torch.randperm(n, generator=g)[: batch * nb]  # [B * nb]
        bias = torch.zeros(batch, 1, nb * BLOCK)
        bias[1:, :, nb * BLOCK // 2 :] = float("-inf")  # padded rows, as in a step of mixed lengths
        q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
        return cls(q, [k] + [k.clone() for _ in range(layers - 1)], [v] + [v.clone() for _ in range(layers - 1)],
                   PagedDecodeMeta(table, bias, batch, nb))

    def run(self, method: str, ws: Workspace) -> float:
        """Milliseconds per layer of one pass over the layers."""
        scale = self.q.shape[-1] ** -0.5
        t0 = time.perf_counter()
        for k, v in zip(self.k_caches, self.v_caches, strict=True):
            paged_decode_attention(self.q, k, v, self.meta, ws, scale, method)
        return (time.perf_counter() - t0) * 1e3 / len(self.k_caches)


def _steps(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[_Step]:
    g = torch.Generator().manual_seed(0)
    out = []
    for batch, length in SIZES:
        while batch > 2 and batch * length * kv_heads * head_dim * dtype.itemsize > MAX_BUFFER_BYTES:
            batch //= 2
        out.append(_Step.make(batch, length, heads, kv_heads, head_dim, dtype, g))
    return out


def compiled_error(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """None if ``"compiled"`` runs here (its first call compiles it), else why not."""
    try:
        with torch.inference_mode():  # the timed steps are made the same way: one graph serves both
            step = _Step.make(2, 2 * BLOCK, heads, kv_heads, head_dim, dtype, torch.Generator(), layers=1)
            step.run("compiled", Workspace())
    except Exception as e:  # no compiler, an inductor or dynamo error: any of them rules it out
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def time_methods(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 methods: tuple[str, ...] = GATHERED_METHODS, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Best-of-``repeats`` milliseconds of one `paged_decode_attention` call per method and size."""
    ws = Workspace()
    ms: dict[str, dict[str, float]] = {m: {} for m in methods}
    with torch.inference_mode():
        for step in _steps(heads, kv_heads, head_dim, dtype):
            runs = {m: functools.partial(step.run, m, ws) for m in methods}
            for m, t in best_of_interleaved(runs, repeats).items():
                ms[m][f"{step.meta.batch}x{step.meta.n_blocks * BLOCK}"] = t
    return ms


def choose_decode_attention(heads: int, kv_heads: int, head_dim: int, mode: str = "auto",
                            device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                            allow_compiled: bool = True, softcap: bool = False) -> AttentionChoice:
    """``mode`` pins a method; ``"auto"`` times the candidates (`time_methods`) on CPU. ``softcap``:
    the model soft-caps its scores, which only `SOFTCAP_METHODS` do."""
    if mode not in DECODE_ATTENTION:
        raise ValueError(f"unknown decode_attention {mode!r}; expected one of {DECODE_ATTENTION}")
    if softcap and mode not in ("auto", *SOFTCAP_METHODS):
        raise ValueError(f"decode_attention={mode!r} cannot soft-cap attention scores (this model's "
                         f"attn_logit_softcapping); use 'auto' or one of {SOFTCAP_METHODS}")
    in_place = {"compiled": lambda: compiled_error(heads, kv_heads, head_dim, dtype), "native": native_error}
    if mode in in_place and (err := in_place[mode]()):
        raise RuntimeError(f"decode_attention={mode!r} cannot run here ({err}); use 'auto' or an eager method")
    if mode != "auto":
        return AttentionChoice(mode)
    if torch.device(device).type != "cpu":
        return AttentionChoice(SOFTCAP_METHODS[0] if softcap else "sdpa")
    methods: tuple[str, ...] = SOFTCAP_METHODS if softcap else GATHERED_METHODS
    for method, error in in_place.items() if allow_compiled and not softcap else ():
        if (err := error()) is None:
            methods = (*methods, method)
        else:
            log.warning("%s decode attention unavailable, not timing it: %s", method, err)
    ms = time_methods(heads, kv_heads, head_dim, dtype, methods)
    sizes = list(next(iter(ms.values())))  # "BxL" keys, short step first
    small = min(ms, key=lambda m: ms[m][sizes[0]])
    large = min(ms, key=lambda m: ms[m][sizes[-1]])
    if small == large:
        return AttentionChoice(large, ms)
    rows = [math.prod(int(x) for x in k.split("x")) for k in (sizes[0], sizes[-1])]
    return AttentionChoice(large, ms, small_method=small, split_rows=int(math.sqrt(rows[0] * rows[1])))


#: the "auto" choices made in this process: (heads, kv_heads, head_dim, dtype, softcap, torch threads) → choice
_REMEMBERED: dict[tuple[int, int, int, torch.dtype, bool, int], AttentionChoice] = {}


def remembered_decode_attention(heads: int, kv_heads: int, head_dim: int, mode: str = "auto",
                                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                                softcap: bool = False) -> AttentionChoice:
    """`choose_decode_attention`, its CPU timing done once per process for each head geometry, dtype and
    torch thread count (what the timings depend on here); pinned modes and other devices go straight
    through."""
    if mode != "auto" or torch.device(device).type != "cpu":
        return choose_decode_attention(heads, kv_heads, head_dim, mode, device, dtype, softcap=softcap)
    key = (heads, kv_heads, head_dim, dtype, softcap, torch.get_num_threads())
    if key not in _REMEMBERED:
        _REMEMBERED[key] = choose_decode_attention(heads, kv_heads, head_dim, mode, device, dtype, softcap=softcap)
    return _REMEMBERED[key]
