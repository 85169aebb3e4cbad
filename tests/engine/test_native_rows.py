"""`engine.kernels.native_rows`: RMSNorm (no gain) and silu(gate) * up over rows, against torch's ops in fp32
(tight) and bf16 (one rounding: within a bf16 step of the fp32 result), at row counts on both sides
of the kernel's thread split, widths that are not a multiple of the vector, and what goes to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import native_rows
from engine.kernels.native_rows import glu, rms_norm
from tests.support.markers import needs_cxx

EPS = 1e-5


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 3).to(dtype)


def _bf16_close(got: torch.Tensor, want_fp32: torch.Tensor) -> None:
    """got is want rounded once to bf16: |got - want| <= half a bf16 step (2^-8 relative) + tiny slack."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want_fp32, atol=1e-6, rtol=2**-8 + 1e-6)


@needs_cxx
@pytest.mark.parametrize("m", [1, 3, 64, 300])  # 64 x 576 and up split rows over threads
@pytest.mark.parametrize("k", [576, 13])
def test_rms_norm_matches_torch(m: int, k: int) -> None:
    x = _rows(m, k, torch.float32, m + k)
    assert native_rows.load() is not None
    torch.testing.assert_close(rms_norm(x, EPS), F.rms_norm(x, (k,), None, EPS), atol=1e-6, rtol=1e-6)
    xb = x.to(torch.bfloat16)
    _bf16_close(rms_norm(xb, EPS), F.rms_norm(xb.float(), (k,), None, EPS))


@needs_cxx
@pytest.mark.parametrize("m", [1, 3, 64, 300])
@pytest.mark.parametrize("k", [1536, 13])
def test_glu_matches_torch(m: int, k: int) -> None:
    gu = _rows(m, 2 * k, torch.float32, m * k)
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, -1e-3])  # silu's tails and its sign change
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(glu(gu), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    gb = gu.to(torch.bfloat16)
    g32, u32 = gb.float().chunk(2, dim=-1)
    _bf16_close(glu(gb), F.silu(g32) * u32)  # torch's bf16 path rounds silu first: not the oracle


@needs_cxx
def test_the_result_does_not_depend_on_the_thread_count() -> None:
    x, gu = _rows(300, 576, torch.bfloat16, 1), _rows(300, 3072, torch.float32, 2)
    before = torch.get_num_threads()
    try:
        out = []
        for n in (1, 3):
            torch.set_num_threads(n)
            out.append((rms_norm(x, EPS), glu(gu)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_what_the_kernel_does_not_take_goes_to_torch() -> None:
    x = _rows(6, 10, torch.float32, 3).view(2, 3, 10)  # 3-D
    torch.testing.assert_close(rms_norm(x, EPS), F.rms_norm(x, (10,), None, EPS))
    odd = _rows(4, 7, torch.float32, 4)[:, :7]  # an odd width has no halves
    with pytest.raises(RuntimeError):
        glu(odd)  # torch's chunk + mul: the shapes of the two halves differ
    h = _rows(4, 16, torch.float16, 5)  # a dtype the kernel has no entry for
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(glu(h), F.silu(gate) * up)
    strided = _rows(8, 32, torch.float32, 6)[:, ::2]  # not contiguous: copied first
    torch.testing.assert_close(rms_norm(strided, EPS), F.rms_norm(strided, (16,), None, EPS), atol=1e-6, rtol=1e-6)
