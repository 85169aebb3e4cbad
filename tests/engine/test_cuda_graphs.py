"""Decode steps as CUDA graphs (`engine.attention.cuda_graphs`): the ladder and padding logic on any
device, and on CUDA the torch backend's captured steps against the same steps run eager."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import LayerAttention
from engine.attention.cuda_graphs import DecodeGraphs, graph_ladder, padded_rows, rung_for
from engine.attention.torch_backend import TorchBackend
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from tests.support.paged_batches import decode_batch, make_cache, make_spec, scattered_tables

BS, NB = 16, 32


def test_ladder_doubles_up_to_max_num_seqs() -> None:
    assert graph_ladder(1) == (1,)
    assert graph_ladder(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_ladder(48) == (1, 2, 4, 8, 16, 32, 48)
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_ladder(0)


def test_a_batch_replays_at_the_smallest_rung_that_holds_it() -> None:
    ladder = graph_ladder(48)
    assert [rung_for(b, ladder) for b in (1, 2, 3, 5, 17, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert rung_for(49, ladder) is None
    assert padded_rows(3, 8).tolist() == [0, 1, 2, 0, 0, 0, 0, 0]


def test_loaded_buffers_pad_rows_with_row_0_and_tables_with_block_0() -> None:
    graphs = DecodeGraphs(max_num_seqs=8, table_width=6, device=torch.device("cpu"))
    positions = [5, 20, 40]
    tables = scattered_tables([1, 2, 3], NB)
    batch = decode_batch(positions, tables, BS, width=3)
    graphs.block_table.fill_(7)  # a previous, wider step's leftovers
    graphs.load(batch, rung=4)
    static = graphs.static_batch(4)
    assert static.positions.tolist() == [5, 20, 40, 5]
    assert static.slots.tolist() == [*batch.slots.tolist(), batch.slots[0].item()]
    assert static.block_table[:3, :3].tolist() == batch.block_table.tolist()
    assert static.block_table[3].tolist() == static.block_table[0].tolist()
    assert static.block_table[:, 3:].eq(0).all()


def test_batches_beyond_the_ladder_or_the_table_width_run_eager() -> None:
    graphs = DecodeGraphs(max_num_seqs=2, table_width=2, device=torch.device("cpu"))
    tables = scattered_tables([1, 1, 1], NB)

    def step(_: object) -> torch.Tensor:
        raise AssertionError("must not capture")

    assert graphs.run(step, decode_batch([1, 2, 3], tables, BS, width=2), ()) is None
    assert graphs.run(step, decode_batch([1], tables[:1], BS, width=3), ()) is None


class StubModel:
    """One attention layer between an embedding and an unembedding: what a decode step asks of a model."""

    def __init__(self, backend: TorchBackend, vocab: int = 32) -> None:
        spec = backend.spec
        g = torch.Generator().manual_seed(0)
        self.backend = backend
        self.embed = torch.randn(vocab, spec.q_size + 2 * spec.kv_size, generator=g).to(spec.device, spec.dtype)
        self.unembed = torch.randn(spec.q_size, vocab, generator=g).to(spec.device, spec.dtype)

    def forward(self, token_ids: torch.Tensor, cache: KVCache, meta: object) -> torch.Tensor:
        return self.backend.forward(0, self.embed[token_ids], cache, meta)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.unembed).float()


@pytest.mark.gpu
def test_captured_decode_steps_equal_eager_steps() -> None:
    spec = make_spec((LayerAttention(0, 0.25, window=24),), device="cuda")
    config = EngineConfig(device="cuda", block_size=BS, num_blocks=NB, max_num_seqs=4,
                          max_model_len=8 * BS)
    graphed, eager = TorchBackend(spec, config), TorchBackend(spec, config)
    eager.graphs = None
    assert graphed.graphs is not None and graphed.graphs.ladder == (1, 2, 4)
    caches = [make_cache(spec, NB, BS, seed=5) for _ in range(2)]
    models = StubModel(eager), StubModel(graphed)  # a graph reads the model it was captured over
    tables = scattered_tables([4, 4, 4, 4, 4], NB)
    for positions in ([3, 30, 50], [4, 31, 51], [9], [5, 32, 52, 60, 61]):  # rungs 4, 4, 1, then eager
        batch = decode_batch(positions, tables[: len(positions)], BS, width=4, device="cuda")
        want = eager.decode_step(models[0], batch, caches[0])  # type: ignore[arg-type]
        got = graphed.decode_step(models[1], batch, caches[1])  # type: ignore[arg-type]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32; padded shapes may tile differently
        torch.testing.assert_close(caches[1].k[0], caches[0].k[0], atol=1e-5, rtol=1e-5)
    assert sorted(graphed.graphs.graphs) == [1, 4]
