"""`engine.kernels.native_step`: the whole decode step in one C++ call equals the per-layer native path bit for
bit (logits and every cache write), in fp32, bf16 and int8, at one and several sequences; it is used
only where every piece of that path is native; every index it trusts is checked first.

The per-layer native path itself is held to the reference path by `test_fast_paths` (and through it
to transformers by `test_model_oracle`); the native step is also on that path there (its decode
steps have 3 sequences), so these tests pin it to both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.cpu import CpuBackend
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from engine.model.model import build_model
from engine.runner import DecodeSeq, ModelRunner, PrefillChunk
from tests.support.markers import needs_cxx
from tests.support.models import make_tiny

pytestmark = needs_cxx
BLOCK = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("llama"), seed=11, num_attention_heads=6,
                     num_key_value_heads=2, hidden_size=96)


def runner(path: Path, dtype: torch.dtype, quantization: str | None = None, kernels: str = "native",
           attention: str = "native") -> ModelRunner:
    cfg = ModelConfig.from_dir(path)
    config = EngineConfig(backend="cpu", quantization=quantization, linear_kernels=kernels, decode_attention=attention)
    model = build_model(cfg, load_weights(path, cfg, dtype), 256, config)
    return ModelRunner(model, KVCache.allocate(cfg, 64, BLOCK, dtype))


def cpu(r: ModelRunner) -> CpuBackend:
    backend = r.model.attention
    assert isinstance(backend, CpuBackend)
    return backend


def decode_steps(r: ModelRunner, batch: int, steps: int = 4) -> list[torch.Tensor]:
    """Prefill ``batch`` prompts of different lengths on scattered blocks, then greedy decode steps."""
    tables = [[5, 9, 2, 30, 31, 17], [40, 3, 22, 8, 11], [50, 51, 52, 53, 54, 55, 56]][:batch]
    lens = [21, 4, 37][:batch]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]
    r.prefill([PrefillChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    tok, out = [7, 8, 9][:batch], []
    for _ in range(steps):
        logits = r.decode([DecodeSeq(t, n, tb) for t, n, tb in zip(tok, lens, tables, strict=True)])
        out.append(logits)
        tok = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    return out


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("dtype", "quantization"),
                         [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8"),
                          (torch.bfloat16, "int8")])
def test_step_equals_the_per_layer_native_path(tiny_dir: Path, dtype: torch.dtype, quantization: str | None,
                                               batch: int) -> None:
    one_call = runner(tiny_dir, dtype, quantization)
    per_layer = runner(tiny_dir, dtype, quantization)
    assert cpu(one_call).native_step is not None, cpu(one_call).native_step_error
    cpu(per_layer).native_step = None
    got, want = decode_steps(one_call, batch), decode_steps(per_layer, batch)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    for a, b in zip([*one_call.cache.k, *one_call.cache.v], [*per_layer.cache.k, *per_layer.cache.v], strict=True):
        assert torch.equal(a, b)  # the same cache writes, at the same slots, and nothing else


def test_used_only_where_the_whole_path_is_native(tiny_dir: Path) -> None:
    assert cpu(runner(tiny_dir, torch.float32)).native_step is not None
    assert cpu(runner(tiny_dir, torch.float32, attention="auto")).native_step is not None  # auto may time others
    pinned = cpu(runner(tiny_dir, torch.float32, attention="sdpa"))
    assert pinned.native_step is None and "pinned to 'sdpa'" in (pinned.native_step_error or "")
    packed = cpu(runner(tiny_dir, torch.float32, kernels="plain"))
    assert packed.native_step is None and "not every linear" in (packed.native_step_error or "")


def test_every_index_is_checked_before_the_kernel_runs(tiny_dir: Path) -> None:
    r = runner(tiny_dir, torch.float32)
    m, cache = r.model, r.cache
    step = cpu(r).native_step
    assert step is not None
    cfg = m.cfg
    slots = cache.k[0].shape[0] * BLOCK
    store = m.ropes[0].store(torch.tensor([20]), torch.tensor([3]), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             slots)
    h = torch.zeros(1, cfg.hidden_size)
    with pytest.raises(ValueError, match="a position lies past its block table"):
        step(h, store, torch.tensor([[0, 1]]), cache.k, cache.v)  # 2 blocks of 8 hold positions 0..15
    with pytest.raises(ValueError, match="block_table must be int64"):
        step(h, store, torch.tensor([[0, 1, 2]], dtype=torch.int32), cache.k, cache.v)
    with pytest.raises(ValueError, match="h must be a contiguous CPU"):
        step(h.bfloat16(), store, torch.tensor([[0, 1, 2]]), cache.k, cache.v)
    with pytest.raises(ValueError, match="the rope store is for 1 tokens"):
        step(torch.zeros(2, cfg.hidden_size), store, torch.tensor([[0, 1, 2]] * 2), cache.k, cache.v)
    with pytest.raises(ValueError, match="every cache layer must be"):
        step(h, store, torch.tensor([[0, 1, 2]]), [k.bfloat16() for k in cache.k], cache.v)
    with pytest.raises(ValueError, match="the cache has 1/1 layers"):
        step(h, store, torch.tensor([[0, 1, 2]]), cache.k[:1], cache.v[:1])
    before = [k.clone() for k in cache.k]
    h = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))  # k != 0 at every layer
    step(h, store, torch.tensor([[0, 1, 2]]), cache.k, cache.v)  # valid: writes slot 3 of every layer only
    for a, b in zip(cache.k, before, strict=True):
        changed = (a != b).view(slots, -1).any(-1).nonzero().flatten().tolist()
        assert changed == [3]
