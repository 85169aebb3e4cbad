"""The ``cpu`` attention backend: the native C++ kernels and the timed choices, behind the seam.

Owns: on a CPU, RoPE + cache store in one native call per layer (`engine.kernels.native_rope`) where
it builds, else the eager rotation from tables gathered once per step; prefill chunks through the
C++ prefill attention or SDPA, as `engine.kernels.prefill_choice` picks at load
(`engine.attention.ops.prefill_attention`, a prefix read as whole blocks); decode rows sorted into
groups of similar length, each padded only to its own longest (`engine.attention.cpu_decode`), by
the method `engine.kernels.attention_choice` timed fastest here; small decode batches as one C++
call for the whole step (`engine.kernels.native_step`) where every piece of it is native; and the
linear kernels' formats (`engine.kernels.cpu_linears`, swapped in by `prepare_model`).

Invariants: those of `engine.attention.base`, and every choice made here changes speed only (each
path is tested against the ``reference`` backend).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionSpec, StepModel, decode_call_lengths, prefill_call_lengths
from engine.attention.cpu_decode import DecodeGroups, decode_groups, grouped_attention, warm_up_compiled
from engine.attention.ops import prefill_attention, write_kv
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import EngineConfig
from engine.kernels.attention_choice import AttentionChoice, remembered_decode_attention
from engine.kernels.cpu_linears import native_step_for, swap_cpu_linears
from engine.kernels.gathered_decode import Workspace
from engine.kernels.kernel_choice import KernelChoice
from engine.kernels.native_attention import native_error
from engine.kernels.native_rope import MAX_HEAD_DIM, RopeStore, native_rope_error
from engine.kernels.native_step import NativeDecodeStep
from engine.kernels.prefill_choice import remembered_prefill_attention
from engine.kv_cache import KVCache
from engine.model.model import LlamaModel
from engine.model.rope import rotate_rolled


@dataclass
class Rotation:
    """One forward's RoPE per table of `AttentionSpec.ropes`: the native stores, or the gathered
    (cos, signed sin) [T, 1, R] of the eager path."""

    stores: list[RopeStore] | None
    tables: list[tuple[torch.Tensor, torch.Tensor]] | None


@dataclass
class CpuPrefill:
    rotation: Rotation
    slots: torch.Tensor  # [T]
    chunks: list[tuple[slice, int, torch.Tensor | None]]  # rows, start, the blocks of 0..end-1 (None at start 0)


@dataclass
class CpuDecode:
    rotation: Rotation
    slots: torch.Tensor  # [B]
    groups: DecodeGroups


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, spec: AttentionSpec, config: EngineConfig) -> None:
        super().__init__(spec, config)
        self.native_rope = spec.head_dim <= MAX_HEAD_DIM and native_rope_error() is None
        self.choice: AttentionChoice = remembered_decode_attention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, config.decode_attention, spec.device, spec.dtype,
            softcap=spec.softcapped)
        self.prefill_choice = remembered_prefill_attention(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                                           spec.dtype)
        self.ws = Workspace()
        self.kernel_choices: list[KernelChoice] = []
        self.native_step: NativeDecodeStep | None = None
        self.native_step_error: str | None = "the model's kernels are not swapped in yet"

    @classmethod
    def unavailable(cls, spec: AttentionSpec, config: EngineConfig) -> str | None:
        if spec.device.type != "cpu":
            return f"its kernels run on the CPU, not on {spec.device}"
        if spec.dtype not in (torch.float32, torch.bfloat16) and config.quantization is None:
            return f"no CPU kernels for {spec.dtype}"
        return None

    def prepare_model(self, model: StepModel) -> None:
        assert isinstance(model, LlamaModel)
        self.kernel_choices = swap_cpu_linears(model.layers, model.head, self.config)
        self.native_step, self.native_step_error = native_step_for(
            model.cfg, model.layers, model.head, self.spec.dtype, self._native_attention_error())

    def _native_attention_error(self) -> str | None:
        if not self.native_rope:
            return "no native RoPE + store here"
        c = self.choice
        if not c.ms and "native" not in (c.method, c.small_method):
            return f"decode attention pinned to {c.method!r}"
        if (err := native_error()) is not None:
            return f"no native decode attention: {err}"
        return None

    def _rotation(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                  lens: torch.Tensor | None) -> Rotation:
        s = self.spec
        if self.native_rope:
            cache_slots = cache.num_blocks * cache.block_size
            return Rotation([r.store(positions, slots, s.num_heads, s.num_kv_heads, s.head_dim, cache_slots, lens)
                             for r in s.ropes], None)
        return Rotation(None, [r.gathered(positions, lens) for r in s.ropes])

    def prepare_prefill(self, batch: PrefillBatch, cache: KVCache) -> CpuPrefill:
        chunks, offset = [], 0
        for n, start, table in zip(batch.seq_lens, batch.start_positions, batch.block_tables, strict=True):
            chunks.append((slice(offset, offset + n), start, table if start > 0 else None))
            offset += n
        rot = self._rotation(batch.positions, batch.slots, cache, prefill_call_lengths(self.spec, batch))
        return CpuPrefill(rot, batch.slots, chunks)

    def prepare_decode(self, batch: DecodeBatch, cache: KVCache) -> CpuDecode:
        rot = self._rotation(batch.positions, batch.slots, cache, decode_call_lengths(self.spec, batch))
        return CpuDecode(rot, batch.slots, decode_groups(batch, cache.block_size, self.spec))

    def _qkv(self, layer: int, qkv: torch.Tensor, cache: KVCache, rot: Rotation,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [T, H, D], k [T, KV, D] and v [T, KV, D], k and v stored."""
        s, rope = self.spec, self.spec.layers[layer].rope
        kc, vc = cache.k[layer], cache.v[layer]
        if rot.stores is not None:
            qkv = qkv.contiguous()  # the native store rotates it in place
            rot.stores[rope](qkv, kc, vc)  # rotates q and k in place, then stores k and v
            return s.split(qkv)
        assert rot.tables is not None
        v = s.split(qkv)[2]  # [T, KV, D]; q and k are rotated together below
        t, hd = qkv.shape[0], s.head_dim
        qk = qkv[:, : s.q_size + s.kv_size].view(t, s.num_heads + s.num_kv_heads, hd)
        qk = rotate_rolled(qk, *rot.tables[rope])  # [T, H + KV, D]
        q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        write_kv(kc, vc, slots, k, v)
        return q, k, v

    def forward(self, layer: int, qkv: torch.Tensor, cache: KVCache, meta: object) -> torch.Tensor:
        assert isinstance(meta, CpuPrefill | CpuDecode)
        la = self.spec.layers[layer]
        q, k, v = self._qkv(layer, qkv, cache, meta.rotation, meta.slots)
        kc, vc = cache.k[layer], cache.v[layer]
        if isinstance(meta, CpuDecode):
            return grouped_attention(q, kc, vc, meta.groups, la, self.choice, self.ws)  # [B, H * D]
        outs = [prefill_attention(q[rows], k[rows], v[rows], kc, vc, start, None, la.scale, blocks,
                                  native=self.prefill_choice.native,
                                  window=la.window, softcap=la.softcap) for rows, start, blocks in meta.chunks]
        attn = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, H, D]
        return attn.reshape(attn.shape[0], -1)

    def decode_step(self, model: StepModel, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        meta = self.prepare_decode(batch, cache)
        stores = meta.rotation.stores
        if self.native_step is not None and stores is not None and batch.batch <= self.native_step.max_rows:
            h = model.embed_tokens(batch.token_ids)  # [B, hidden]
            return self.native_step(h, stores[0], batch.block_table, cache.k, cache.v).float()
        return model.logits(model.forward(batch.token_ids, cache, meta))

    def warm_up(self, model: StepModel, cache: KVCache) -> None:
        warm_up_compiled(self.choice, self.spec, cache)

    def report(self) -> dict[str, object]:
        return {"backend": self.name, "linear_kernels": [asdict(c) for c in self.kernel_choices],
                "decode_attention": asdict(self.choice), "prefill_attention": asdict(self.prefill_choice),
                "native_step": self.native_step is not None}

    def describe(self) -> str:
        linears = "; ".join(c.summary() for c in self.kernel_choices)
        step = "one native call" if self.native_step is not None else f"per layer ({self.native_step_error})"
        return (f"cpu: linears {linears}; decode attention {self.choice.summary()}; "
                f"prefill attention {self.prefill_choice.summary()}; small decode steps {step}")


BACKEND = CpuBackend
