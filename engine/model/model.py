"""The decoder forward of every family in `engine.model.families`, kernel- and device-agnostic.

The forward reads a model's features (`ModelConfig.features` and the config's values: q/k norms,
windows, RoPE per layer, Gemma's offset and sandwich norms, GELU MLP, embedding scale, attention
scale and soft-caps), never a family's name, and never a kernel: each layer calls its
`NormedLinear` / `Linear` kernels and ``self.attention.forward(layer, qkv, cache, meta)``, the
attention backend picked for the engine (`engine.attention.registry`), which rotates q and k, stores
k and v into the paged cache and attends. The model is built with plain kernels (transformers' op
order); the backend may swap them for its own formats once, after the build (``prepare_model``).

Owns: the weights as kernels, RoPE tables (one per distinct RoPE of the layers), one `forward` for
any step (packed prefill chunks, each possibly after a cached prefix, or one decode token per
sequence: the backend's metadata says which), and the fp32 logits. Batch preparation (positions,
slots, block tables) is `engine.runner`'s.

Invariants: every sequence in a batch is independent (its result does not depend on the others
beyond float reassociation); logits come back in fp32; the model holds no per-request state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionSpec, LayerAttention
from engine.attention.ops import soft_cap
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.loading.weights import ModelWeights
from engine.model.config import ModelConfig
from engine.model.layer import LayerKernels, NormedLinear, offset_gains, plain_layer, plain_linear, rms_norm
from engine.model.rope import RopeTables, RotaryEmbedding


class LlamaModel:
    """Weights as kernels + the forward. Holds no per-request state; ``attention`` is set by
    `build_model` (the model is built first: its RoPE tables are part of the backend's spec)."""

    attention: AttentionBackend

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_positions: int) -> None:
        self.cfg = cfg
        self.embed = weights.embed  # [vocab, hidden]
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        features = cfg.features
        params = [cfg.layer_rope(i) for i in range(cfg.num_layers)]
        distinct = list(dict.fromkeys(params))  # the first layer's first: the one most models have alone
        self.ropes = [RopeTables(RotaryEmbedding(cfg, max_positions, self.device, p), self.dtype) for p in distinct]
        self.layer_ropes = [distinct.index(p) for p in params]
        # longrope / dynamic NTK: a token's table depends on its forward call's length (`engine.model.rope_params`)
        self.length_dependent = any(p.length_dependent for p in distinct)
        self.norm_offset = features.norm_offset
        self.activation = features.activation
        # transformers multiplies by sqrt(hidden) rounded to the embedding's dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=self.dtype) if features.embed_scale else None
        lws, norm, lm_head = list(weights.layers), weights.norm, weights.lm_head
        # the model takes the weights: the container keeps no reference to what a backend may reformat
        weights.layers.clear()
        weights.lm_head = weights.embed
        if self.norm_offset:  # every gain as it multiplies (1 + w, in fp32)
            norm = 1.0 + norm.float()
            lws = [offset_gains(lw) for lw in lws]
        eps = cfg.rms_norm_eps
        self.layers: list[LayerKernels] = [plain_layer(lw, eps, self.norm_offset) for lw in lws]
        self.head = NormedLinear(norm, plain_linear(lm_head), eps, self.norm_offset)  # final norm + lm_head

    def attention_spec(self) -> AttentionSpec:
        cfg = self.cfg
        layers = tuple(LayerAttention(rope=self.layer_ropes[i], scale=cfg.attention_scale, window=cfg.layer_window(i),
                                      softcap=cfg.attn_softcap) for i in range(cfg.num_layers))
        return AttentionSpec(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             layers=layers, ropes=self.ropes,
                             length_dependent=self.length_dependent,
                             device=self.device, dtype=self.dtype)

    def weight_nbytes(self) -> int:
        """Bytes one forward streams for the weights: the linear kernels', and the norm gains that are
        not folded into them. Not the embedding lookup."""
        normed = [self.head] + [n for lk in self.layers for n in (lk.attn_in, lk.mlp_in)]
        total = sum(n.kernel.nbytes for n in normed)
        total += sum(n.gain.numel() * n.gain.element_size() for n in normed if not n.folded)
        sandwich = [n for lk in self.layers for n in (lk.attn_out_norm, lk.mlp_out_norm) if n is not None]
        total += sum(n.numel() * n.element_size() for n in sandwich)  # never folded
        return total + sum(k.nbytes for lk in self.layers for k in (lk.o_proj, lk.down))

    # -- pieces of the forward -------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., n] with ``gain`` [n], in the model's norm style."""
        return rms_norm(x, gain, self.cfg.rms_norm_eps, gain_in_fp32=self.norm_offset)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] → h [T, hidden] (scaled where the family scales its embeddings)."""
        h = self.embed[token_ids]  # [T, hidden]
        return h if self.embed_scale is None else h * self.embed_scale

    def _qk_normed(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """qkv [T, q + 2kv] with q and k RMS-normed per head (transformers' order: before RoPE)."""
        cfg = self.cfg
        t, hd = qkv.shape[0], cfg.head_dim
        q = self._norm(qkv[:, : cfg.q_size].view(t, cfg.num_heads, hd), q_norm)  # [T, H, D]
        k = self._norm(qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, hd), k_norm)
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), qkv[:, cfg.q_size + cfg.kv_size :]], -1)

    def _attention_out(self, lk: LayerKernels, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + o_proj(attn) [T, hidden] (the add fused into o_proj), or with a norm on o_proj's output first."""
        if lk.attn_out_norm is None:
            return lk.o_proj(attn, residual=h)
        return h + self._norm(lk.o_proj(attn), lk.attn_out_norm)

    def _mlp(self, lk: LayerKernels, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] → h + mlp(norm(h)) (a norm on the MLP's output first where the layer has one)."""
        gate_up = lk.mlp_in(h)  # [T, 2I]
        residual = h if lk.mlp_out_norm is None else None  # fused into down where nothing comes between
        if self.activation == "silu":
            out = lk.down.glu(gate_up, residual=residual)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            out = lk.down(F.gelu(gate, approximate="tanh") * up, residual=residual)
        return out if lk.mlp_out_norm is None else h + self._norm(out, lk.mlp_out_norm)

    # -- forwards ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, cache: KVCache, meta: object) -> torch.Tensor:
        """token_ids [T] → final hidden states [T, hidden] (before the final norm); ``meta`` is the
        attention backend's for this step (`AttentionBackend.prepare_prefill` / ``prepare_decode``)."""
        h = self.embed_tokens(token_ids)  # [T, hidden]
        for li, lk in enumerate(self.layers):
            qkv = lk.attn_in(h)  # [T, q + 2kv]
            if lk.q_norm is not None and lk.k_norm is not None:
                qkv = self._qk_normed(qkv, lk.q_norm, lk.k_norm)
            attn = self.attention.forward(li, qkv, cache, meta)  # [T, H * D]
            h = self._attention_out(lk, attn, h)
            h = self._mlp(lk, h)
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of final hidden states h [N, hidden] (before the final norm)."""
        logits = self.head(h).float()  # [N, vocab]
        cap = self.cfg.final_softcap
        return logits if cap is None else soft_cap(logits, cap)

    @torch.inference_mode()
    def prefill_hidden(self, batch: PrefillBatch, cache: KVCache) -> torch.Tensor:
        """Every row's final hidden state [T, hidden] (before the final norm) of a prefill forward."""
        return self.forward(batch.token_ids, cache, self.attention.prepare_prefill(batch, cache))

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch, cache: KVCache) -> torch.Tensor:
        """fp32 logits [N, vocab] for the rows in ``batch.logits_index``."""
        return self.logits(self.prefill_hidden(batch, cache)[batch.logits_index])

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        """fp32 logits [B, vocab], one row per sequence (the backend may run the step fused or captured)."""
        return self.attention.decode_step(self, batch, cache)


def build_model(cfg: ModelConfig, weights: ModelWeights, max_positions: int, config: EngineConfig) -> LlamaModel:
    """The model over ``weights``, with the attention backend ``config.backend`` names (or ``auto``'s
    pick) and that backend's kernel formats swapped in. The caller must not keep ``weights``: a
    backend that reformats a class of weights frees the loaded ones as it goes (the model empties
    ``weights`` as it takes them)."""
    from engine.attention.registry import pick_backend

    model = LlamaModel(cfg, weights, max_positions)
    del weights
    backend = pick_backend(model.attention_spec(), config)
    backend.prepare_model(model)
    model.attention = backend
    return model
