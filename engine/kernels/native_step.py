"""A whole decode step (every layer, then the lm_head) as one C++ call, for up to 64 sequences.

Owns: loading ``engine/kernels/csrc/decode_step.cpp`` (built by `engine.kernels.native_build` from the same
headers as the per-layer kernels), `native_step_error`, and `NativeDecodeStep`, which holds the
model's weights as C structs once, the caches' pointers once per cache, and per step checks the
batch and makes one call.

Why: with every linear, the RoPE + store and the attention already native, what is left of a
small-batch step outside the kernels is Python and dispatch between them (a few hundred calls a
step), and one call also holds the GIL once a step instead of at every op boundary.

Invariants: the step runs the per-layer native path's kernels in its order on the same values, so
logits and cache writes equal that path's bit for bit (`test_native_step` checks it with fp32,
bf16 and int8 weights, one and several sequences); every shape, dtype and index the C++ trusts is
checked here: weights at construction, a cache the first time it is seen, the batch on every
call (positions and slots by `RopeStore.for_batch`, lengths against the block table here). h is
overwritten (it holds the last layer's output on return). No per-call state: threads may share one.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from engine.kernels.native_build import CSRC, build_with, unavailable_reason
from engine.kernels.native_linear import NativeLinear
from engine.kernels.native_rope import RopeStore
from engine.kernels.quant import Linear

SOURCE = CSRC / "decode_step.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_ACTS = {torch.float32: "f32", torch.bfloat16: "bf16"}


_GROUPED = 3  # int8 with a scale per group of inputs (`engine.kernels.group_int8`)


class _Lin(ctypes.Structure):
    _fields_ = [("w", _P), ("scale", _P), ("bias", _P), ("kind", _I), ("n", _I), ("k", _I), ("group", _I),
                ("gain", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin), ("kc", _P), ("vc", _P)]


class _Args(ctypes.Structure):
    _fields_ = [
        ("B", _I), ("num_layers", _I), ("H", _I), ("KV", _I), ("D", _I), ("R", _I), ("BS", _I), ("NB", _I),
        ("hidden", _I), ("nthreads", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)), ("lm_head", _Lin), ("cos", _P), ("sin", _P), ("pos", _P), ("slots", _P),
        ("table", _P), ("lens", _P), ("h", _P), ("logits", _P),
    ]


@functools.cache
def load() -> ctypes.CDLL:
    """The built library (compiled on the first call in any process, then reused)."""
    return build_with(SOURCE, ["decode_step_f32", "decode_step_bf16"], [ctypes.POINTER(_Args)])


def native_step_error(linears: Sequence[Linear], dtype: torch.dtype) -> str | None:
    """None if a step over these linears (every layer's four, then the lm_head) in activation ``dtype``
    can run natively here, else why not."""
    if dtype not in _ACTS:
        return f"activations in {dtype}: the step takes fp32 or bf16"
    if not all(isinstance(k, NativeLinear) for k in linears):
        return "not every linear layer runs the native kernel (engine.kernels.kernel_choice picked another)"
    return unavailable_reason(load)


def _lin(kernel: Linear, n: int, k: int, name: str) -> _Lin:
    assert isinstance(kernel, NativeLinear)
    if (kernel.out_features, kernel.in_features) != (n, k):
        raise ValueError(f"{name} is [{kernel.out_features}x{kernel.in_features}], the step needs [{n}x{k}]")
    w, scale, bias = kernel.operands()
    group, gain = kernel.grouping()
    return _Lin(w.data_ptr(), None if scale is None else scale.data_ptr(), None if bias is None else bias.data_ptr(),
                _GROUPED if group else _KINDS[w.dtype], n, k, group, None if gain is None else gain.data_ptr())


class NativeDecodeStep:
    """One decode step of ``layers`` ((qkv, o_proj, gate_up, down) per layer, all `NativeLinear`) and
    ``lm_head`` in one call; build it only where `native_step_error` is None."""

    def __init__(self, layers: Sequence[tuple[Linear, Linear, Linear, Linear]], lm_head: Linear, *,
                 num_heads: int, num_kv_heads: int, head_dim: int, eps: float, dtype: torch.dtype) -> None:
        if (err := native_step_error([k for lay in layers for k in lay] + [lm_head], dtype)) is not None:
            raise ValueError(f"no native decode step: {err}")
        self.dtype, self.eps, self.scale = dtype, eps, head_dim**-0.5
        # up to the fewest rows any linear runs natively: beyond, its own kernel takes over (and so
        # does the per-layer path, which this step equals bit for bit)
        self.max_rows = min(k.max_rows for lay in layers for k in (*lay, lm_head) if isinstance(k, NativeLinear))
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden = lm_head.in_features
        self.vocab = lm_head.out_features
        width, qw = (num_heads + 2 * num_kv_heads) * head_dim, num_heads * head_dim
        inter = layers[0][3].in_features
        self._layers = [
            (_lin(qkv, width, self.hidden, f"layer {i} qkv"), _lin(o, self.hidden, qw, f"layer {i} o_proj"),
             _lin(gu, 2 * inter, self.hidden, f"layer {i} gate_up"), _lin(down, self.hidden, inter, f"layer {i} down"))
            for i, (qkv, o, gu, down) in enumerate(layers)
        ]
        self._lm_head = _lin(lm_head, self.vocab, self.hidden, "lm_head")
        self._fn = getattr(load(), f"decode_step_{_ACTS[dtype]}")
        self._caches: dict[tuple[int, ...], ctypes.Array[_Layer]] = {}

    def _layer_array(self, k_cache: Sequence[torch.Tensor], v_cache: Sequence[torch.Tensor]) -> ctypes.Array[_Layer]:
        """The layers' structs with this cache's pointers, checked and built the first time it is seen."""
        key = (*(t.data_ptr() for t in (*k_cache, *v_cache)), *k_cache[0].shape)
        arr = self._caches.get(key)
        if arr is not None:
            return arr
        shape = tuple(k_cache[0].shape)
        if len(k_cache) != len(self._layers) or len(v_cache) != len(self._layers):
            raise ValueError(f"the cache has {len(k_cache)}/{len(v_cache)} layers, the model {len(self._layers)}")
        for t in (*k_cache, *v_cache):
            if t.dtype != self.dtype or tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"every cache layer must be a contiguous CPU {self.dtype} {shape}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if len(shape) != 4 or shape[2:] != (self.kv_heads, self.head_dim):
            raise ValueError(f"cache layers must be [num_blocks, bs, {self.kv_heads}, {self.head_dim}], got {shape}")
        arr = (_Layer * len(self._layers))(*(
            _Layer(*lins, k.data_ptr(), v.data_ptr()) for lins, k, v in zip(self._layers, k_cache, v_cache, strict=True)
        ))
        if len(self._caches) >= 4:  # a new cache (an engine re-sized its pool): forget the oldest
            self._caches.pop(next(iter(self._caches)))
        self._caches[key] = arr
        return arr

    def __call__(self, h: torch.Tensor, store: RopeStore, block_table: torch.Tensor,
                 k_cache: Sequence[torch.Tensor], v_cache: Sequence[torch.Tensor]) -> torch.Tensor:
        """h [B, hidden] (the embedded tokens; overwritten); ``store`` the step's checked positions and
        slots; block_table [B, NB] int64 → logits [B, vocab] in the activation dtype."""
        b = h.shape[0]
        if h.dtype != self.dtype or tuple(h.shape) != (b, self.hidden) or not h.is_contiguous() or not h.is_cpu:
            raise ValueError(f"h must be a contiguous CPU {self.dtype} [B, {self.hidden}], got {h.dtype} "
                             f"{tuple(h.shape)}")
        if not 1 <= b <= self.max_rows:
            raise ValueError(f"the native step takes 1..{self.max_rows} sequences, got {b}")
        if (store.positions.shape[0], store.num_heads, store.num_kv_heads, store.head_dim) != \
                (b, self.heads, self.kv_heads, self.head_dim):
            raise ValueError(f"the rope store is for {store.positions.shape[0]} tokens of {store.num_heads}/"
                             f"{store.num_kv_heads} heads of {store.head_dim}, the step has {b} of "
                             f"{self.heads}/{self.kv_heads} of {self.head_dim}")
        layers = self._layer_array(k_cache, v_cache)
        bs = k_cache[0].shape[1]
        if store.cache_slots != k_cache[0].shape[0] * bs:
            raise ValueError(f"the slots were checked for {store.cache_slots} cache slots, the cache has "
                             f"{k_cache[0].shape[0] * bs}")
        table = block_table.contiguous()
        if table.dtype != torch.long or table.dim() != 2 or table.shape[0] != b:
            raise ValueError(f"block_table must be int64 [B={b}, nb], got {table.dtype} {tuple(table.shape)}")
        lens = store.positions + 1  # [B] visible positions; >= 1: RopeStore checked positions >= 0
        if int(lens.max()) > table.shape[1] * bs:
            raise ValueError(f"a position lies past its block table ({table.shape[1]} blocks of {bs})")
        logits = torch.empty(b, self.vocab, dtype=self.dtype)  # [B, vocab]
        args = _Args(b, len(self._layers), self.heads, self.kv_heads, self.head_dim, store.cos.shape[1], bs,
                     table.shape[1], self.hidden, torch.get_num_threads(), self.eps, self.scale, layers, self._lm_head,
                     store.cos.data_ptr(), store.sin_signed.data_ptr(), store.rows.data_ptr(), store.slots.data_ptr(),
                     table.data_ptr(), lens.data_ptr(), h.data_ptr(), logits.data_ptr())
        self._fn(ctypes.byref(args))
        return logits
