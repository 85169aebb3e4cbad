"""The Llama-family forward pass (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

Owns: one forward for a *batch of prefill chunks* (each sequence may start after cached prefix
tokens) and one for a *batched decode step* (one token per sequence, contexts of any length), each
in two variants chosen at construction:
- ``fast=True`` (default): oneDNN-prepacked weights (or int8, `engine.quant`) with the RMSNorm gains
  folded into the next linear's weight and the residual add fused into o_proj/down, RoPE for q and k
  in one pass from per-dtype tables gathered once per step, and `attention.paged_decode_attention`
  over the paged cache by the method `engine.attention_choice` timed fastest here (whole-block
  gathers then batched matmuls, or the compiled in-place kernel of `engine.compiled_attention`);
- ``fast=False``: the plain reference (``F.linear``, transformers' op order, slot-by-slot gathers,
  SDPA with a bool mask), kept to test the fast path against.
Batch preparation (positions, slots, block tables, masks) is the caller's (`engine.runner`); this
module only computes.

Invariants: every sequence in a batch is independent (its result does not depend on the others
beyond float reassociation); the KV of every input token is written to its slot before attention
reads it; logits come back in fp32; the model holds no per-request state (decode scratch buffers in
`attention.Workspace` are per thread and overwritten on every use).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention import (
    PagedDecodeMeta,
    Workspace,
    decode_attention,
    paged_decode_attention,
    prefill_attention,
    write_kv,
)
from engine.attention_choice import AttentionChoice, choose_decode_attention
from engine.config import EngineConfig, ModelConfig
from engine.kernel_choice import KernelChoice, build_linears
from engine.kv_cache import KVCache
from engine.native_attention import native_error
from engine.native_linear import NativeLinear
from engine.native_rope import MAX_HEAD_DIM, RopeStore, native_rope_error
from engine.native_step import NativeDecodeStep, native_step_error
from engine.quant import Linear
from engine.rope import RotaryEmbedding
from engine.weights import ModelWeights


@dataclass
class PrefillBatch:
    """Flattened inputs of several prefill chunks (built by `engine.runner`)."""

    token_ids: torch.Tensor  # [T] all chunks' tokens, concatenated
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each token
    seq_lens: list[int]  # tokens of each chunk; sums to T
    start_positions: list[int]  # cached tokens before each chunk
    context_blocks: list[torch.Tensor | None]  # per chunk: [ceil((start + len) / bs)] block ids, None if start == 0
    logits_index: torch.Tensor  # [N] rows of T whose logits are wanted


@dataclass
class DecodeBatch:
    """One decode step (built by `engine.runner`): every tensor here is shared by all layers."""

    token_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] slot of the new token
    block_table: torch.Tensor  # [B, n_blocks] padded with a valid block id (masked out)
    bias: torch.Tensor  # [B, 1, n_blocks * block_size] fp32: 0 where a position is visible, -inf after
    # Consecutive row ranges of similar context length, each padded only to its own longest: one
    # long sequence no longer makes every short one attend over its length. Empty: one group.
    groups: list[PagedDecodeMeta] = field(default_factory=list)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Matches transformers' LlamaRMSNorm: normalize in fp32, cast back, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


@dataclass
class LayerKernels:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [hidden] → [q_size + 2 * kv_size]
    o_proj: Linear  # [q_size] → [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [hidden] → [2 * intermediate]
    down: Linear  # [intermediate] → [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]: RMSNorm gain over each head of q before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim]


class LlamaModel:
    """Weights in their kernels' formats + the two forwards. Holds no per-request state.

    ``quantization="int8"`` stores every linear layer (lm_head included unless
    ``quantize_lm_head=False``) as weight-only int8; it implies the fast path. ``linear_kernels``
    picks the oneDNN weight format of the dense fast path (`engine.kernel_choice`): ``"auto"``
    times both per class of layers; ``kernel_choices`` records what each class got.
    ``decode_attention`` picks the fast path's decode attention method the same way
    (`engine.attention_choice`), recorded in ``attention_choice`` (None on the reference path).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        *,
        fast: bool = True,
        quantization: str | None = None,
        quantize_lm_head: bool = True,
        linear_kernels: str = "auto",
        decode_attention: str = "auto",
    ) -> None:
        self.cfg = cfg
        self.fast = fast or quantization is not None
        self.quantization = quantization
        self.embed = weights.embed  # [vocab, hidden]
        self.norm = weights.norm  # [hidden]
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.rope = RotaryEmbedding(cfg, max_positions, self.device)
        half = cfg.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin | sin]: one table, no negation per step.
        self._cos = self.rope.cos.to(self.dtype)  # [P, D]
        self._sin_signed32 = torch.cat([-self.rope.sin[:, :half], self.rope.sin[:, half:]], -1)  # [P, D] fp32
        self._sin_signed = self._sin_signed32.to(self.dtype)
        self.scale = cfg.head_dim**-0.5
        self.windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]  # None: full causal attention
        # RoPE + cache store in one native call per layer (`engine.native_rope`) where it builds.
        self.native_rope = (self.fast and self.device.type == "cpu" and cfg.head_dim <= MAX_HEAD_DIM
                            and native_rope_error() is None)
        self.ws = Workspace()
        self.attention_choice: AttentionChoice | None = (
            choose_decode_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, decode_attention, self.device,
                                    self.dtype)
            if self.fast else None
        )

        def fold(w: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
            if self.fast and norm is not None:
                # W @ (g * x) == (W * g) @ x: the fast path folds the RMSNorm gain g into the weight.
                return (w.float() * norm.float()).to(w.dtype)
            return w

        # One class of linears at a time (so `engine.kernel_choice` can time a class as a step
        # streams it); the loaded tensors are not kept where a packed or int8 kernel replaces them.
        lws = weights.layers
        none: list[torch.Tensor | None] = [None] * len(lws)
        classes: dict[str, Callable[[], tuple[list[torch.Tensor], list[torch.Tensor | None]]]] = {
            "qkv": lambda: ([fold(lw.qkv, lw.input_norm) for lw in lws], [lw.qkv_bias for lw in lws]),  # bias: Qwen2
            "o_proj": lambda: ([lw.o_proj for lw in lws], none),
            "gate_up": lambda: ([fold(lw.gate_up, lw.post_norm) for lw in lws], none),
            "down": lambda: ([lw.down for lw in lws], none),
        }
        self.kernel_choices: list[KernelChoice] = []
        built: dict[str, list[Linear]] = {}
        for name, make in classes.items():  # folded copies of one class at a time
            built[name], choice = build_linears(
                name, *make(), fast=self.fast, quantization=quantization, mode=linear_kernels
            )
            if choice is not None:
                self.kernel_choices.append(choice)
        self.layers = [
            LayerKernels(
                input_norm=lw.input_norm,
                qkv=built["qkv"][i],
                o_proj=built["o_proj"][i],
                post_norm=lw.post_norm,
                gate_up=built["gate_up"][i],
                down=built["down"][i],
                q_norm=lw.q_norm,
                k_norm=lw.k_norm,
            )
            for i, lw in enumerate(lws)
        ]
        head, choice = build_linears(
            "lm_head", [fold(weights.lm_head, weights.norm)], [None], fast=self.fast,
            quantization=quantization if quantize_lm_head else None, mode=linear_kernels,
        )
        self.lm_head = head[0]
        if choice is not None:
            self.kernel_choices.append(choice)
        # Every layer and the lm_head in one native call for small decode batches (`engine.native_step`),
        # where every piece of the per-layer native path is there and the attention is not pinned to another.
        self.native_step: NativeDecodeStep | None = None
        self.native_step_error = self._native_step_error()
        if self.native_step_error is None:
            self.native_step = NativeDecodeStep(
                [(lk.qkv, lk.o_proj, lk.gate_up, lk.down) for lk in self.layers], self.lm_head,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                eps=cfg.rms_norm_eps, dtype=self.dtype,
            )

    def _native_step_error(self) -> str | None:
        choice = self.attention_choice
        if not self.native_rope or choice is None:
            return "not the native fast path (reference path, not a CPU, or no native RoPE + store)"
        if self.cfg.qk_norm or self.cfg.window_layers:
            return "the model has q/k norms or sliding-window layers, which the native step does not run"
        if not choice.ms and "native" not in (choice.method, choice.small_method):
            return f"decode attention pinned to {choice.method!r}"
        if (err := native_error()) is not None:
            return f"no native decode attention: {err}"
        linears = [k for lk in self.layers for k in (lk.qkv, lk.o_proj, lk.gate_up, lk.down)] + [self.lm_head]
        return native_step_error(linears, self.dtype)

    def weight_nbytes(self) -> int:
        """Bytes one forward streams for the weights: the linear layers' (norm gains too on the
        reference path; the fast path folds them into the linears). Not the embedding lookup."""
        total = self.lm_head.nbytes
        norms = [self.norm] + [n for lk in self.layers for n in (lk.input_norm, lk.post_norm)]
        if not self.fast:
            total += sum(n.numel() * n.element_size() for n in norms)
        for lk in self.layers:
            total += sum(k.nbytes for k in (lk.qkv, lk.o_proj, lk.gate_up, lk.down))
        return total

    def extra_weight_nbytes(self) -> int:
        """Memory held beyond `weight_nbytes`: plain weights kept beside packed ones (`NativeLinear`)."""
        kernels = [self.lm_head] + [k for lk in self.layers for k in (lk.qkv, lk.o_proj, lk.gate_up, lk.down)]
        return sum(k.extra_nbytes for k in kernels if isinstance(k, NativeLinear))

    # -- pieces shared by both forwards ----------------------------------------------------------

    def _normed(self, kernel: Linear, h: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        """kernel(RMSNorm(h)); the fast path's kernels fuse the norm (its gain is in their weights)."""
        if not self.fast:
            return kernel(rms_norm(h, gain, self.cfg.rms_norm_eps))
        return kernel.normed(h, self.cfg.rms_norm_eps)

    def _qkv(
        self, lk: LayerKernels, h: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        store: RopeStore | None, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [T, hidden] (before the input norm) → q [T, H, D], k [T, KV, D], v [T, KV, D] (q and k
        rotated), k and v written to the layer's cache at ``slots`` (by ``store`` in one native call
        where the model has one)."""
        cfg = self.cfg
        t, hd = h.shape[0], cfg.head_dim
        qkv = self._normed(lk.qkv, h, lk.input_norm)  # [T, q + 2kv]
        if lk.q_norm is not None and lk.k_norm is not None:
            qkv = self._qk_normed(qkv, lk.q_norm, lk.k_norm)
        if store is not None:
            qkv = qkv.contiguous()  # the native store rotates it in place
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, hd)
        if not self.fast:
            q, k, _ = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q, k = self.rope.apply(q.view(t, cfg.num_heads, hd), k.view(t, cfg.num_kv_heads, hd), positions)
        elif store is not None:
            store(qkv, k_cache, v_cache)  # rotates q and k in place, then stores k and v
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, hd)
            return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v
        else:
            cos, sin = rope  # [T, 1, D] each, in the activation dtype
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, hd)
            qk = torch.addcmul(qk * cos, torch.roll(qk, hd // 2, dims=-1), sin)  # [T, H + KV, D]
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        write_kv(k_cache, v_cache, slots, k, v)
        return q, k, v

    def _qk_normed(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """qkv [T, q + 2kv] with q and k RMS-normed per head (transformers' order: before RoPE)."""
        cfg = self.cfg
        t, hd, eps = qkv.shape[0], cfg.head_dim, cfg.rms_norm_eps
        q = rms_norm(qkv[:, : cfg.q_size].view(t, cfg.num_heads, hd), q_norm, eps)  # [T, H, D]
        k = rms_norm(qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, hd), k_norm, eps)
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), qkv[:, cfg.q_size + cfg.kv_size :]], -1)

    def _rope_store(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> RopeStore | None:
        """The forward's native RoPE + cache store (positions and slots checked once), if the model has one."""
        if not self.native_rope:
            return None
        return RopeStore.for_batch(positions, slots, self.rope.cos, self._sin_signed32, self.cfg.num_heads,
                                   self.cfg.num_kv_heads, cache.k[0].shape[0] * cache.k[0].shape[1])

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fast or self.native_rope:
            return self._cos[:0], self._cos[:0]  # unused: indexed per layer (reference) or by the native store
        return self._cos[positions].unsqueeze(1), self._sin_signed[positions].unsqueeze(1)  # [T, 1, D]

    def _mlp(self, lk: LayerKernels, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] → h + mlp(norm(h))."""
        gate_up = self._normed(lk.gate_up, h, lk.post_norm)  # [T, 2I]
        if self.fast:
            return lk.down.glu(gate_up, residual=h)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return lk.down(F.silu(gate) * up, residual=h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._normed(self.lm_head, h, self.norm).float()  # [N, vocab]

    # -- forwards ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch, cache: KVCache) -> torch.Tensor:
        """Returns fp32 logits [N, vocab] for the rows in ``batch.logits_index``."""
        cfg = self.cfg
        h = self.embed[batch.token_ids]  # [T, hidden]
        rope = self._rope_tables(batch.positions)
        bs = cache.block_size
        store = self._rope_store(batch.positions, batch.slots, cache)
        for li, lk in enumerate(self.layers):
            q, k, v = self._qkv(lk, h, batch.positions, rope, store, cache.k[li], cache.v[li], batch.slots)
            outs = []
            offset = 0
            for n, start, blocks in zip(batch.seq_lens, batch.start_positions, batch.context_blocks, strict=True):
                sl = slice(offset, offset + n)
                slots = None
                if blocks is not None and not self.fast:  # reference: slot by slot
                    pos = torch.arange(start + n, device=self.device)
                    slots = blocks[pos // bs] * bs + pos % bs
                    blocks = None
                outs.append(
                    prefill_attention(
                        q[sl], k[sl], v[sl], cache.k[li], cache.v[li], start, slots, self.scale, blocks,
                        native=self.fast, window=self.windows[li],
                    )
                )
                offset += n
            attn = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, H, D]
            h = lk.o_proj(attn.reshape(attn.shape[0], cfg.q_size), residual=h)
            h = self._mlp(lk, h)
        return self._logits(h[batch.logits_index])

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        """Returns fp32 logits [B, vocab], one row per sequence."""
        if not self.fast:
            return self._decode_reference(batch, cache)
        b, n_blocks = batch.block_table.shape
        groups = batch.groups or [
            PagedDecodeMeta(block_ids=batch.block_table.reshape(-1), bias=batch.bias, batch=b, n_blocks=n_blocks)
        ]
        h = self.embed[batch.token_ids]  # [B, hidden]
        rope = self._rope_tables(batch.positions)
        store = self._rope_store(batch.positions, batch.slots, cache)
        if self.native_step is not None and store is not None and b <= self.native_step.max_rows:
            return self.native_step(h, store, batch.block_table, cache.k, cache.v).float()  # same as the loop below
        windowed = {w: [windowed_meta(m, w) for m in groups] for w in set(self.windows) if w is not None}
        for li, lk in enumerate(self.layers):
            q, _, _ = self._qkv(lk, h, batch.positions, rope, store, cache.k[li], cache.v[li], batch.slots)
            w = self.windows[li]
            attn = self._grouped_attention(q, cache.k[li], cache.v[li], groups if w is None else windowed[w],
                                           bias_only=w is not None)
            h = lk.o_proj(attn, residual=h)
            h = self._mlp(lk, h)
        return self._logits(h)

    def _grouped_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[PagedDecodeMeta],
        bias_only: bool = False,
    ) -> torch.Tensor:
        """q: [B, H, D] with the groups' rows consecutive → [B, H * D]. ``bias_only``: the groups' masks
        are in their biases only (a windowed layer's), so no method that reads lengths instead."""
        if len(groups) == 1:
            return paged_decode_attention(q, k_cache, v_cache, groups[0], self.ws, self.scale,
                                          self._decode_method(groups[0], k_cache.shape[1], bias_only))
        outs, start = [], 0
        for meta in groups:
            outs.append(paged_decode_attention(q[start : start + meta.batch], k_cache, v_cache, meta, self.ws,
                                               self.scale, self._decode_method(meta, k_cache.shape[1], bias_only)))
            start += meta.batch
        return torch.cat(outs)

    def _decode_method(self, meta: PagedDecodeMeta, block_size: int, bias_only: bool = False) -> str:
        choice = self.attention_choice
        method = choice.method_for(meta.batch * meta.n_blocks * block_size) if choice else "per_head"
        return "per_head" if bias_only and method == "native" else method  # the C++ kernel takes lengths only

    @torch.inference_mode()
    def warm_up_decode_attention(self, cache: KVCache) -> None:
        """Runs the decode attention once against ``cache`` (reads block 0, writes nothing), so a
        compiled method compiles for this cache at load rather than on the first request."""
        choice = self.attention_choice
        if choice is None or "compiled" not in (choice.method, choice.small_method):
            return
        cfg, bs = self.cfg, cache.block_size
        q = torch.zeros(2, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        meta = PagedDecodeMeta(block_ids=torch.zeros(4, dtype=torch.long, device=self.device),
                               bias=torch.zeros(2, 1, 2 * bs, device=self.device), batch=2, n_blocks=2)
        paged_decode_attention(q, cache.k[0], cache.v[0], meta, self.ws, self.scale, "compiled")

    def _decode_reference(self, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        cfg = self.cfg
        bs = cache.block_size
        max_len = int(batch.positions.max()) + 1
        cols = torch.arange(max_len, device=self.device)  # [L]
        slot_table = batch.block_table[:, cols // bs] * bs + cols % bs  # [B, L]
        valid = cols.unsqueeze(0) <= batch.positions.unsqueeze(1)  # [B, L]
        h = self.embed[batch.token_ids]  # [B, hidden]
        b = h.shape[0]
        for li, lk in enumerate(self.layers):
            q, _, _ = self._qkv(lk, h, batch.positions, self._rope_tables(batch.positions), None, cache.k[li],
                                cache.v[li], batch.slots)
            w = self.windows[li]
            seen = valid if w is None else valid & (cols.unsqueeze(0) > (batch.positions - w).unsqueeze(1))
            attn = decode_attention(q, cache.k[li], cache.v[li], slot_table, seen, self.scale)
            h = lk.o_proj(attn.reshape(b, cfg.q_size), residual=h)
            h = self._mlp(lk, h)
        return self._logits(h)


def windowed_meta(meta: PagedDecodeMeta, window: int) -> PagedDecodeMeta:
    """``meta`` for a layer that sees only the last ``window`` positions (its own included): the
    earlier ones masked in the bias too; its lengths stay the full ones (only the bias carries the
    window, so the caller must not pick a method that reads lengths alone)."""
    pos = meta.visible() - 1  # [B]
    cols = torch.arange(meta.bias.shape[-1], device=meta.bias.device)  # [L]
    hidden = (cols.unsqueeze(0) <= (pos - window).unsqueeze(1)).unsqueeze(1)  # [B, 1, L]
    return PagedDecodeMeta(block_ids=meta.block_ids, bias=meta.bias.masked_fill(hidden, float("-inf")),
                           batch=meta.batch, n_blocks=meta.n_blocks, lengths=pos + 1)


def build_model(cfg: ModelConfig, weights: ModelWeights, max_positions: int, config: EngineConfig) -> LlamaModel:
    """The model `EngineConfig` asks for: ``fast_kernels``, ``quantization``, ``linear_kernels`` and
    ``decode_attention``."""
    return LlamaModel(cfg, weights, max_positions, fast=config.fast_kernels, quantization=config.quantization,
                      linear_kernels=config.linear_kernels, decode_attention=config.decode_attention)
