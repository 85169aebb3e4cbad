"""`engine.kernels.native_attention`: the C++ paged decode attention, its build, and what it refuses.

That it computes the reference attention over padded, scattered block tables in fp32 and bf16 is
also `test_fast_paths`'s (parametrized over every method); here: batched decode steps of a whole
engine pinned to it against the reference engine, lengths given by the runner, the build cache,
a missing compiler and a compile error (clear reasons, refused when pinned), and bad arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.attention.ops import decode_attention
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kernels import attention_choice, native_attention
from engine.kernels.attention_choice import choose_decode_attention
from engine.kernels.gathered_decode import GATHERED_METHODS
from engine.kernels.native_attention import NativeUnavailable, native_error, native_paged_attention
from engine.runner import DecodeSeq, PrefillChunk
from tests.support.markers import needs_cxx
from tests.support.models import make_tiny


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty build cache and no library loaded yet in this process."""
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path / "native"))
    native_attention.load.cache_clear()
    yield tmp_path / "native"
    native_attention.load.cache_clear()


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_decode_of_a_native_engine_matches_the_reference_engine(tmp_path: Path, dtype: str) -> None:
    path = make_tiny("llama", tmp_path / "m", seed=5, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    cfg = dict(num_blocks=64, block_size=8, dtype=dtype)
    fast = Engine.from_dir(path, EngineConfig(**cfg, decode_attention="native"))  # type: ignore[arg-type]
    ref = Engine.from_dir(path, EngineConfig(**cfg, backend="reference"))  # type: ignore[arg-type]
    assert fast.runner.model.attention.choice.method == "native"  # type: ignore[attr-defined]
    lengths = [3, 17, 40, 8, 1]  # several blocks, one block, one position
    logits = {}
    for name, eng in (("fast", fast), ("ref", ref)):
        seqs = []
        for i, n in enumerate(lengths):
            blocks = eng.pool.allocate(eng.blocks_for(n + 1))
            ids = [(7 * i + j) % 50 + 3 for j in range(n)]
            eng.runner.prefill([PrefillChunk(ids, 0, blocks)])
            seqs.append(DecodeSeq(11 + i, n, blocks))
        logits[name] = eng.runner.decode(seqs)
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(logits["fast"], logits["ref"], atol=tol, rtol=tol)


@needs_cxx
def test_explicit_lengths_and_a_built_library_is_reused(fresh_build: Path) -> None:
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(10, 4, 2, 8, generator=g), torch.randn(10, 4, 2, 8, generator=g)
    table = torch.tensor([[3, 7, 1], [2, 0, 0]])
    q = torch.randn(2, 4, 8, generator=g)
    got = native_paged_attention(q, kc, vc, table, torch.tensor([10, 3]), 0.3)  # [2, 4 * 8]
    built = list(fresh_build.glob("paged_decode-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    for b, n in enumerate((10, 3)):
        ctx = torch.arange(n)
        slots = (table[b, ctx // 4] * 4 + ctx % 4)[None]
        want = decode_attention(q[b : b + 1], kc, vc, slots, torch.ones(1, n, dtype=torch.bool), 0.3)
        torch.testing.assert_close(got[b], want.reshape(-1), atol=1e-5, rtol=1e-5)
    native_attention.load.cache_clear()
    assert native_error() is None
    assert built[0].stat().st_mtime_ns == mtime and list(fresh_build.glob("*.so")) == built


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 64 and 128: the unrolled kernels (AVX-512: 32-value chunks, query heads of a KV head together where
# their accumulators fit: groups 2-4 at 64, 2 at 128); 96: any D % 8 == 0 (vectors); 12: any D (scalar).
@pytest.mark.parametrize("head_dim", [64, 128, 96, 12])
@pytest.mark.parametrize("group", [1, 3, 4])  # query heads per KV head
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("lengths", [[1000], [17, 1, 300]])  # batch 1 cut into chunks; whole and cut mixed
def test_every_head_size_and_every_cut_matches_the_reference(dtype: torch.dtype, head_dim: int, group: int,
                                                             threads: int, lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(head_dim + len(lengths) + group)
    bs, kvh = 16, 2
    nb = sum((n + bs - 1) // bs for n in lengths) + 1
    kc = torch.randn(nb, bs, kvh, head_dim, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, head_dim, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    width = max((n + bs - 1) // bs for n in lengths)
    table = torch.tensor([[perm.pop() for _ in range((n + bs - 1) // bs)] + [0] * (width - (n + bs - 1) // bs)
                          for n in lengths])
    q = torch.randn(len(lengths), kvh * group, head_dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the cut into chunks depends on the thread count
    try:
        got = native_paged_attention(q, kc, vc, table, torch.tensor(lengths), head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    for b, n in enumerate(lengths):
        ctx = torch.arange(n)
        slots = (table[b, ctx // bs] * bs + ctx % bs)[None]
        want = decode_attention(q[b : b + 1], kc.float(), vc.float(), slots, torch.ones(1, n, dtype=torch.bool),
                                head_dim**-0.5)
        torch.testing.assert_close(got[b], want.reshape(-1), atol=2e-5, rtol=1e-4)


@needs_cxx
def test_loading_the_library_keeps_subnormal_floats(fresh_build: Path) -> None:
    """-ffast-math would link crtfastmath, whose constructor sets flush-to-zero for the whole process
    (hypothesis then refuses to run, and every later computation in the process changes)."""
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a subnormal fp32
    assert (tiny * 1.0).item() != 0.0
    native_attention.load()
    assert list(fresh_build.glob("paged_decode-*.so")), "the library was not built in this test"
    assert (tiny * 1.0).item() != 0.0 and (tiny / 2).item() != 0.0


def test_no_compiler_is_left_out_with_a_warning_and_refused_when_pinned(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert native_error() == "no C++ compiler 'no-such-compiler-xyz' on PATH"
    monkeypatch.setattr(attention_choice, "compiled_error", lambda *a: "not here")
    monkeypatch.setattr(attention_choice, "SIZES", ((2, 40),))
    with caplog.at_level(logging.WARNING, logger="engine.kernels.attention_choice"):
        got = choose_decode_attention(6, 2, 16)
    assert got.method in GATHERED_METHODS and set(got.ms) == set(GATHERED_METHODS)
    assert "native decode attention unavailable" in caplog.text and "no-such-compiler-xyz" in caplog.text
    with pytest.raises(RuntimeError, match=r"decode_attention='native' cannot run here.*no-such-compiler"):
        choose_decode_attention(6, 2, 16, "native")


@needs_cxx
def test_a_compile_error_names_the_compiler_output(fresh_build: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(native_attention, "SOURCE", bad)
    with pytest.raises(NativeUnavailable, match=r"failed:.*bad\.cpp"):
        native_attention.load()
    assert list(fresh_build.glob("*")) == []  # nothing half-written is left to load later


@needs_cxx
def test_bad_arguments_are_refused_before_the_kernel_runs() -> None:
    kc = torch.zeros(4, 4, 2, 8)
    q, table, lens = torch.zeros(2, 4, 8), torch.zeros(2, 1, dtype=torch.long), torch.tensor([1, 2])
    with pytest.raises(TypeError, match="fp32 or bf16"):
        native_paged_attention(q, kc.half(), kc.half(), table, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        native_paged_attention(q, kc.transpose(1, 2), kc.transpose(1, 2), table, lens, 1.0)
    with pytest.raises(ValueError, match="head geometry"):
        native_paged_attention(torch.zeros(2, 3, 8), kc, kc, table, lens, 1.0)
    with pytest.raises(ValueError, match="block_table"):
        native_paged_attention(q, kc, kc, table.int(), lens, 1.0)
    with pytest.raises(ValueError, match="lengths"):
        native_paged_attention(q, kc, kc, table, torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 4\], got \[1, 5\]"):
        native_paged_attention(q, kc, kc, table, torch.tensor([1, 5]), 1.0)
    with pytest.raises(ValueError, match="lengths must lie"):
        native_paged_attention(q, kc, kc, table, torch.tensor([0, 2]), 1.0)
