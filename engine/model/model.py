"""The decoder forward pass of every family in `engine.model.families` over the paged KV cache.

The forward reads a model's features (`ModelConfig.features` and the config's values: q/k norms,
windows, RoPE per layer, Gemma's offset and sandwich norms, GELU MLP, embedding scale, attention
scale and soft-caps), never a family's name. Llama-shaped models (no feature beyond the sizes)
keep every fast piece below; a feature a piece does not implement turns that piece off for the
model (`ModelConfig.native_step_blockers`; soft-capping: no SDPA, C++ prefill or in-place decode
attention), so it runs the per-layer path instead.

Owns: one forward for a *batch of prefill chunks* (each sequence may start after cached prefix
tokens) and one for a *batched decode step* (one token per sequence, contexts of any length), each
in two variants chosen at construction:
- ``fast=True`` (default): oneDNN-prepacked weights (or int8, `engine.kernels.quant`) with the RMSNorm gains
  folded into the next linear's weight and the residual add fused into o_proj/down, RoPE for q and k
  in one pass from per-dtype tables gathered once per step, and `attention.paged_decode_attention`
  over the paged cache by the method `engine.kernels.attention_choice` timed fastest here (whole-block
  gathers then batched matmuls, or the compiled in-place kernel of `engine.kernels.compiled_attention`);
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

import torch
import torch.nn.functional as F

from engine.attention.ops import (
    PagedDecodeMeta,
    Workspace,
    decode_attention,
    paged_decode_attention,
    prefill_attention,
    soft_cap,
    visible_keys,
    write_kv,
)
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import EngineConfig, ModelConfig
from engine.kernels.attention_choice import AttentionChoice, choose_decode_attention
from engine.kernels.kernel_choice import build_linears
from engine.kernels.native_attention import native_error
from engine.kernels.native_linear import NativeLinear
from engine.kernels.native_rope import MAX_HEAD_DIM, RopeStore, native_rope_error
from engine.kernels.native_step import NativeDecodeStep, native_step_error
from engine.kernels.quant import Linear
from engine.kv_cache import KVCache
from engine.loading.weights import ModelWeights
from engine.model.layer import LayerKernels, Rotation, build_layer_kernels, fold, offset_gains, rms_norm, windowed_meta
from engine.model.rope import RopeTables, RotaryEmbedding, rotate_rolled


class LlamaModel:
    """Weights in their kernels' formats + the two forwards. Holds no per-request state.

    ``quantization="int8"`` stores every linear layer (lm_head included unless
    ``quantize_lm_head=False``) as weight-only int8; it implies the fast path. ``linear_kernels``
    picks the oneDNN weight format of the dense fast path (`engine.kernels.kernel_choice`): ``"auto"``
    times both per class of layers; ``kernel_choices`` records what each class got.
    ``decode_attention`` picks the fast path's decode attention method the same way
    (`engine.kernels.attention_choice`), recorded in ``attention_choice`` (None on the reference path).
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
        self.norm = weights.norm  # [hidden] the final norm's gain (1 + w in fp32 for offset norms, below)
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        features = cfg.features
        params = [cfg.layer_rope(i) for i in range(cfg.num_layers)]
        distinct = list(dict.fromkeys(params))  # the first layer's first: the one most models have alone
        self.ropes = [RopeTables(RotaryEmbedding(cfg, max_positions, self.device, p), self.dtype) for p in distinct]
        # longrope / dynamic NTK: a token's table depends on its forward call's length (`engine.model.rope_params`)
        self.length_dependent = any(p.length_dependent for p in distinct)
        self.scale = cfg.attention_scale
        self.attn_softcap, self.final_softcap = cfg.attn_softcap, cfg.final_softcap
        self.norm_offset = features.norm_offset
        self.activation = features.activation
        # transformers multiplies by sqrt(hidden) rounded to the embedding's dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype) if features.embed_scale else None
        self.windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]  # None: full causal attention
        # RoPE + cache store in one native call per layer (`engine.kernels.native_rope`) where it builds.
        self.native_rope = (self.fast and self.device.type == "cpu" and cfg.head_dim <= MAX_HEAD_DIM
                            and native_rope_error() is None)
        self.ws = Workspace()
        self.attention_choice: AttentionChoice | None = (
            choose_decode_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, decode_attention, self.device,
                                    self.dtype, softcap=self.attn_softcap is not None)
            if self.fast else None
        )

        lws = weights.layers
        if self.norm_offset:  # every gain as it multiplies (1 + w, in fp32), before any is folded
            self.norm = 1.0 + self.norm.float()
            lws = [offset_gains(lw) for lw in lws]
        self.layers, self.kernel_choices = build_layer_kernels(
            lws, [distinct.index(p) for p in params], fast=self.fast, quantization=quantization, mode=linear_kernels)
        head, choice = build_linears(
            "lm_head", [fold(weights.lm_head, self.norm, self.fast)], [None], fast=self.fast,
            quantization=quantization if quantize_lm_head else None, mode=linear_kernels,
        )
        self.lm_head = head[0]
        if choice is not None:
            self.kernel_choices.append(choice)
        # Every layer and the lm_head in one native call for small decode batches (`engine.kernels.native_step`),
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
        if blockers := self.cfg.native_step_blockers():
            return f"the model has {', '.join(blockers)}, which the native step does not run"
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
        sandwich = [n for lk in self.layers for n in (lk.attn_out_norm, lk.mlp_out_norm) if n is not None]
        total += sum(n.numel() * n.element_size() for n in sandwich)  # never folded
        for lk in self.layers:
            total += sum(k.nbytes for k in (lk.qkv, lk.o_proj, lk.gate_up, lk.down))
        return total

    def extra_weight_nbytes(self) -> int:
        """Memory held beyond `weight_nbytes`: plain weights kept beside packed ones (`NativeLinear`)."""
        kernels = [self.lm_head] + [k for lk in self.layers for k in (lk.qkv, lk.o_proj, lk.gate_up, lk.down)]
        return sum(k.extra_nbytes for k in kernels if isinstance(k, NativeLinear))

    # -- pieces shared by both forwards ----------------------------------------------------------

    def _norm(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., n] with ``gain`` [n], in the model's norm style."""
        return rms_norm(x, gain, self.cfg.rms_norm_eps, gain_in_fp32=self.norm_offset)

    def _normed(self, kernel: Linear, h: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        """kernel(RMSNorm(h)); the fast path's kernels fuse the norm (its gain is in their weights)."""
        if not self.fast:
            return kernel(self._norm(h, gain))
        return kernel.normed(h, self.cfg.rms_norm_eps)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[token_ids]  # [T, hidden]
        return h if self.embed_scale is None else h * self.embed_scale

    def _qkv(
        self, lk: LayerKernels, h: torch.Tensor, positions: torch.Tensor, rot: Rotation, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [T, hidden] (before the input norm) → q [T, H, D], k [T, KV, D], v [T, KV, D] (q and k
        rotated), k and v written to the layer's cache at ``slots`` (by ``store`` in one native call
        where the model has one)."""
        cfg = self.cfg
        t, hd = h.shape[0], cfg.head_dim
        store = rot.stores[lk.rope]
        qkv = self._normed(lk.qkv, h, lk.input_norm)  # [T, q + 2kv]
        if lk.q_norm is not None and lk.k_norm is not None:
            qkv = self._qk_normed(qkv, lk.q_norm, lk.k_norm)
        if store is not None:
            qkv = qkv.contiguous()  # the native store rotates it in place
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, hd)
        if not self.fast:
            q, k, _ = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q, k = self.ropes[lk.rope].rope.apply(q.view(t, cfg.num_heads, hd), k.view(t, cfg.num_kv_heads, hd),
                                                  positions, rot.lens)
        elif store is not None:
            store(qkv, k_cache, v_cache)  # rotates q and k in place, then stores k and v
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, hd)
            return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v
        else:
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, hd)
            qk = rotate_rolled(qk, *rot.tables[lk.rope])  # [T, H + KV, D]
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        write_kv(k_cache, v_cache, slots, k, v)
        return q, k, v

    def _qk_normed(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """qkv [T, q + 2kv] with q and k RMS-normed per head (transformers' order: before RoPE)."""
        cfg = self.cfg
        t, hd = qkv.shape[0], cfg.head_dim
        q = self._norm(qkv[:, : cfg.q_size].view(t, cfg.num_heads, hd), q_norm)  # [T, H, D]
        k = self._norm(qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, hd), k_norm)
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), qkv[:, cfg.q_size + cfg.kv_size :]], -1)

    def _rotation(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                  lens: torch.Tensor | None) -> Rotation:
        """A forward's RoPE, per distinct table: the native store (positions and slots checked once)
        where the model has one, else the tables gathered at ``positions`` on the eager fast path.
        ``lens`` [T]: each token's forward-call length (a length-dependent RoPE's table), else None."""
        cfg = self.cfg
        if self.native_rope:
            cache_slots = cache.k[0].shape[0] * cache.k[0].shape[1]
            return Rotation([], [r.store(positions, slots, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache_slots,
                                         lens) for r in self.ropes], lens)
        nones: list[RopeStore | None] = [None] * len(self.ropes)
        if not self.fast:
            return Rotation([], nones, lens)  # the reference path rotates layer by layer
        return Rotation([r.gathered(positions, lens) for r in self.ropes], nones, lens)

    def _attention_out(self, lk: LayerKernels, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + o_proj(attn) [T, hidden] (the add fused into o_proj), or with a norm on o_proj's output first."""
        if lk.attn_out_norm is None:
            return lk.o_proj(attn, residual=h)
        return h + self._norm(lk.o_proj(attn), lk.attn_out_norm)

    def _mlp(self, lk: LayerKernels, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] → h + mlp(norm(h)) (a norm on the MLP's output first where the layer has one)."""
        gate_up = self._normed(lk.gate_up, h, lk.post_norm)  # [T, 2I]
        residual = h if lk.mlp_out_norm is None else None  # fused into down where nothing comes between
        if self.activation == "silu" and self.fast:
            out = lk.down.glu(gate_up, residual=residual)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
            out = lk.down(act * up, residual=residual)
        return out if lk.mlp_out_norm is None else h + self._norm(out, lk.mlp_out_norm)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self._normed(self.lm_head, h, self.norm).float()  # [N, vocab]
        return logits if self.final_softcap is None else soft_cap(logits, self.final_softcap)

    # -- forwards ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch, cache: KVCache) -> torch.Tensor:
        """Returns fp32 logits [N, vocab] for the rows in ``batch.logits_index``."""
        return self._logits(self.prefill_hidden(batch, cache)[batch.logits_index])

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of final hidden states h [N, hidden] (before the final norm)."""
        return self._logits(h)

    @torch.inference_mode()
    def prefill_hidden(self, batch: PrefillBatch, cache: KVCache) -> torch.Tensor:
        """The prefill forward without the lm_head: every row's final hidden state [T, hidden]
        (before the final norm), for `logits` over the rows a caller wants."""
        cfg = self.cfg
        h = self._embed(batch.token_ids)  # [T, hidden]
        bs = cache.block_size
        lens = None  # each token's table is its whole prompt's (transformers' one prefill call)
        if self.length_dependent:
            lens = torch.repeat_interleave(torch.tensor(batch.prompt_lens, device=self.device),
                                           torch.tensor(batch.seq_lens, device=self.device))  # [T]
        rot = self._rotation(batch.positions, batch.slots, cache, lens)
        for li, lk in enumerate(self.layers):
            q, k, v = self._qkv(lk, h, batch.positions, rot, cache.k[li], cache.v[li], batch.slots)
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
                        native=self.fast, window=self.windows[li], softcap=self.attn_softcap,
                    )
                )
                offset += n
            attn = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, H, D]
            h = self._attention_out(lk, attn.reshape(attn.shape[0], cfg.q_size), h)
            h = self._mlp(lk, h)
        return h

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        """Returns fp32 logits [B, vocab], one row per sequence."""
        if not self.fast:
            return self._decode_reference(batch, cache)
        b, n_blocks = batch.block_table.shape
        groups = batch.groups or [
            PagedDecodeMeta(block_ids=batch.block_table.reshape(-1), bias=batch.bias, batch=b, n_blocks=n_blocks)
        ]
        h = self._embed(batch.token_ids)  # [B, hidden]
        rot = self._rotation(batch.positions, batch.slots, cache, self._decode_lens(batch))
        store = rot.stores[0]
        if self.native_step is not None and store is not None and b <= self.native_step.max_rows:
            return self.native_step(h, store, batch.block_table, cache.k, cache.v).float()  # same as the loop below
        windowed = {w: [windowed_meta(m, w) for m in groups] for w in set(self.windows) if w is not None}
        for li, lk in enumerate(self.layers):
            q, _, _ = self._qkv(lk, h, batch.positions, rot, cache.k[li], cache.v[li], batch.slots)
            w = self.windows[li]
            attn = self._grouped_attention(q, cache.k[li], cache.v[li], groups if w is None else windowed[w],
                                           bias_only=w is not None)
            h = self._attention_out(lk, attn, h)
            h = self._mlp(lk, h)
        return self._logits(h)

    def _decode_lens(self, batch: DecodeBatch) -> torch.Tensor | None:
        """A decode token at position p is its own forward call of p + 1 tokens (transformers' decode step)."""
        return batch.positions + 1 if self.length_dependent else None

    def _grouped_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[PagedDecodeMeta],
        bias_only: bool = False,
    ) -> torch.Tensor:
        """q: [B, H, D] with the groups' rows consecutive → [B, H * D]. ``bias_only``: the groups' masks
        are in their biases only (a windowed layer's), so no method that reads lengths instead."""
        if len(groups) == 1:
            return paged_decode_attention(q, k_cache, v_cache, groups[0], self.ws, self.scale,
                                          self._decode_method(groups[0], k_cache.shape[1], bias_only),
                                          self.attn_softcap)
        outs, start = [], 0
        for meta in groups:
            outs.append(paged_decode_attention(q[start : start + meta.batch], k_cache, v_cache, meta, self.ws,
                                               self.scale, self._decode_method(meta, k_cache.shape[1], bias_only),
                                               self.attn_softcap))
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
        h = self._embed(batch.token_ids)  # [B, hidden]
        b = h.shape[0]
        rot = self._rotation(batch.positions, batch.slots, cache, self._decode_lens(batch))
        for li, lk in enumerate(self.layers):
            q, _, _ = self._qkv(lk, h, batch.positions, rot, cache.k[li], cache.v[li], batch.slots)
            w = self.windows[li]
            seen = visible_keys(batch.positions.unsqueeze(1), cols.unsqueeze(0), w)  # [B, L]
            attn = decode_attention(q, cache.k[li], cache.v[li], slot_table, seen, self.scale, self.attn_softcap)
            h = self._attention_out(lk, attn.reshape(b, cfg.q_size), h)
            h = self._mlp(lk, h)
        return self._logits(h)


def build_model(cfg: ModelConfig, weights: ModelWeights, max_positions: int, config: EngineConfig) -> LlamaModel:
    """The model `EngineConfig` asks for: ``fast_kernels``, ``quantization``, ``linear_kernels`` and
    ``decode_attention``."""
    return LlamaModel(cfg, weights, max_positions, fast=config.fast_kernels, quantization=config.quantization,
                      linear_kernels=config.linear_kernels, decode_attention=config.decode_attention)
