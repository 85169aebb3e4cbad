"""The CPU backend's decode attention over whole gathered blocks, and its scratch buffers.

Owns: `paged_decode_attention` (one new query per sequence, read from the paged cache by the method
`engine.kernels.attention_choice` timed fastest here: whole-block copies into one reused buffer,
then batched matmuls with the softmax in fp32, or the compiled / C++ kernels that read the blocks in
place), `PagedDecodeMeta` (what every layer of one step's group shares) and `Workspace` (per-thread
scratch). Why several methods: which is fastest, and the order of the others, differs between CPUs.

Invariants: every method computes the reference `engine.attention.ops.decode_attention` up to float
reassociation; padding positions carry ``-inf`` in the bias; scratch buffers are reused across
layers and steps but never carry information from one call to the next; soft-capping only by the
methods that form the scores themselves (`SOFTCAP_METHODS`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.ops import soft_cap


class Workspace:
    """Per-thread scratch tensors, grown on demand and reused by every layer and step.

    ``buffer`` contents are undefined on return; ``zeros`` buffers are zero when first made and the
    caller must only ever write the positions it rewrites on every use (here: a diagonal).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zero: bool
    ) -> torch.Tensor:
        store: dict[tuple[str, torch.dtype], torch.Tensor] = self._local.__dict__.setdefault("store", {})
        n = 1
        for d in shape:
            n *= d
        flat = store.get((name, dtype))
        if flat is None or flat.numel() < n or flat.device != device:
            flat = (torch.zeros if zero else torch.empty)(max(n, 1), dtype=dtype, device=device)
            store[(name, dtype)] = flat
        return flat[:n].view(shape)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._get(name, shape, dtype, device, zero=False)

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._get(name, shape, dtype, device, zero=True)


#: bf16 decode steps with at most this many (sequence, position) rows are cast to fp32 and take its paths.
SMALL_DECODE_ROWS = 512
#: The formulations of batched (B > 1) fp32 decode attention over the gathered blocks, plus
#: ``"compiled"`` (`engine.kernels.compiled_attention`: no gather, from 2 sequences up, any dtype) and
#: ``"native"`` (`engine.kernels.native_attention`: a C++ kernel, no gather, fp32 and bf16); which is
#: fastest differs between CPUs, even in its order (`engine.kernels.attention_choice` times them at load).
GATHERED_METHODS = ("sdpa", "per_head", "block_diagonal")
DECODE_METHODS = (*GATHERED_METHODS, "compiled", "native")
#: The methods that form the scores themselves, so they can soft-cap them (``softcap``).
SOFTCAP_METHODS = ("per_head", "block_diagonal")


@dataclass
class PagedDecodeMeta:
    """What every layer of one decode step shares (built once per step by `engine.runner`)."""

    block_ids: torch.Tensor  # [B * n_blocks] each sequence's block table, padded with any valid block id
    bias: torch.Tensor  # [B, 1, L] fp32: 0 at positions <= the sequence's position, -inf after; L = n_blocks * bs
    batch: int  # B
    n_blocks: int
    lengths: torch.Tensor | None = None  # [B] int64 visible positions (position + 1); derived from bias if None

    def visible(self) -> torch.Tensor:
        """[B] int64 positions each sequence sees (``1..n_blocks * bs``), computed once per step."""
        if self.lengths is None:
            self.lengths = (self.bias[:, 0] == 0).sum(-1)
        return self.lengths


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedDecodeMeta,
    ws: Workspace,
    scale: float,
    method: str = "per_head",
    softcap: float | None = None,
) -> torch.Tensor:
    """One new query token per sequence, read from the paged cache block by block.

    q: [B, H, D]; k_cache/v_cache: [num_blocks, bs, KV, D]. Returns [B, H * D].

    The blocks are copied whole (contiguous rows, ~memcpy speed) into one reused buffer in the
    cache's own layout ``[B, L, KV, D]``. GQA is folded into the matmul: each sequence's query
    becomes a block-diagonal ``[H, KV * D]`` matrix (head ``h`` sees only KV head ``h // G``), so
    ``Qblk @ K[B, L, KV * D]^T`` gives every head's scores against its own KV head with contiguous
    operands and no per-head loop, and ``P @ V[B, L, KV * D]`` gives ``[B, H, KV * D]`` of which
    each head keeps its own KV head's slice. That is KV times the minimal FLOPs, cheap next to
    reading K and V: on CPU it beats SDPA (slow for one query, in bf16 most) and, in bf16, per-head
    loops over strided views. In fp32
    the fastest of `GATHERED_METHODS` depends on the CPU: ``method`` picks one (`batched_decode_attention`);
    batch 1 needs no choice (`_single_decode_attention`); small bf16 steps
    (``B * L <= SMALL_DECODE_ROWS``) take the fp32 paths after a cast. ``method="compiled"`` skips all
    of this from 2 sequences up: `engine.kernels.compiled_attention` reads the blocks in place, in any dtype
    (at batch 1 its fixed cost is more than the one-sequence gather it saves);
    ``method="native"`` does the same at every batch size with `engine.kernels.native_attention`'s C++
    kernel, faster than both where it builds. ``softcap`` (a method of `SOFTCAP_METHODS` only): scores
    soft-capped before the mask.
    """
    _check_softcap(method, softcap)
    b, _, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    length = meta.n_blocks * bs
    dev, dt = q.device, k_cache.dtype
    if method == "native":  # any batch: no fixed cost worth a gather (batch 1 runs on one thread)
        from engine.kernels.native_attention import native_paged_attention

        return native_paged_attention(q, k_cache, v_cache, meta.block_ids.view(b, meta.n_blocks), meta.visible(),
                                      scale)
    if method == "compiled" and b > 1:  # batch 1: the gather is small and the compiled call's fixed cost is not
        from engine.kernels.compiled_attention import compiled_paged_attention  # imports inductor: only when used

        return compiled_paged_attention(q, k_cache, v_cache, meta.block_ids.view(b, meta.n_blocks), meta.bias,
                                        scale)
    kb = ws.buffer("k", (b * meta.n_blocks, bs, kvh, d), dt, dev)
    vb = ws.buffer("v", (b * meta.n_blocks, bs, kvh, d), dt, dev)
    torch.index_select(k_cache, 0, meta.block_ids, out=kb)
    torch.index_select(v_cache, 0, meta.block_ids, out=vb)
    if b == 1:
        return _single_decode_attention(q, kb, vb, meta.bias, scale, softcap)
    if dt == torch.float32 or b * length <= SMALL_DECODE_ROWS:
        # Small bf16 steps are faster converted to fp32 than through bf16 bmm's fixed costs.
        if dt != torch.float32:
            kb = ws.buffer("k32", tuple(kb.shape), torch.float32, dev).copy_(kb)
            vb = ws.buffer("v32", tuple(vb.shape), torch.float32, dev).copy_(vb)
        return batched_decode_attention(q, kb.view(b, length, kvh, d), vb.view(b, length, kvh, d), meta.bias,
                                        scale, method, ws, softcap)
    return _block_diagonal_decode_attention(q, kb.view(b, length, kvh, d), vb.view(b, length, kvh, d), meta.bias,
                                            scale, ws, softcap)


def batched_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, method: str,
    ws: Workspace, softcap: float | None = None,
) -> torch.Tensor:
    """Gathered fp32 K/V ``[B, L, KV, D]``, q [B, H, D], bias [B, 1, L] → [B, H * D] in q's dtype.

    ``method`` is one of `GATHERED_METHODS`; all compute the same attention up to float reassociation.
    """
    if method == "per_head":
        return _per_head_decode_attention(q, k, v, bias, scale, softcap)
    if method == "block_diagonal":
        return _block_diagonal_decode_attention(q.to(k.dtype), k, v, bias, scale, ws, softcap).to(q.dtype)
    _check_softcap(method, softcap)
    if method == "sdpa":
        b, h, d = q.shape
        out = F.scaled_dot_product_attention(  # q [B, H, 1, D] against k/v [B, KV, L, D] (strided views)
            q.to(k.dtype).unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias.unsqueeze(1),
            scale=scale, enable_gqa=True,
        )
        return out.reshape(b, h * d).to(q.dtype)
    raise ValueError(f"unknown decode attention method {method!r}; expected one of {GATHERED_METHODS}")


def _block_diagonal_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, ws: Workspace,
    softcap: float | None = None,
) -> torch.Tensor:
    """K/V ``[B, L, KV, D]`` (contiguous) and q [B, H, D] in one dtype, bias [B, 1, L] → [B, H * D]."""
    b, h, d = q.shape
    length, kvh = k.shape[1], k.shape[2]
    g, dt = h // kvh, k.dtype
    qblk = ws.zeros("qblk", (b, kvh, g, kvh, d), dt, q.device)  # only the kv == kv' diagonal is ever written
    qblk.diagonal(dim1=1, dim2=3).copy_(q.view(b, kvh, g, d).permute(0, 2, 3, 1))  # [B, G, D, KV]
    s = torch.bmm(qblk.view(b, h, kvh * d), k.reshape(b, length, kvh * d).transpose(1, 2))  # [B, H, L]
    if softcap is not None:
        s = soft_cap(s.float().mul_(scale), softcap)
        scale = 1.0
    s = torch.add(bias, s, alpha=scale)  # [B, H, L] fp32, padding at -inf
    p = torch.softmax(s, dim=-1)
    if p.dtype != dt:
        p = p.to(dt)
    o = torch.bmm(p, v.reshape(b, length, kvh * d))  # [B, H, KV * D]
    o = o.view(b, kvh, g, kvh, d).diagonal(dim1=1, dim2=3)  # [B, G, D, KV]: each head's own KV head
    return o.permute(0, 3, 1, 2).reshape(b, h * d)  # [B, H * D], h = kv * G + g


def _single_decode_attention(
    q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bias: torch.Tensor, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One sequence: q [1, H, D], its gathered blocks kb/vb [n_blocks, bs, KV, D], bias [1, 1, L].

    GQA without padding FLOPs: the KV heads are the bmm batch, each with its G query heads as rows,
    and K is read in place as the strided ``[KV, D, L]`` view (a transposed matrix to BLAS). In
    fp32 (bf16 is computed in fp32 here, like the other small steps); faster than SDPA for one
    query, which pays for a mask and general strides.
    """
    _, h, d = q.shape
    kvh = kb.shape[2]
    length = kb.shape[0] * kb.shape[1]
    k = kb.view(length, kvh, d).permute(1, 2, 0).float()  # [KV, D, L]
    v = vb.view(length, kvh, d).transpose(0, 1).float()  # [KV, L, D]
    s = _scores(bias.expand(kvh, h // kvh, length), q.float().view(kvh, h // kvh, d), k, scale, softcap)
    p = torch.softmax(s, dim=-1)  # [KV, G, L] fp32; padding positions at -inf get 0
    return torch.bmm(p, v).view(1, h * d).to(q.dtype)  # [1, H * D], h = kv * G + g


def _per_head_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """fp32 K/V ``[B, L, KV, D]``, q [B, H, D], bias [B, 1, L] → [B, H * D] in q's dtype.

    One baddbmm + softmax + bmm per KV head: ``k[:, :, kv]`` is a ``[B, L, D]`` view with row
    stride ``KV * D``, which batched BLAS reads in place, and the head's G query heads are the rows.
    """
    b, h, d = q.shape
    kvh, length = k.shape[2], k.shape[1]
    g = h // kvh
    qv = q.float().view(b, kvh, g, d)
    mask = bias.expand(b, g, length)
    outs = []
    for i in range(kvh):
        s = _scores(mask, qv[:, i], k[:, :, i].transpose(1, 2), scale, softcap)  # [B, G, L]
        outs.append(torch.bmm(torch.softmax(s, dim=-1), v[:, :, i]))  # [B, G, D]
    return torch.stack(outs, 1).view(b, h * d).to(q.dtype)  # h = kv * G + g


def _check_softcap(method: str, softcap: float | None) -> None:
    if softcap is not None and method not in SOFTCAP_METHODS:
        raise ValueError(f"decode attention {method!r} cannot soft-cap scores; use one of {SOFTCAP_METHODS}")


def _scores(bias: torch.Tensor, q: torch.Tensor, kt: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """``bias + scale * q @ kt`` (batched; one baddbmm), soft-capped before the bias where ``softcap``."""
    if softcap is None:
        return torch.baddbmm(bias, q, kt, alpha=scale)
    return soft_cap(torch.bmm(q, kt).mul_(scale), softcap).add_(bias)
