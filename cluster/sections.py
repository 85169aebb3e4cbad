"""The YAML schema of a pdserve cluster, one pydantic model per section of a Serve YAML's ``args:``.

Owns: `EngineSection`, the pools' sections (`PrefillSection`, `DecodeSection`, `AffinitySection`),
`RouterSection` (with `PathPolicySection`), `KVSection`, `LimitsSection` and `ObjectivesSection`, with
their per-field checks. Every section is ``extra="forbid"`` (a misspelt key is an error naming it) and
frozen; a field's default is that of the component config it feeds (stated there once).
`cluster.config.ClusterConfig` holds them together, adds the cross-field rules and builds the component
configs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.autoscaling import DecodeAutoscaling, PrefillAutoscaling
from cluster.placement import AutoscalingSection, DrainSection, PlacementSection
from decode_worker.config import DecodeWorkerConfig
from engine.config import AUTO_DTYPE, EngineConfig, parse_dtype
from engine.kv_budget import check_budget
from engine.step_model import PRIOR
from kv_transfer.config import KVTransferConfig, Transport
from prefill_worker.config import PrefillWorkerConfig
from router.config import RouterConfig
from router.objectives import Objectives, SLOClass
from router.path_policy import PathParams
from router.policy import known_policy


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _known_budget(v: int | float | None) -> int | float | None:
    if v is not None:
        check_budget(v)  # raises ValueError naming the value and the two accepted forms
    return v


def _known_dtype(v: str | None) -> str | None:
    if v is not None and v != AUTO_DTYPE:
        parse_dtype(v)  # raises ValueError naming the accepted names
    return v


class EngineSection(_Section):
    device: str = EngineConfig.device  # "cpu" | "cuda" | "cuda:N"
    # bf16 where the device computes in it, else fp32 (`engine.config.fast_dtype`); a bare
    # EngineConfig keeps fp32, the reference
    dtype: str = AUTO_DTYPE
    # int8: weight-only int8 linear layers in both pools
    quantization: Literal["int8"] | None = EngineConfig.quantization  # type: ignore[assignment]
    block_size: int = Field(default=EngineConfig.block_size, ge=1, le=1024)
    num_threads: int | None = Field(default=EngineConfig.num_threads, ge=1)  # torch threads per worker replica
    enable_prefix_cache: bool = EngineConfig.enable_prefix_cache
    # attention backend (`engine.attention.registry`): auto = cpu on a CPU, torch on a GPU
    backend: Literal["auto", "reference", "cpu", "torch"] = "auto"
    cuda_graphs: bool = EngineConfig.cuda_graphs  # the torch backend's decode steps as CUDA graphs (CUDA only)
    # the cpu backend's decode attention method (`engine.kernels.attention_choice`): auto = timed at load
    decode_attention: Literal["auto", "sdpa", "per_head", "block_diagonal", "compiled", "native"] = "auto"
    # the KV cache's memory (`engine.kv_budget`): bytes (an int), or a float in (0, 1]: the engine's share of
    # the device's total memory, weights and peak step included; unset: 0.9 on CUDA, none on a CPU
    kv_cache_memory: int | float | None = EngineConfig.kv_cache_memory

    _known_dtype = field_validator("dtype")(_known_dtype)
    _known_budget = field_validator("kv_cache_memory")(_known_budget)

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if v != "cpu" and v != "cuda" and not v.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {v!r}")
        return v

    @model_validator(mode="after")
    def _attention_for_cpu(self) -> EngineSection:
        cpu = self.backend == "cpu" or (self.backend == "auto" and self.device == "cpu")
        if self.decode_attention != "auto" and not cpu:
            raise ValueError(f"decode_attention={self.decode_attention!r} is the cpu backend's choice; "
                             f"backend {self.backend!r} on {self.device!r} does not use it")
        return self


class _Pool(_Section):
    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=0.5, ge=0)
    num_gpus: float = Field(default=0, ge=0)
    # worker queue bound; past it the router answers 429 (a pool's section takes its worker's default)
    max_queue: int = Field(default=DecodeWorkerConfig.max_queue, ge=1)
    max_ongoing_requests: int = Field(default=1024, ge=1)  # Serve's per-replica bound (above max_queue)
    # KV blocks per replica; unset: sized from kv_cache_memory (on a CPU without one: the pool's default count)
    num_blocks: int | None = Field(default=EngineConfig.num_blocks, ge=1)
    kv_cache_memory: int | float | None = None  # overrides engine.kv_cache_memory for this pool
    max_num_seqs: int = Field(default=EngineConfig.max_num_seqs, ge=1)
    num_threads: int | None = Field(default=None, ge=1)  # overrides engine.num_threads for this pool
    dtype: str | None = None  # overrides engine.dtype for this pool (the KV dtype: the pools must agree)
    cpu_affinity: list[int] | None = Field(default=None, min_length=1)  # pin this pool's replicas to these cores
    placement: PlacementSection = PlacementSection()  # which nodes (cluster/placement.py)
    autoscaling: AutoscalingSection | None = None  # instead of num_replicas
    drain: DrainSection = DrainSection()  # Serve's graceful shutdown

    _known_dtype = field_validator("dtype")(_known_dtype)
    _known_budget = field_validator("kv_cache_memory")(_known_budget)


class AffinitySection(_Section):
    max_prefix_blocks: int = Field(default=4, ge=1)
    imbalance_ratio: float = Field(default=2.0, ge=1.0)
    imbalance_tokens: int = Field(default=2048, ge=0)


class PrefillSection(_Pool):
    max_queue: int = Field(default=PrefillWorkerConfig.max_queue, ge=1)
    max_batch_tokens: int = Field(default=PrefillWorkerConfig.max_batch_tokens, ge=1)
    # one prompt's most tokens per forward; None: the budget
    max_chunk_tokens: int | None = Field(default=PrefillWorkerConfig.max_chunk_tokens, ge=1)
    # start-up forward; None: max_batch_tokens, 0: none
    warmup_tokens: int | None = Field(default=PrefillWorkerConfig.warmup_tokens, ge=0)
    # a prefill replica's blocks are held only until pulled: PREFILL_CPU_BLOCKS where no budget sizes them
    num_blocks: int | None = Field(default=None, ge=1)
    policy: str = "prefix_affinity"  # a name in router.policy.POLICIES
    affinity: AffinitySection = AffinitySection()
    autoscaling: PrefillAutoscaling | None = None  # instead of num_replicas; may scale on queue wait

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        return known_policy(v)


class DecodeSection(_Pool):
    # colocated only: 0 = whole prompt at once
    prefill_chunk_size: int = Field(default=DecodeWorkerConfig.prefill_chunk_size, ge=0)
    # tokens per streamed event after the first
    stream_interval: int = Field(default=DecodeWorkerConfig.stream_interval, ge=1, le=64)
    watermark_blocks: int = Field(default=DecodeWorkerConfig.watermark_blocks, ge=0)
    max_swap_blocks: int = Field(default=DecodeWorkerConfig.max_swap_blocks, ge=0)
    # colocated replicas prefill, so a shared prefix pays there; disaggregated decode replicas do not
    policy: str | None = None  # a name in router.policy.POLICIES; None: by mode (`decode_policy`)
    affinity: AffinitySection = AffinitySection()
    autoscaling: DecodeAutoscaling | None = None  # instead of num_replicas; may scale on KV use

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str | None) -> str | None:
        return v if v is None else known_policy(v)


class PathPolicySection(_Section):
    """The path decision's knobs (`router.path_policy.PathParams`, which states what each does)."""

    short_prompt_tokens: int = Field(default=PathParams.short_prompt_tokens, ge=0)
    min_cached_fraction: float = Field(default=PathParams.min_cached_fraction, gt=0, le=1)
    tpot_safety: float = Field(default=PathParams.tpot_safety, gt=0, le=1)
    # the most prompt tokens one decode step prefills (the decode replica's local chunk cap)
    max_chunk_tokens: int = Field(default=PathParams.max_chunk_tokens, ge=1)

    def build(self) -> PathParams:
        return PathParams(step=PRIOR, max_chunk_tokens=self.max_chunk_tokens,
                          short_prompt_tokens=self.short_prompt_tokens,
                          min_cached_fraction=self.min_cached_fraction, tpot_safety=self.tpot_safety)


class RouterSection(_Section):
    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=0.1, ge=0)
    max_ongoing_requests: int = Field(default=1000, ge=1)
    api_keys: list[str] = Field(default_factory=list, repr=False)
    public_paths: list[str] = Field(default_factory=lambda: list(RouterConfig.public_paths))
    routing_stats_period_s: float = Field(default=1.0, gt=0)
    placement: PlacementSection = PlacementSection()
    autoscaling: AutoscalingSection | None = None
    drain: DrainSection = DrainSection()
    # disaggregated: "auto" prefills each request where `router.path_choice` decides (LOCAL on the decode
    # replica, or REMOTE), "remote" always in the prefill pool; colocated: "auto" only
    prefill_path: Literal["auto", "remote"] = "auto"
    path_policy: PathPolicySection = PathPolicySection()

    @field_validator("api_keys")
    @classmethod
    def _non_empty_keys(cls, v: list[str]) -> list[str]:
        if any(not k.strip() for k in v):
            raise ValueError("API keys must be non-empty strings")
        return v


class KVSection(_Section):
    transport: Transport = KVTransferConfig.transport
    host: str | None = KVTransferConfig.host
    port: int = Field(default=KVTransferConfig.port, ge=0, lt=65536)
    secret: str | None = Field(default=None, repr=False)  # None: PDSERVE_KV_SECRET, else a random one
    lease_s: float = Field(default=KVTransferConfig.lease_s, gt=0)
    timeout_s: float = Field(default=KVTransferConfig.timeout_s, gt=0)
    max_inflight_bytes: int = Field(default=KVTransferConfig.max_inflight_bytes, gt=0)  # transfers' staging


class LimitsSection(_Section):
    max_model_len: int | None = Field(default=RouterConfig.max_model_len, ge=2)
    max_body_bytes: int = Field(default=RouterConfig.max_body_bytes, ge=1024)
    default_max_tokens: int | None = Field(default=RouterConfig.default_max_tokens, ge=1)
    prefill_timeout_s: float = Field(default=RouterConfig.prefill_timeout_s, gt=0)
    token_timeout_s: float = Field(default=RouterConfig.token_timeout_s, gt=0)  # the router's and decode's
    ready_timeout_s: float = Field(default=RouterConfig.ready_timeout_s, gt=0)
    # times a request may move off a decode replica that died or hung mid-stream (0: never; then it fails)
    migration_limit: int = Field(default=RouterConfig.migration_limit, ge=0)
    # generations in flight per router replica, past it 429; None: what the decode pool holds
    max_inflight_requests: int | None = Field(default=None, ge=1)




class ObjectiveClassSection(_Section):
    """One request class (`router.objectives.SLOClass`, which states the rules)."""

    name: str = Field(min_length=1)
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # None: the catch-all length class
    named_only: bool = False  # chosen only when a request names it


class ObjectivesSection(_Section):
    # empty: no objectives (nothing is judged, every request takes the configured path)
    classes: list[ObjectiveClassSection] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> ObjectivesSection:
        self.build()  # raises ValueError naming the clash (duplicate names, no catch-all, ...)
        return self

    def build(self) -> Objectives:
        return Objectives(tuple(SLOClass(name=c.name, ttft_s=c.ttft_s, tpot_s=c.tpot_s,
                                         max_prompt_tokens=c.max_prompt_tokens, named_only=c.named_only)
                                for c in self.classes))
