"""The per-request path on a real local Ray Serve (the package's cluster, tests/e2e/conftest.py): a tiny
random Llama with SmolLM2's tokenizer, one prefill and one decode replica, KV over gloo.

Two apps: ``/path-auto`` (``router.prefill_path: auto``, no objectives: LOCAL for a short prompt,
REMOTE otherwise) and ``/path-remote`` (always remote). Oracle: the always-remote app's greedy text
for the same request; the path taken is read off the auto app's ``/metrics``: the decision counter
(``pdserve:path_decisions_total``) and the KV pulls (``pdserve:kv_transfer_time_seconds``, observed only
for a request whose KV the decode replica pulled from a prefill replica).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from cluster.app import compose_app
from cluster.config import ClusterConfig
from tests.support.models import make_tiny_chat_model
from tests.support.serve_harness import cluster_args, deploy, parse_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SHORT = "The capital of France is"  # a handful of tokens: under short_prompt_tokens (64)
LONG = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))  # some 400 tokens


@pytest.fixture(scope="module")
def apps(serve_base: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    model = str(make_tiny_chat_model(tmp_path_factory.mktemp("path-tiny"), seed=7))
    auto = ClusterConfig.from_args(cluster_args(model, router={"prefill_path": "auto"}))
    remote = ClusterConfig.from_args(cluster_args(model))
    assert auto.router.prefill_path == "auto" and remote.router.prefill_path == "remote"
    with deploy(compose_app(auto), "path-auto", serve_base) as a, \
            deploy(compose_app(remote), "path-remote", serve_base) as r:
        yield {"auto": a, "remote": r}


def complete(url: str, prompt: str) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens"]


def counters(url: str) -> tuple[dict[str, float], float]:
    """The decision counts by ``path/reason``, and the KV pulls the router has timed."""
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    decisions = {}
    for key, value in samples.items():
        if key.startswith("pdserve:path_decisions_total{"):
            labels = dict(part.split("=") for part in key[key.index("{") + 1 : -1].split(","))
            decisions[f"{labels['path'].strip(chr(34))}/{labels['reason'].strip(chr(34))}"] = value
    return decisions, samples.get("pdserve:kv_transfer_time_seconds_count", 0.0)


def test_a_short_prompt_is_prefilled_on_the_decode_replica_and_a_long_one_remotely(apps: dict[str, str]) -> None:
    before, pulls0 = counters(apps["auto"])
    short_text, short_n = complete(apps["auto"], SHORT)
    after_short, pulls1 = counters(apps["auto"])
    long_text, long_n = complete(apps["auto"], LONG)
    after_long, pulls2 = counters(apps["auto"])
    assert short_n <= 64 < long_n
    assert after_short.get("local/short", 0) == before.get("local/short", 0) + 1
    assert pulls1 == pulls0  # LOCAL: no KV pulled from a prefill replica
    assert after_long.get("remote/remote_meets", 0) == before.get("remote/remote_meets", 0) + 1
    assert pulls2 == pulls1 + 1
    # the path changes where the prompt is prefilled, never the text
    assert (short_text, short_n) == complete(apps["remote"], SHORT)
    assert (long_text, long_n) == complete(apps["remote"], LONG)
    remote_decisions, _ = counters(apps["remote"])
    assert remote_decisions == {}  # always remote: nothing decided, nothing counted
