"""The three apps the tool-calling and Responses e2e modules run on one Serve cluster.

Owns: `tiny_tool_model` (a tiny random Llama with SmolLM2's tokenizer under Qwen2.5's chat template,
which renders tools and tool messages) and `tool_apps` (deployed under ``/fake``: the real router
over the deterministic fake pools with a tokenizer whose template renders tools; ``/tiny-pd`` and
``/tiny-colo``: that tiny model with real prefill / decode replicas, disaggregated and colocated).
Every app is deleted when the context ends, so a module sees only its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ray import serve

from cluster.app import compose_app
from cluster.config import ClusterConfig
from router.app import Router
from router.config import RouterConfig
from tests.support.models import make_tiny_chat_model
from tests.support.pd_fakes import FakeConfig, FakeDecode, FakePrefill, fake_tool_codec
from tests.support.serve_harness import cluster_args, deploy
from tests.support.tool_templates import QWEN2_5, set_chat_template


def tiny_tool_model(path: Path) -> Path:
    return set_chat_template(make_tiny_chat_model(path, seed=3), QWEN2_5)


@contextmanager
def tool_apps(serve_base: str, tiny: Path) -> Iterator[dict[str, str]]:
    """``{"fake" | "tiny-pd" | "tiny-colo": its base URL}``, deployed on ``serve_base``'s cluster."""
    fake_cfg = FakeConfig()
    fake = Router.options(name="router").bind(
        serve.deployment(FakePrefill).options(name="prefill", ray_actor_options={"num_cpus": 0.05}).bind(fake_cfg),
        serve.deployment(FakeDecode).options(name="decode", ray_actor_options={"num_cpus": 0.05}).bind(fake_cfg),
        RouterConfig(served_model_name="tiny", model="unused", max_model_len=4096, prefill_path="remote"),
        fake_tool_codec)  # remote: the fakes' prefill is what these apps exercise
    with deploy(fake, "fake", serve_base) as fake_url, \
            deploy(compose_app(ClusterConfig.from_args(cluster_args(str(tiny)))), "tiny-pd", serve_base) as pd_url, \
            deploy(compose_app(ClusterConfig.from_args(cluster_args(str(tiny), mode="colocated"))),
                   "tiny-colo", serve_base) as colo_url:
        yield {"fake": fake_url, "tiny-pd": pd_url, "tiny-colo": colo_url}
