"""The device-generic ``torch`` attention backend: FlexAttention over the paged cache, SDPA for fresh prompts.

Owns: `TorchBackend` (registered as ``"torch"``) and `TorchStep`, its per-step metadata.

What runs where, per layer (the same code on CPU and CUDA, so CPU tests exercise what a GPU runs):
- decode rows and prefill chunks after a cached prefix: `flex_attention` reading the layer's cache
  in place through a block mask built from the block tables (`engine.attention.flex_meta`): no
  gather of the context, blocks outside a tile's list never read; GQA through ``enable_gqa``,
  windows through the mask, Gemma 2's soft-cap as a ``score_mod``.
- fresh prompts (every chunk starts at 0) in layers without window or soft-cap: on CUDA in fp16 /
  bf16 the packed chunks go to `torch.nn.attention.varlen.varlen_attn` in one call (FlashAttention's
  variable-length kernel: SDPA's flash kernel for packed sequences, GQA native); on CPU one SDPA
  ``is_causal`` call per chunk (the CPU flash kernel). A flex document mask would keep CUDA off
  FlashAttention, and SDPA with a block-diagonal mask falls to the math kernel under GQA. Elsewhere
  (fp32 on CUDA, where FlashAttention does not run) fresh chunks take the flex path.
- flex runs compiled on CUDA (`torch.compile(flex_attention)`: the first shapes static, then one
  dynamic-shape recompile), and eager on a CPU (``compiled=True`` there takes inductor's CPU flex
  kernel where it builds): on a CPU this backend is the exact twin CI runs of what a GPU runs, not a
  CPU speed path (that is the ``cpu`` backend); eager flex evaluates the mask over every cache slot,
  exact but with memory that grows with the cache.
- decode steps on CUDA with ``config.cuda_graphs`` replay CUDA graphs (`engine.attention.cuda_graphs`).

Invariants: metadata (RoPE rows per table, block masks per window) is built once per step from
host-side lengths and device tensors, never from a device value read back; a row's output does not
depend on other rows (padding rows and block-table padding are masked by the inverse block table).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionSpec, StepModel
from engine.attention.flex_meta import (
    Q_BLOCK,
    PagedMasks,
    decode_masks,
    prefill_masks,
    softcap_score_mod,
)
from engine.attention.ops import write_kv
from engine.batch import DecodeBatch, PrefillBatch
from engine.device_copy import send
from engine.kv_cache import KVCache
from engine.model.rope import rotate_rolled

if TYPE_CHECKING:
    from engine.attention.cuda_graphs import DecodeGraphs
    from engine.config import EngineConfig

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Kernel = Callable[..., torch.Tensor]


@dataclass
class TorchStep:
    """What every layer of one forward shares (built by ``prepare_*``)."""

    slots: torch.Tensor  # [T] cache slot of each token
    rope: list[tuple[torch.Tensor, torch.Tensor]]  # per `AttentionSpec.ropes` entry: cos, signed sin [T, 1, R]
    paged: PagedMasks | None  # flex block masks per window (None: no layer reads the cache)
    decode: bool  # queries are [B, H, 1, D] rows (else packed chunks [1, H, T, D])
    fresh_lens: list[int] | None = None  # fresh chunks' lengths where SDPA takes non-windowed, uncapped layers
    fresh_cu: torch.Tensor | None = None  # [S + 1] int32 their cumulative lengths (varlen's), on the device


class TorchBackend(AttentionBackend):
    """FlexAttention / SDPA over the paged cache (see the module docstring)."""

    name = "torch"

    def __init__(self, spec: AttentionSpec, config: EngineConfig, compiled: bool | None = None) -> None:
        super().__init__(spec, config)
        cuda = spec.device.type == "cuda"
        self.compiled = cuda if compiled is None else compiled
        self.flex: Kernel = torch.compile(_flex(), fullgraph=True) if self.compiled else _flex()
        self.windows = sorted({layer.window for layer in spec.layers}, key=lambda w: -1 if w is None else w)
        self.score_mods = {c: softcap_score_mod(c) for c in {layer.softcap for layer in spec.layers} if c is not None}
        # CUDA: tiles of the cache's block size (BLOCK_N); packed prefill on the main kernel with the
        # mask's query tile (the short-query kernel's BLOCK_M can exceed it); decode rows on the
        # flash-decoding kernel. The CPU kernel takes its own.
        self.kernel_options: dict[bool, dict[str, object]] | None = None
        if cuda:
            self.kernel_options = {
                False: {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_BLOCK, "BLOCK_N": config.block_size},
                True: {"BLOCK_N": config.block_size},
            }
        self.varlen = _varlen() if cuda and spec.dtype in (torch.float16, torch.bfloat16) else None
        self.graphs: DecodeGraphs | None = None
        if cuda and getattr(config, "cuda_graphs", True) and not spec.length_dependent:
            from engine.attention.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(config.max_num_seqs, _table_width(config), spec.device)

    @classmethod
    def unavailable(cls, spec: AttentionSpec, config: EngineConfig) -> str | None:
        try:
            from torch.nn.attention.flex_attention import BlockMask
        except ImportError:
            return f"torch {torch.__version__} has no FlexAttention (torch.nn.attention.flex_attention)"
        if "compute_q_blocks" not in inspect.signature(BlockMask.from_kv_blocks).parameters:
            return f"torch {torch.__version__}'s FlexAttention cannot build block masks of small blocks (needs 2.9+)"
        if spec.dtype not in _DTYPES:
            return f"dtype {spec.dtype} is not one of {_DTYPES}"
        if spec.head_dim < 16 or spec.head_dim % 8:
            return f"head_dim {spec.head_dim} is not a multiple of 8 of at least 16"
        if spec.device.type == "cuda" and config.block_size % 16:
            return f"block_size {config.block_size} is not a multiple of 16 (a FlexAttention tile on CUDA)"
        return None

    def prepare_prefill(self, batch: PrefillBatch, cache: KVCache) -> TorchStep:
        lens = None
        dev = batch.positions.device
        if self.spec.length_dependent:
            lens = send(torch.tensor(batch.prompt_lens).repeat_interleave(torch.tensor(batch.seq_lens)), dev)
        fresh = batch.fresh and (self.varlen is not None or self.spec.device.type == "cpu")
        cu = None
        if fresh and self.varlen is not None:
            cu = send(torch.tensor([0, *batch.seq_lens]).cumsum(0, dtype=torch.int32), dev)
        needs_flex = not fresh or self.spec.windowed or self.spec.softcapped
        paged = prefill_masks(batch.block_tables, batch.positions, batch.seq_lens, batch.start_positions,
                              cache.block_size, cache.num_blocks, self.windows) if needs_flex else None
        return TorchStep(batch.slots, self._rope(batch.positions, lens), paged, decode=False,
                         fresh_lens=list(batch.seq_lens) if fresh else None, fresh_cu=cu)

    def prepare_decode(self, batch: DecodeBatch, cache: KVCache) -> TorchStep:
        """Reads only device tensors and shapes (the host lengths may be a captured graph's placeholders)."""
        lens = batch.lengths if self.spec.length_dependent else None
        paged = decode_masks(batch.block_table, batch.positions, cache.block_size, cache.num_blocks, self.windows)
        return TorchStep(batch.slots, self._rope(batch.positions, lens), paged, decode=True)

    def _rope(self, positions: torch.Tensor, lens: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tables.gathered(positions, lens) for tables in self.spec.ropes]

    def forward(self, layer: int, qkv: torch.Tensor, cache: KVCache, meta: object) -> torch.Tensor:
        assert isinstance(meta, TorchStep)
        rule = self.spec.layers[layer]
        q, k, v = self.spec.split(qkv)  # [T, H, D], [T, KV, D], [T, KV, D]
        cos, sin = meta.rope[rule.rope]
        q, k = rotate_rolled(q, cos, sin), rotate_rolled(k, cos, sin)
        write_kv(cache.k[layer], cache.v[layer], meta.slots, k, v)
        t = q.shape[0]
        if meta.fresh_lens is not None and rule.window is None and rule.softcap is None:
            return self._fresh(q, k, v, meta, rule.scale).reshape(t, -1)
        assert meta.paged is not None
        nb, bs, kvh, d = cache.k[layer].shape
        keys = cache.k[layer].view(1, nb * bs, kvh, d).transpose(1, 2)  # [1, KV, NB * bs, D], in place
        values = cache.v[layer].view(1, nb * bs, kvh, d).transpose(1, 2)
        qh = q.unsqueeze(2) if meta.decode else q.transpose(0, 1).unsqueeze(0)  # [B, H, 1, D] / [1, H, T, D]
        score_mod = None if rule.softcap is None else self.score_mods[rule.softcap]
        out = self.flex(qh, keys, values, score_mod=score_mod,
                        block_mask=meta.paged.masks[rule.window], scale=rule.scale,
                        enable_gqa=self.spec.num_heads != kvh,
                        kernel_options=None if self.kernel_options is None else self.kernel_options[meta.decode])
        out = out.squeeze(2) if meta.decode else out.squeeze(0).transpose(0, 1)  # [T, H, D]
        return out.reshape(t, -1)

    def _fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchStep,
               scale: float) -> torch.Tensor:
        """Causal attention within each packed fresh chunk: q [T, H, D], k/v [T, KV, D] → [T, H, D]."""
        lens = meta.fresh_lens
        assert lens is not None
        if meta.fresh_cu is not None and self.varlen is not None:
            cu, most = meta.fresh_cu, max(lens)
            return self.varlen(q, k, v, cu, cu, most, most, scale=scale, window_size=(-1, 0), enable_gqa=True)
        outs = []
        for qc, kc, vc in zip(q.split(lens), k.split(lens), v.split(lens), strict=True):
            o = F.scaled_dot_product_attention(qc.transpose(0, 1), kc.transpose(0, 1), vc.transpose(0, 1),
                                               is_causal=True, scale=scale, enable_gqa=True)  # [H, S, D]
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    def decode_step(self, model: StepModel, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        if self.graphs is not None:
            logits = self.graphs.run(self._step(model, cache), batch, (model, cache))
            if logits is not None:
                return logits
        return super().decode_step(model, batch, cache)

    def warm_up(self, model: StepModel, cache: KVCache) -> None:
        """Capture every rung's decode graph before serving (writes slot 0 of block 0)."""
        if self.graphs is not None:
            self.graphs.capture_all(self._step(model, cache), (model, cache))

    def _step(self, model: StepModel, cache: KVCache) -> Callable[[DecodeBatch], torch.Tensor]:
        """A decode step as `AttentionBackend.decode_step` runs it, metadata included (what a graph captures)."""
        return lambda b: model.logits(model.forward(b.token_ids, cache, self.prepare_decode(b, cache)))

    def describe(self) -> str:
        flex = "flex compiled" if self.compiled else "flex eager"
        fresh = "flex"
        if self.varlen is not None or self.spec.device.type == "cpu":
            fresh = "varlen flash" if self.varlen is not None else "sdpa per chunk"
        graphs = f", cuda graphs {self.graphs.ladder}" if self.graphs is not None else ""
        return f"torch ({flex}; fresh prompts: {fresh}{graphs})"


def _flex() -> Kernel:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _varlen() -> Kernel | None:
    """`varlen_attn` where this torch has it with ``window_size`` (causal as ``(-1, 0)``), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return cast(Kernel, varlen_attn) if "window_size" in inspect.signature(varlen_attn).parameters else None


def _table_width(config: EngineConfig) -> int:
    """Columns of a captured step's block table: enough blocks for the longest sequence (an `Engine`
    passes its resolved ``max_model_len``; else ``num_blocks`` bounds it)."""
    longest = config.max_model_len or (config.num_blocks or 0) * config.block_size
    if not longest:
        raise ValueError("CUDA graphs need max_model_len or num_blocks to size their block tables")
    return -(-longest // config.block_size)


BACKEND = TorchBackend
