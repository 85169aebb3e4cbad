"""`engine.kernels.huge_pages` and the KV cache it allocates: always a zeroed contiguous tensor of the asked
shape; on Linux with transparent huge pages not set to ``never``, a large one really is backed by
huge pages (read back from /proc/self/smaps); the cache's per-layer views are independent."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.kernels.huge_pages import HUGE, huge_page_bytes, huge_zeros, thp_mode
from engine.kv_cache import KVCache
from engine.model.config import ModelConfig


@pytest.mark.parametrize("shape", [(3, 5), (4 * HUGE // 4 + 7,)])  # below the advice's floor, and above it
def test_the_result_is_an_ordinary_zeroed_tensor(shape: tuple[int, ...]) -> None:
    t = huge_zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
                    reason="transparent huge pages are off or unknown here")
def test_a_large_tensor_lands_on_huge_pages() -> None:
    plain = torch.zeros(32 * HUGE // 4)  # plain pages, unless THP is "always"
    t = huge_zeros((32 * HUGE // 2,), torch.bfloat16)  # 32 MiB
    got = huge_page_bytes(t)
    assert got is not None
    # The kernel may fall short of free huge pages, but never gives none to a fresh advised range.
    assert got >= HUGE, f"no huge pages for a 32 MiB advised tensor (THP {thp_mode()})"
    if thp_mode() == "madvise":
        assert (huge_page_bytes(plain) or 0) < got
    t[123] = 1.0
    assert t.sum() == 1.0


def test_the_cache_layers_are_independent_zeroed_views() -> None:
    cfg = ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=True,
                      attention_bias=False)
    cache = KVCache.allocate(cfg, num_blocks=5, block_size=4, dtype=torch.bfloat16)
    assert len(cache.k) == len(cache.v) == 3
    for t in (*cache.k, *cache.v):
        assert t.shape == (5, 4, 2, 4) and t.is_contiguous() and not t.any()
    cache.k[1][2] = 1.0
    assert cache.k[1].sum() == 4 * 2 * 4
    assert all(not t.any() for i, t in enumerate((*cache.k, *cache.v)) if i != 1)
