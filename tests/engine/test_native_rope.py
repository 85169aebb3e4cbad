"""`engine.kernels.native_rope`: RoPE in place and the paged-cache store against the reference rotation
(`engine.model.rope.RotaryEmbedding.apply`, fp32) and `write_kv`, over whole heads and over their first 12 of 16
dims (partial rotary); every index checked before the kernel runs."""

from __future__ import annotations

import pytest
import torch

from engine.attention.ops import write_kv
from engine.kernels.native_rope import RopeStore
from engine.model.rope import RotaryEmbedding
from tests.support.markers import needs_cxx

H, KV, D, P = 6, 2, 16, 64


def tables(rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    half = rope.sin.shape[1] // 2
    return rope.cos, torch.cat([-rope.sin[:, :half], rope.sin[:, half:]], -1)


@pytest.fixture(scope="module", params=[1.0, 0.75], ids=["whole-heads", "partial"])
def rope(request: pytest.FixtureRequest) -> RotaryEmbedding:
    from types import SimpleNamespace

    cfg = SimpleNamespace(head_dim=D, rope_theta=10000.0, rope_scaling=None, partial_rotary_factor=request.param)
    return RotaryEmbedding(cfg, P, torch.device("cpu"))  # type: ignore[arg-type]


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [5, 100])  # a decode batch (one thread); prefill rows (split over threads)
def test_rotates_in_place_and_stores_exactly_the_given_slots(rope: RotaryEmbedding, dtype: torch.dtype,
                                                             t: int) -> None:
    g = torch.Generator().manual_seed(t)
    qkv = torch.randn(t, (H + 2 * KV) * D, generator=g).to(dtype)
    positions = torch.tensor([0, 7, 3, 63, 12]) if t == 5 else torch.randint(0, P, (t,), generator=g)
    n_slots = 32 if t == 5 else 128
    # scattered over the blocks of 8
    slots = torch.tensor([9, 0, 31, 17, 4]) if t == 5 else torch.randperm(n_slots, generator=g)[:t]
    kc, vc = torch.zeros(n_slots // 8, 8, KV, D, dtype=dtype), torch.zeros(n_slots // 8, 8, KV, D, dtype=dtype)
    q_ref, k_ref = rope.apply(qkv[:, : H * D].float().view(t, H, D), qkv[:, H * D : (H + KV) * D].float().view(
        t, KV, D), positions)
    v = qkv[:, (H + KV) * D :].view(t, KV, D).clone()
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv(want_k, want_v, slots, k_ref.to(dtype), v)

    cos, sin = tables(rope)
    RopeStore.for_batch(positions, slots, cos, sin, H, KV, n_slots, head_dim=D)(qkv, kc, vc)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(qkv[:, : H * D].float().view(t, H, D), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(kc.float(), want_k.float(), atol=tol, rtol=tol)
    assert torch.equal(vc, want_v)  # v is copied, not rounded
    assert torch.equal(qkv[:, (H + KV) * D :].view(t, KV, D), v)  # and left as it was
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(n_slots, KV * D)[untouched].any() and not vc.view(n_slots, KV * D)[untouched].any()


@needs_cxx
def test_every_index_is_checked_before_the_kernel_runs(rope: RotaryEmbedding) -> None:
    cos, sin = tables(rope)
    pos, slots = torch.tensor([0, 1]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 64\), got \[0, 64\]"):
        RopeStore.for_batch(torch.tensor([0, 64]), slots, cos, sin, H, KV, 32, head_dim=D)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 64\), got \[0, 64\]"):  # a table row
        RopeStore.for_batch(pos, slots, cos, sin, H, KV, 32, head_dim=D, rows=torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        RopeStore.for_batch(torch.tensor([-1, 1]), slots, cos, sin, H, KV, 32, head_dim=D, rows=pos)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 32\), got \[-1, 1\]"):
        RopeStore.for_batch(pos, torch.tensor([-1, 1]), cos, sin, H, KV, 32, head_dim=D)
    with pytest.raises(ValueError, match="int64"):
        RopeStore.for_batch(pos.int(), slots, cos, sin, H, KV, 32, head_dim=D)
    with pytest.raises(ValueError, match="R even and R <= head_dim 8"):
        RopeStore.for_batch(pos, slots, cos, sin, H, KV, 32, head_dim=8)
    store = RopeStore.for_batch(pos, slots, cos, sin, H, KV, 32, head_dim=D)
    kc = torch.zeros(4, 8, KV, D)
    with pytest.raises(ValueError, match=r"qkv must be a contiguous fp32/bf16 \[2, 160\]"):
        store(torch.zeros(2, 159), kc, kc.clone())
    with pytest.raises(ValueError, match="caches must be"):
        store(torch.zeros(2, 160), kc.bfloat16(), kc.bfloat16())
    with pytest.raises(ValueError, match="checked for 32 cache slots, this cache has 16"):
        store(torch.zeros(2, 160), torch.zeros(2, 8, KV, D), torch.zeros(2, 8, KV, D))
