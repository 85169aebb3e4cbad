"""Host → device copies (`engine.device_copy`): the helper's values, no pinning off CUDA, and the
runner's batches and the cache's block indices built only through it (so on CUDA nothing in a step's
setup waits on the device: checked there under torch's sync debug mode)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import device_copy
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import EngineConfig
from engine.engine import Engine
from engine.runner import DecodeSeq, PrefillChunk

VALUES: list[tuple[Any, torch.dtype]] = [
    ([3, 1, 4, 1, 5], torch.long),
    ([[0, 2], [7, 9]], torch.long),
    ([0.5, -1.25, 3.0], torch.float32),
    ([1, 2, 3], torch.int32),
    ([], torch.long),
]


@pytest.mark.parametrize(("values", "dtype"), VALUES)
def test_host_tensor_on_cpu_is_torch_tensor_and_pins_nothing(values: Any, dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pin(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        raise AssertionError("pinned on a CPU device")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pin)
    got = device_copy.host_tensor(values, torch.device("cpu"), dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.device.type == "cpu" and torch.equal(got, want)
    t = torch.tensor(values, dtype=dtype)
    assert device_copy.send(t, torch.device("cpu")) is t  # no copy at all on the CPU
    moved = device_copy.send(t, torch.device("meta"))  # another device: copied, still not pinned
    assert moved.device.type == "meta" and moved.shape == t.shape and moved.dtype == dtype


@pytest.fixture(scope="module")
def engine(tiny_path: Path) -> Engine:
    return Engine.from_dir(tiny_path, EngineConfig(num_blocks=16, block_size=8, backend="reference"))


@contextmanager
def watched() -> Iterator[tuple[list[torch.Tensor], list[object]]]:
    """Every tensor `engine.device_copy.send` returns, and every device a ``torch.tensor`` call names
    while the block runs (on a CPU the helper never names one: any named device is a bypass)."""
    sent: list[torch.Tensor] = []
    named: list[object] = []
    real_send, real_tensor = device_copy.send, torch.tensor

    def send(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = real_send(t, device)
        sent.append(out)
        return out

    def tensor(*a: Any, **k: Any) -> torch.Tensor:
        if k.get("device") is not None:
            named.append(k["device"])
        return real_tensor(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_copy, "send", send)
        mp.setattr(torch, "tensor", tensor)
        yield sent, named


def from_sent(t: torch.Tensor, sent: list[torch.Tensor]) -> bool:
    """t is one of the sent tensors, or a view of one."""
    ptr = t.untyped_storage().data_ptr()
    return any(s.untyped_storage().data_ptr() == ptr for s in sent)


def test_runner_builds_prefill_and_decode_batches_only_through_the_helper(engine: Engine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runner = engine.runner
    model = runner.model
    seen: list[object] = []
    real_prefill, real_decode = model.prefill, model.decode

    def prefill(batch: PrefillBatch, cache: object, *a: Any) -> torch.Tensor:
        seen.append(batch)
        return real_prefill(batch, cache, *a)  # type: ignore[arg-type]

    def decode(batch: DecodeBatch, cache: object, *a: Any) -> torch.Tensor:
        seen.append(batch)
        return real_decode(batch, cache, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "prefill", prefill)
    monkeypatch.setattr(model, "decode", decode)
    chunks = [PrefillChunk([5, 6, 7, 8, 9], 0, [1]), PrefillChunk([10, 11, 12, 13, 14, 15, 16, 17, 18], 0, [2, 3])]
    with watched() as (sent, named):
        pre = runner.prefill(chunks)
        dec = runner.decode([DecodeSeq(19, 9, [2, 3]), DecodeSeq(20, 5, [1])])  # rows sorted, then put back
    assert named == []
    p, d = seen
    assert isinstance(p, PrefillBatch) and isinstance(d, DecodeBatch)
    for t in (p.token_ids, p.positions, p.slots, p.logits_index, *p.block_tables,
              d.token_ids, d.positions, d.slots, d.block_table):
        assert from_sent(t, sent)
    assert p.token_ids.tolist() == [*chunks[0].token_ids, *chunks[1].token_ids]
    assert p.slots.tolist() == [8, 9, 10, 11, 12, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    assert [bt.tolist() for bt in p.block_tables] == [[1], [2, 3]] and p.logits_index.tolist() == [4, 13]
    assert d.token_ids.tolist() == [20, 19] and d.block_table.tolist() == [[1, 0], [2, 3]]
    assert d.slots.tolist() == [13, 25] and d.positions.tolist() == [5, 9]
    # the same logits as each sequence decoded alone (the caller's row order restored)
    alone = [runner.decode([DecodeSeq(19, 9, [2, 3])]), runner.decode([DecodeSeq(20, 5, [1])])]
    torch.testing.assert_close(dec, torch.cat(alone), atol=1e-5, rtol=1e-5)
    assert pre.shape[0] == 2


def test_cache_block_copies_build_their_index_through_the_helper(engine: Engine) -> None:
    cache = engine.cache
    before = [t.clone() for t in (*cache.k, *cache.v)]
    g = torch.Generator().manual_seed(0)
    for k, v in zip(cache.k, cache.v, strict=True):
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    try:
        with watched() as (sent, named):
            got = cache.gather_blocks([4, 2, 7])
            cache.scatter_blocks([9, 11, 10], got)
        assert named == [] and len(sent) == 2
        for layer in range(cache.num_layers):
            assert torch.equal(got[layer, 0], cache.k[layer][[4, 2, 7]])
            assert torch.equal(cache.v[layer][[9, 11, 10]], cache.v[layer][[4, 2, 7]])
    finally:
        for t, old in zip((*cache.k, *cache.v), before, strict=True):
            t.copy_(old)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_on_cuda_a_decode_step_does_not_wait_on_the_device(tiny_path: Path, graphs: bool) -> None:
    """The torch backend on CUDA: a runner decode step (batch build, metadata, forward, graph
    replay) raises nothing under torch's sync debug mode, and gives the logits of a warm-up step."""
    eng = Engine.from_dir(tiny_path, EngineConfig(device="cuda", dtype="float32", num_blocks=32, block_size=16,
                                                  backend="torch", cuda_graphs=graphs))
    runner = eng.runner
    runner.prefill([PrefillChunk(list(range(3, 20)), 0, [1, 2]), PrefillChunk(list(range(30, 40)), 0, [3])])
    seqs = [DecodeSeq(21, 17, [1, 2]), DecodeSeq(41, 10, [3])]
    warm = [runner.decode(seqs) for _ in range(2)][-1]  # compiles and captures (those may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.decode(seqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(logits, warm)
