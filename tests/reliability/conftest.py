"""Fixtures of the reliability tests: the tiny model folder and one local Ray Serve for the package.

One Ray cluster (and one Serve HTTP proxy on a free 127.0.0.1 port) serves every module of this
package; each module deploys its own apps under its own route prefixes and deletes them when done.
``address="local"`` always starts a fresh cluster: never one somebody else started on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.models import make_tiny_chat_model
from tests.support.soak_run import SoakRun, start_soak


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama folder with SmolLM2's tokenizer (see `tests.support.models`)."""
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "model"))


@pytest.fixture(scope="package", autouse=True)
def background_soak(request: pytest.FixtureRequest, tiny_model: str,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[SoakRun | None]:
    """The 1-minute soak of `tests.reliability.test_soak`, started as the package starts so that it
    overlaps the other tests; None when that test was not collected. Stopped at the end regardless."""
    here = Path(__file__).parent
    if not any(item.path == here / "test_soak.py" for item in request.session.items):
        yield None
        return
    run = start_soak(tiny_model, tmp_path_factory.mktemp("soak"))
    try:
        yield run
    finally:
        run.stop()


@pytest.fixture(scope="package")
def serve_base() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a Serve proxy on a Ray cluster of this package's own."""
    from tests.support import journaled_replicas, pd_fakes, stuck_pools
    from tests.support.serve_harness import local_serve

    with local_serve(pd_fakes, journaled_replicas, stuck_pools) as base:
        yield base


@pytest.fixture(scope="package")
def fakes_url(serve_base: str, tiny_model: str) -> Iterator[str]:
    """``/fakes``: the real router with the tiny model's real tokenizer over fake pools.

    The pools are `tests.support.stuck_pools.HangingPrefill` / `StallingDecode` (the fakes of
    `tests.support.pd_fakes`, 1 ms per token, plus the magic words HANG and STALL, which a test sends
    as token ids: the fakes read prompts as code points); 256-token context, 1.5 s prefill and
    token timeouts. Shared by the HTTP fuzzers and the timeout tests: one deploy instead of two.
    """
    from cluster.app import compose_app
    from cluster.config import ClusterConfig
    from tests.support.serve_harness import FAKES_PREFILL_TIMEOUT_S, FAKES_TOKEN_TIMEOUT_S, cluster_args, deploy
    from tests.support.stuck_pools import HangingPrefill, StallingDecode

    args = cluster_args(tiny_model, limits={"max_model_len": 256, "prefill_timeout_s": FAKES_PREFILL_TIMEOUT_S,
                                            "token_timeout_s": FAKES_TOKEN_TIMEOUT_S})
    app = compose_app(ClusterConfig.from_args(args), prefill_cls=HangingPrefill, decode_cls=StallingDecode)
    with deploy(app, "fakes", serve_base) as url:
        yield url
