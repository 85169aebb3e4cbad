"""Configuration of one decode replica (built by `cluster.config.ClusterConfig`).

Each default is stated once: here, or in the component it configures (`SchedulerConfig`); the
cluster's YAML sections take theirs from these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.scheduler import SchedulerConfig
from engine.config import EngineConfig
from engine.loading.bundled import DEFAULT_MODEL
from engine.step_model import TPOT_SAFETY
from kv_transfer.config import KVTransferConfig


@dataclass(frozen=True)
class DecodeWorkerConfig:
    model: str = DEFAULT_MODEL
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    mode: str = "disaggregated"  # "disaggregated" | "colocated"
    # prompt tokens a step prefills here, over all prompts (colocated, or LOCAL requests of a
    # disaggregated cluster): 0 = every prompt whole
    prefill_chunk_size: int = 0
    # disaggregated: requests without a KV handle (the router's LOCAL path, `router.prefill_path: auto`)
    # are prefilled here, between decode steps; off, they are refused
    local_prefill: bool = False
    # disaggregated: a step's LOCAL prefill tokens keep the step within this share of the tightest running
    # TPOT objective (`engine.step_model.step_token_budget`; ``prefill_chunk_size`` is the cap)
    tpot_safety: float = TPOT_SAFETY
    watermark_blocks: int = SchedulerConfig.watermark_blocks
    max_swap_blocks: int = SchedulerConfig.max_swap_blocks
    max_queue: int = 256  # waiting requests beyond this are refused (the router answers 429)
    token_timeout_s: float = 60.0  # a stream with no token for this long ends with an error
    # tokens per streamed event after a stream's first (its last may hold fewer): as vLLM's
    # --stream-interval, fewer Ray items and SSE chunks per token at the cost of burstier arrivals
    stream_interval: int = 1
    model_cache_dir: str | None = None
    # disaggregated: the Serve deployment of the prefill pool whose KV sources this replica meets at
    # start-up and on every change of the pool (None: each source is met at the first handle naming it)
    prefill_deployment: str | None = None
