"""`engine.kernels.native_prefill`: the causal fp32 prefill attention kernel against torch's SDPA (the same
causal attention, float64 as the oracle), from position 0 and after a cached context, over head sizes,
GQA groups, lengths that are not multiples of the kernel's blocks, strided qkv views and thread counts;
what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.native_prefill import native_prefill_applies, native_prefill_attention
from tests.support.markers import needs_cxx


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
          dtype: torch.dtype) -> torch.Tensor:
    """Causal attention in ``dtype``: query i at position start + i sees keys 0 .. start + i."""
    s, n = q.shape[0], k.shape[0]
    qh, kh, vh = (t.to(dtype).transpose(0, 1)[None] for t in (q, k, v))
    mask = torch.arange(n)[None, :] <= (start + torch.arange(s))[:, None]  # [S, L]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _check(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> None:
    """got is the float64 oracle up to fp32 rounding: no further from it than torch's own fp32 SDPA (x2)."""
    want = _sdpa(q, k, v, start, scale, torch.float64)
    torch_err = (_sdpa(q, k, v, start, scale, torch.float32).double() - want).abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * torch_err + 1e-6, f"max error {err:.3g} vs torch fp32 SDPA's {torch_err:.3g}"


def _qkv(s: int, heads: int, kv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided slices of one [S, (H + 2 KV) * D] product, as the model hands them over."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, (heads + 2 * kv) * d, generator=g) * 2
    q = qkv[:, : heads * d].view(s, heads, d)
    k = qkv[:, heads * d : (heads + kv) * d].view(s, kv, d)
    v = qkv[:, (heads + kv) * d :].view(s, kv, d)
    return q, k, v


@needs_cxx
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("heads", "kv"), [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("s", [1, 31, 33, 200])  # one query; under, over and well past one 32-row block
def test_from_position_zero_matches_causal_attention(d: int, heads: int, kv: int, s: int) -> None:
    q, k, v = _qkv(s, heads, kv, d, seed=s + d + heads)
    assert native_prefill_applies(q, k, v)
    got = native_prefill_attention(q, k, v, 0, d**-0.5)
    assert got.shape == (s, heads, d) and got.is_contiguous()
    _check(got, q, k, v, 0, d**-0.5)


@needs_cxx
@pytest.mark.parametrize(("start", "s"), [(5, 1), (40, 17), (64, 64), (100, 70)])
def test_a_chunk_after_a_cached_context_sees_every_earlier_key(start: int, s: int) -> None:
    q, _, _ = _qkv(s, 9, 3, 64, seed=start)
    _, k, v = _qkv(start + s, 9, 3, 64, seed=start + 1)
    k, v = k.contiguous(), v.contiguous()  # the gathered context: contiguous rows
    got = native_prefill_attention(q, k, v, start, 0.125)
    _check(got, q, k, v, start, 0.125)


@needs_cxx
def test_the_result_does_not_depend_on_the_thread_count() -> None:
    q, k, v = _qkv(150, 9, 3, 64, seed=7)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            outs.append(native_prefill_attention(q, k, v, 0, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_cxx
def test_what_it_does_not_take_is_refused() -> None:
    q, k, v = _qkv(8, 9, 3, 64, seed=1)
    assert not native_prefill_applies(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))
    q96, k96, v96 = _qkv(8, 9, 3, 96, seed=2)
    assert not native_prefill_applies(q96, k96, v96)  # head size the kernel has no tile for
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads not contiguous within a row
    assert not native_prefill_applies(qt, k, v)
    q8, _, _ = _qkv(8, 8, 3, 64, seed=3)
    assert not native_prefill_applies(q8, k, v)  # 8 query heads over 3 KV heads: not whole groups
    with pytest.raises(ValueError, match="keys cannot cover"):
        native_prefill_attention(q, k, v, 1, 0.125)  # 8 keys for queries at positions 1..8
    with pytest.raises(ValueError, match="does not take"):
        native_prefill_attention(q96, k96, v96, 0, 0.125)
