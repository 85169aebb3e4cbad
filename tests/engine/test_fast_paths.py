"""Every path of the ``cpu`` backend against the ``reference`` backend on tiny random models.

The reference path is the one `test_model_oracle` holds to transformers at 1e-4; here the fast
path (prepacked oneDNN or native linears with folded norm gains, fused norms, GLU and residuals,
fused RoPE, paged block-wise decode attention) must match it: to 1e-4 in fp32, and in bf16 to within twice the
reference's own bf16 error (both measured against the fp32 reference).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention import cpu as cpu_backend
from engine.attention import ops
from engine.attention.ops import decode_attention
from engine.config import EngineConfig
from engine.kernels import gathered_decode
from engine.kernels.gathered_decode import PagedDecodeMeta, Workspace, paged_decode_attention
from engine.kernels.prefill_choice import PrefillChoice
from engine.kernels.quant import Linear, PackedLinear, make_linear, onednn_packing_available
from engine.kv_cache import KVCache
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from engine.model.model import build_model
from engine.runner import DecodeSeq, ModelRunner, PrefillChunk
from tests.support.markers import needs_cxx
from tests.support.models import make_tiny

BLOCK = 8
METHODS = [pytest.param(m, marks=needs_cxx) if m in ("compiled", "native") else m
           for m in gathered_decode.DECODE_METHODS]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 6 heads over 2 KV heads: GQA groups of 3, as in SmolLM2.
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=5,
                     num_attention_heads=6, num_key_value_heads=2, hidden_size=96)


def runner(path: Path, dtype: torch.dtype, fast: bool, quantization: str | None = None,
           kernels: str = "auto", decode_attention: str = "auto") -> ModelRunner:
    cfg = ModelConfig.from_dir(path)
    config = EngineConfig(backend="cpu" if fast else "reference", quantization=quantization, linear_kernels=kernels,
                          decode_attention=decode_attention)
    model = build_model(cfg, load_weights(path, cfg, dtype), 256, config)
    return ModelRunner(model, KVCache.allocate(cfg, 64, BLOCK, dtype))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scenario(r: ModelRunner) -> list[torch.Tensor]:
    """Batched prefill (one chunk after a cached prefix), then 3 batched decode steps.

    Block tables are scattered on purpose (not 0, 1, 2, ...) so a slot or block mix-up shows.
    """
    tables = [[5, 9, 2, 30, 31, 17], [40, 3, 22, 8, 11], [50, 51, 52, 53, 54, 55, 56]]
    prompts = [ids(21, 1), ids(4, 2), ids(37, 3)]
    out = [r.prefill([PrefillChunk(prompts[0][:13], 0, tables[0])], all_logits=True)]
    out.append(r.prefill([PrefillChunk(prompts[0][13:], 13, tables[0]), PrefillChunk(prompts[1], 0, tables[1]),
                          PrefillChunk(prompts[2], 0, tables[2])], all_logits=True))
    lens = [len(p) for p in prompts]
    tok = [7, 8, 9]
    for _ in range(3):
        logits = r.decode([DecodeSeq(t, n, tb) for t, n, tb in zip(tok, lens, tables, strict=True)])
        out.append(logits)
        tok = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    return out


KERNELS = ["packed", "plain", pytest.param("native", marks=needs_cxx)]


@pytest.mark.parametrize("kernels", [*KERNELS, "auto"])
def test_fast_fp32_matches_reference(tiny_dir: Path, kernels: str) -> None:
    ref = scenario(runner(tiny_dir, torch.float32, fast=False))
    fast = scenario(runner(tiny_dir, torch.float32, fast=True, kernels=kernels))
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@needs_cxx
@pytest.mark.parametrize("native", [True, False])
def test_fp32_prefill_attention_of_either_choice_matches_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    native: bool) -> None:
    """Head size 64 (the kernel's): with the C++ kernel chosen, fresh chunks and one after a cached
    prefix run there; with SDPA chosen, none do; either equals the reference path's SDPA up to fp32
    rounding."""
    path = make_tiny("llama", tmp_path / "d64", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    calls: list[int] = []
    real = ops.native_prefill_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "native_prefill_attention", counted)
    monkeypatch.setattr(cpu_backend, "remembered_prefill_attention",
                        lambda *a: PrefillChoice(native, reason="pinned by the test"))
    ref = scenario(runner(path, torch.float32, fast=False))
    assert not calls
    fast = scenario(runner(path, torch.float32, fast=True))
    assert len(calls) == (2 * 4 if native else 0)  # 2 layers x (the first chunk + the three of the batched prefill)
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_fast_fp32_decode_attention_methods_match_reference(tiny_dir: Path, method: str) -> None:
    """Each decode attention method, through the whole model (3 sequences per step)."""
    ref = scenario(runner(tiny_dir, torch.float32, fast=False))
    fast = scenario(runner(tiny_dir, torch.float32, fast=True, kernels="packed", decode_attention=method))
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("small_rows", [gathered_decode.SMALL_DECODE_ROWS, 0])  # 0: bf16 decode via bmm, not SDPA
def test_fast_bf16_error_within_reference_bf16_error(tiny_dir: Path, small_rows: int, kernels: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gathered_decode, "SMALL_DECODE_ROWS", small_rows)
    exact = scenario(runner(tiny_dir, torch.float32, fast=False))
    ref = scenario(runner(tiny_dir, torch.bfloat16, fast=False))
    fast = scenario(runner(tiny_dir, torch.bfloat16, fast=True, kernels=kernels))
    ref_err = max((a - e).abs().max().item() for a, e in zip(ref, exact, strict=True))
    fast_err = max((a - e).abs().max().item() for a, e in zip(fast, exact, strict=True))
    assert fast_err <= 2 * ref_err + 1e-3, (fast_err, ref_err)


@pytest.mark.parametrize(("method", "softcap"), [
    pytest.param(m, None, marks=needs_cxx) if m in ("compiled", "native") else (m, None)
    for m in gathered_decode.DECODE_METHODS] + [(m, 2.0) for m in gathered_decode.SOFTCAP_METHODS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# bf16: the first three are small steps (fp32 after a cast), the last one the block-diagonal bf16 bmm path.
@pytest.mark.parametrize(("kv_heads", "group", "lengths"),
                         [(1, 1, [1]), (2, 3, [1, 9, 16, 40]), (3, 3, [300]), (2, 3, [100, 700, 5])])
def test_paged_decode_attention_matches_reference(dtype: torch.dtype, kv_heads: int, group: int,
                                                   lengths: list[int], method: str, softcap: float | None) -> None:
    g = torch.Generator().manual_seed(len(lengths) * 7 + kv_heads)
    d, bs, nb = 16, 16, 64
    kc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    kc[0].fill_(1e4)  # the padding block: masked, so its huge values must not leak
    vc[0].fill_(1e4)
    b = len(lengths)
    n_blocks = max((n + bs - 1) // bs for n in lengths)
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    rows = []
    for n in lengths:
        need = (n + bs - 1) // bs
        rows.append([perm.pop() for _ in range(need)] + [0] * (n_blocks - need))
    table = torch.tensor(rows)  # [B, n_blocks]
    pos = torch.tensor(lengths) - 1
    q = torch.randn(b, kv_heads * group, d, generator=g).to(dtype)
    cols = torch.arange(n_blocks * bs)
    bias = torch.zeros(b, 1, n_blocks * bs).masked_fill_((cols[None] > pos[:, None]).unsqueeze(1), float("-inf"))
    ws = Workspace()
    for _ in range(2):  # a second call reuses the workspace buffers
        got = paged_decode_attention(q, kc, vc, PagedDecodeMeta(table.reshape(-1), bias, b, n_blocks), ws, d**-0.5,
                                     method, softcap)
    ctx = torch.arange(int(pos.max()) + 1)
    slot_table = table[:, ctx // bs] * bs + ctx % bs
    want = decode_attention(q.float(), kc.float(), vc.float(), slot_table, ctx[None] <= pos[:, None], d**-0.5,
                            softcap)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.reshape(b, -1), atol=tol, rtol=tol)
    if softcap is not None:  # the reference itself against transformers' eager formula, one sequence at a time
        for i, n in enumerate(lengths):
            k = kc.float().flatten(0, 1)[slot_table[i, :n]].repeat_interleave(group, 1)  # [n, H, D]
            v = vc.float().flatten(0, 1)[slot_table[i, :n]].repeat_interleave(group, 1)
            s = torch.einsum("hd,nhd->hn", q[i].float(), k) * d**-0.5
            p = torch.softmax(torch.tanh(s / softcap) * softcap, -1)  # [H, n]
            torch.testing.assert_close(want[i], torch.einsum("hn,nhd->hd", p, v), atol=1e-5, rtol=1e-5)


def test_softcapped_prefill_matches_eager_formula() -> None:
    """`explicit_prefill_attention` in blocks of queries, after a context and in a window, against
    transformers' eager order (scale, cap, mask, softmax), and SDPA where nothing is capped."""
    g = torch.Generator().manual_seed(3)
    kvh, group, d, start, s_len = 2, 3, 16, 20, 37
    q = torch.randn(s_len, kvh * group, d, generator=g)
    k, v = torch.randn(start + s_len, kvh, d, generator=g), torch.randn(start + s_len, kvh, d, generator=g)
    q_pos, k_pos = torch.arange(start, start + s_len)[:, None], torch.arange(start + s_len)[None]
    for window, cap in ((None, 2.0), (9, 2.0), (9, None)):
        seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)  # [S, L]
        s = torch.einsum("shd,lhd->hsl", q, k.repeat_interleave(group, 1)) * d**-0.5
        s = s if cap is None else torch.tanh(s / cap) * cap
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        want = torch.einsum("hsl,lhd->shd", p, v.repeat_interleave(group, 1))
        for budget in (10**9, 1000):  # one block; blocks of a few rows
            ops.SCORE_BLOCK_ELEMENTS, old = budget, ops.SCORE_BLOCK_ELEMENTS
            try:
                got = ops.explicit_prefill_attention(q, k, v, start, d**-0.5, cap, window)
            finally:
                ops.SCORE_BLOCK_ELEMENTS = old
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_workspace_reuse_across_batch_sizes_keeps_zeros() -> None:
    """The block-diagonal query buffer is shared by steps of any batch size: off-diagonals stay 0."""
    ws = Workspace()
    big = ws.zeros("qblk", (4, 2, 3, 2, 8), torch.float32, torch.device("cpu"))
    big.diagonal(dim1=1, dim2=3).fill_(1.0)
    small = ws.zeros("qblk", (2, 2, 3, 2, 8), torch.float32, torch.device("cpu"))
    assert small.data_ptr() == big.data_ptr()
    off = small.clone()
    off.diagonal(dim1=1, dim2=3).zero_()
    assert off.abs().sum() == 0


@pytest.mark.parametrize("fmt", PackedLinear.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, fmt: str) -> None:
    """Both weight formats, every row regime (BLAS one row, oneDNN exact rows, oneDNN tiles)."""
    if not onednn_packing_available(dtype):
        pytest.skip("no oneDNN weight packing in this torch build")
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(48, 32, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    lin = make_linear(w, bias, fmt=fmt)
    assert isinstance(lin, PackedLinear) and lin.format == fmt
    assert lin.nbytes == Linear(w, bias).nbytes
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    for rows in (1, 5, 64, 65, 200, 512, 513, 1100):  # above 64: tiles of 512, the last one padded
        x, res = torch.randn(rows, 32, generator=g).to(dtype), torch.randn(rows, 48, generator=g).to(dtype)
        want = F.linear(x.float(), w.float(), bias.float())
        torch.testing.assert_close(lin(x).float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lin(x, residual=res).float(), want + res.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", PackedLinear.FORMATS)
def test_packed_linear_sees_a_fixed_set_of_row_counts(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """oneDNN caches a primitive per row count: every prompt length must map into one fixed set."""
    if not onednn_packing_available(torch.float32):
        pytest.skip("no oneDNN weight packing in this torch build")
    lin = make_linear(torch.randn(16, 8), fmt=fmt)
    assert isinstance(lin, PackedLinear)
    seen: set[int] = set()
    mm = lin._mm

    def spy(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        seen.add(x.shape[0])
        return mm(x, residual)

    monkeypatch.setattr(lin, "_mm", spy)
    for rows in range(1, 1601):
        assert lin(torch.zeros(rows, 8)).shape == (rows, 16)
    first = 2 if fmt == "plain" else 1  # the plain format runs one row through BLAS, not oneDNN
    assert seen == set(range(first, 65)) | set(range(128, 513, 64))


def test_decode_refuses_short_block_table(tiny_dir: Path) -> None:
    r = runner(tiny_dir, torch.float32, fast=True)
    with pytest.raises(ValueError, match="cannot hold position 16"):
        r.decode([DecodeSeq(5, 16, [1, 2])])
    with pytest.raises(ValueError, match="cannot hold position 8"):
        r.prefill([PrefillChunk([1] * 9, 0, [3])])


def test_eager_rope_and_store_match_reference(tiny_dir: Path) -> None:
    """The fast path without the native RoPE + cache store (no compiler): roll/addcmul and write_kv."""
    ref = scenario(runner(tiny_dir, torch.float32, fast=False))
    r = runner(tiny_dir, torch.float32, fast=True, kernels="packed", decode_attention="block_diagonal")
    r.model.attention.native_rope = False  # type: ignore[attr-defined]
    for a, b in zip(scenario(r), ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
