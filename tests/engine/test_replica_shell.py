"""The pools' Serve replica classes in-process (no Ray): what `engine.replica.ReplicaShell` gives both
— ready, load reports, block books, refusing work while draining — and each pool's own shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.deployment import DecodeServer
from decode_worker.types import DecodeRequest
from engine.config import EngineConfig
from engine.errors import QueueFullError
from engine.sampling.sampler import SamplingParams
from kv_transfer.config import KVTransferConfig
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.deployment import PrefillServer
from prefill_worker.types import PrefillRequest
from tests.support.models import make_tiny_chat_model

pytestmark = [
    pytest.mark.timeout(120),
    # Serve awaits an async __del__; outside Serve the garbage collector only makes the coroutine
    pytest.mark.filterwarnings("ignore:coroutine 'ReplicaShell.__del__' was never awaited"),
]

PROMPT = tuple(range(10, 50))
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), seed=5)


def _engine() -> EngineConfig:
    return EngineConfig(num_blocks=64, block_size=16, backend="reference")


async def test_a_colocated_replica_serves_then_drains(chat_model: Path) -> None:
    server = DecodeServer(DecodeWorkerConfig(model=str(chat_model), engine=_engine(), mode="colocated"))
    assert server.replica_id.startswith("colocated-") and server.eos_token_ids
    assert await server.ready() and (await server.load()).ready
    tokens = [t async for ev in server.generate(DecodeRequest("r1", PROMPT, PARAMS)) for t in ev.token_ids]
    assert len(tokens) == 4
    stats = await server.stats()
    assert (stats["kv_blocks_total"], stats["kv_blocks_used"], stats["streams"]) == (64, 0, 0)
    await server.shutdown(drain_timeout_s=1.0)
    assert not await server.ready() and not (await server.load()).ready
    with pytest.raises(QueueFullError, match="this decode replica is draining"):
        await anext(server.generate(DecodeRequest("r2", PROMPT, PARAMS)))


async def test_a_prefill_replica_hands_off_then_drains(chat_model: Path) -> None:
    kv = KVTransferConfig(host="127.0.0.1", secret="a-test-cluster-secret", lease_s=30.0)
    server = PrefillServer(PrefillWorkerConfig(model=str(chat_model), engine=_engine(), kv=kv, warmup_tokens=0))
    assert server.replica_id.startswith("prefill-")
    result = await server.prefill(PrefillRequest("r1", PROMPT, PARAMS))
    assert result.handle is not None and not result.finished
    stats = await server.stats()
    assert stats["outbox_pending"] == 1 and stats["kv_blocks_used"] == result.handle.n_blocks
    report = await server.load()
    assert report.ready and report.outbox_pending == 1
    assert report.kv_source == result.handle.source  # where decode replicas meet it, before any request
    await server.shutdown(drain_timeout_s=0.2)  # nobody pulls: what the outbox holds is released
    assert not await server.ready() and not (report := await server.load()).ready
    assert report.kv_source is None  # the source stopped: nothing left to meet
    assert (await server.stats())["kv_blocks_used"] == 0
    with pytest.raises(QueueFullError, match="this prefill replica is draining"):
        await server.prefill(PrefillRequest("r2", PROMPT, PARAMS))
