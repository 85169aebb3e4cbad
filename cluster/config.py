"""`ClusterConfig`: the whole cluster's settings, read from a Serve YAML's ``args:`` (and nowhere else).

Owns: the YAML schema's top level (its sections are `cluster.sections`'; pydantic, ``extra="forbid"``:
a misspelt key is an error naming the key and what is allowed), the cross-field rules, the
environment variables (read here, once, through `Environment.read`), and the per-component configs
built from it: `PrefillWorkerConfig`,
`DecodeWorkerConfig`, `RouterConfig`. A section's defaults are those of the config it builds
(stated there once); what the cluster chooses otherwise (``dtype: auto``, the prefill pool's
``num_blocks`` on a CPU, each pool's largest step and the transfers' staging memory for the KV
budget, the KV secret) is stated here.

Invariants: a `ClusterConfig` that constructed is consistent — nccl means every worker asks for a
GPU and runs on cuda; cuda means GPUs are asked for; colocated mode has no prefill pool (its
section is ignored); disaggregated pools have one KV dtype (a pool's ``dtype``, else ``engine.dtype``;
``auto`` for the device and the checkpoint). The KV secret is the configured one, else
``PDSERVE_KV_SECRET``, else drawn once per config (shared by the app's replicas); `redacted` hides it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ValidationError, model_validator

from cluster.placement import (
    Demand,
    check_scaling,
    demand,
    max_replicas,
)
from cluster.sections import (
    AffinitySection,
    DecodeSection,
    EngineSection,
    KVSection,
    LimitsSection,
    ObjectivesSection,
    PrefillSection,
    RouterSection,
    _Pool,
    _Section,
)
from cluster.serve_yaml import ConfigError, application_args
from decode_worker.config import DecodeWorkerConfig
from engine.config import AUTO_DTYPE, EngineConfig, auto_dtype, parse_dtype
from engine.loading.bundled import DEFAULT_MODEL, stored_dtype
from engine.loading.hub import is_hub_id
from kv_transfer.config import KVTransferConfig
from prefill_worker.config import PrefillWorkerConfig
from router.config import RouterConfig
from router.policy import AffinityParams

#: a CPU prefill replica's KV blocks where neither num_blocks nor a budget is set: they wait only to be pulled
PREFILL_DEPLOYMENT = "prefill"  # the prefill pool's Serve deployment (decode replicas find its KV sources by it)
PREFILL_CPU_BLOCKS = 512


@dataclass(frozen=True)
class Environment:
    """The environment variables pdserve honours (read once, in `Environment.read`)."""

    api_keys: tuple[str, ...] = ()  # PDSERVE_API_KEYS: comma-separated, added to the configured keys
    kv_secret: str | None = None  # PDSERVE_KV_SECRET: used when the config sets none
    model_cache: str | None = None  # PDSERVE_MODEL_CACHE: where prepared models live

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        env = os.environ if environ is None else environ
        keys = tuple(k.strip() for k in env.get("PDSERVE_API_KEYS", "").split(",") if k.strip())
        return cls(api_keys=keys, kv_secret=env.get("PDSERVE_KV_SECRET") or None,
                   model_cache=env.get("PDSERVE_MODEL_CACHE") or None)


class ClusterConfig(_Section):
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # default: the model's name
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    model_cache_dir: str | None = None
    engine: EngineSection = EngineSection()
    prefill: PrefillSection = PrefillSection()
    decode: DecodeSection = DecodeSection()
    router: RouterSection = RouterSection()
    kv: KVSection = KVSection()
    limits: LimitsSection = LimitsSection()
    objectives: ObjectivesSection = ObjectivesSection()

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        for name, section in self.deployments(every=True):
            check_scaling(name, section, "num_replicas" in section.model_fields_set)
        pools = [("decode", self.decode)] + ([("prefill", self.prefill)] if self.disaggregated else [])
        cuda = self.engine.device.startswith("cuda")
        if self.disaggregated and self.kv.transport == "nccl" and not cuda:
            raise ValueError("kv.transport='nccl' needs engine.device='cuda'")
        for name, pool in pools:
            if cuda and pool.num_gpus <= 0:
                raise ValueError(f"engine.device={self.engine.device!r} needs {name}.num_gpus > 0")
            if self.disaggregated and self.kv.transport == "nccl" and pool.num_gpus <= 0:
                raise ValueError(f"kv.transport='nccl' needs {name}.num_gpus > 0 (NCCL moves GPU memory)")
        if self.disaggregated and self.decode.prefill_chunk_size:
            raise ValueError("decode.prefill_chunk_size applies to mode='colocated' only (disaggregated, a "
                             "decode step's local prefill is capped by router.path_policy.max_chunk_tokens)")
        if not self.disaggregated and self.router.prefill_path != "auto":
            raise ValueError(f"router.prefill_path={self.router.prefill_path!r} needs mode='disaggregated' "
                             "(colocated, every prompt is prefilled on the decode replica)")
        if not self.local_prefill and "path_policy" in self.router.model_fields_set:
            raise ValueError("router.path_policy applies to mode='disaggregated' with router.prefill_path='auto' "
                             "only (nothing decides a path otherwise)")
        if self.disaggregated and self._kv_dtype(self.prefill) != self._kv_dtype(self.decode):
            raise ValueError(
                f"{self._dtype_source('prefill', self.prefill)} and {self._dtype_source('decode', self.decode)} "
                f"give the pools different KV dtypes ({_name(self._kv_dtype(self.prefill))} and "
                f"{_name(self._kv_dtype(self.decode))}); the decode pool takes the prefill pool's KV cache as "
                f"it is, so in mode 'disaggregated' they must agree")
        return self

    @property
    def local_prefill(self) -> bool:
        """Disaggregated with the per-request path: decode replicas prefill the LOCAL requests."""
        return self.disaggregated and self.router.prefill_path == "auto"

    def _pool_dtype(self, pool: _Pool) -> str:
        return pool.dtype or self.engine.dtype

    def _kv_dtype(self, pool: _Pool) -> torch.dtype:
        """The pool's KV cache dtype: its compute dtype (``auto`` resolved as replicas get it)."""
        return parse_dtype(self._resolved_dtype(pool))

    def _resolved_dtype(self, pool: _Pool) -> str:
        """The pool's dtype, ``auto`` resolved for the device and the checkpoint's stored dtype where
        the model's ``config.json`` is at hand (`engine.config.auto_dtype`): once, here, so every
        replica of the app computes in the same dtype whatever node it lands on."""
        dtype = self._pool_dtype(pool)
        return auto_dtype(self.engine.device, stored_dtype(self.model)) if dtype == AUTO_DTYPE else dtype

    def _dtype_source(self, name: str, pool: _Pool) -> str:
        field = f"{name}.dtype" if pool.dtype is not None else f"engine.dtype (for {name})"
        return f"{field}={self._pool_dtype(pool)!r}"

    # ---- construction ----
    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None, env: Environment | None = None,
                  source: str = "args") -> ClusterConfig:
        """Validate a YAML ``args:`` mapping; environment values fill what it leaves unset."""
        environment = env if env is not None else Environment.read()
        try:
            cfg = cls.model_validate(dict(args or {}))
        except ValidationError as e:
            raise ConfigError(format_errors(e, source)) from None
        updates: dict[str, Any] = {}
        if cfg.model_cache_dir is None and environment.model_cache:
            updates["model_cache_dir"] = environment.model_cache
        if environment.api_keys:
            keys = list(dict.fromkeys([*cfg.router.api_keys, *environment.api_keys]))
            updates["router"] = cfg.router.model_copy(update={"api_keys": keys})
        if cfg.kv.secret is None:
            secret = environment.kv_secret or secrets.token_hex(32)
            updates["kv"] = cfg.kv.model_copy(update={"secret": secret})
        return cfg.model_copy(update=updates)

    @classmethod
    def from_yaml(cls, path: str | Path, env: Environment | None = None) -> ClusterConfig:
        return cls.from_args(application_args(path), env, source=str(path))

    # ---- derived ----
    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    @property
    def name(self) -> str:
        """The served name: as configured, else a hub id whole (as vLLM serves it), else the file's stem."""
        if self.served_model_name:
            return self.served_model_name
        if is_hub_id(self.model) and not Path(self.model).expanduser().exists():
            return self.model
        return Path(self.model).name.removesuffix(".gguf")

    def _engine(self, pool: _Pool, max_step_tokens: int | None, cpu_blocks: int | None = None) -> EngineConfig:
        """A pool's engine. Its KV cache: ``num_blocks`` as set; else sized from the pool's or the
        engine's ``kv_cache_memory`` (CUDA's default budget where neither is set); on a CPU with no
        budget, ``cpu_blocks`` (None: the engine's default count). The budget holds back the KV
        transfers' staging memory (``kv.max_inflight_bytes``, disaggregated only). ``max_step_tokens``:
        the pool's largest forward, whose peak the engine profiles before sizing the cache."""
        e = self.engine
        budget = pool.kv_cache_memory if pool.kv_cache_memory is not None else e.kv_cache_memory
        num_blocks = pool.num_blocks
        if num_blocks is None and budget is None and not e.device.startswith("cuda"):
            num_blocks = cpu_blocks
        return EngineConfig(device=e.device, dtype=self._resolved_dtype(pool), quantization=e.quantization,
                            block_size=e.block_size, num_blocks=num_blocks, kv_cache_memory=budget,
                            reserved_memory=self.kv.max_inflight_bytes if self.disaggregated else 0,
                            max_step_tokens=max_step_tokens,
                            max_num_seqs=pool.max_num_seqs, max_model_len=self.limits.max_model_len,
                            enable_prefix_cache=e.enable_prefix_cache, backend=e.backend,
                            cuda_graphs=e.cuda_graphs, decode_attention=e.decode_attention,
                            num_threads=pool.num_threads or e.num_threads,
                            cpu_affinity=tuple(pool.cpu_affinity or ()))

    def _kv(self) -> KVTransferConfig:
        k = self.kv
        return KVTransferConfig(transport=k.transport, host=k.host, port=k.port, secret=k.secret or "",
                                lease_s=k.lease_s, timeout_s=k.timeout_s, max_inflight_bytes=k.max_inflight_bytes)

    def prefill_worker_config(self) -> PrefillWorkerConfig:
        p = self.prefill
        return PrefillWorkerConfig(model=self.model, engine=self._engine(p, p.max_batch_tokens, PREFILL_CPU_BLOCKS),
                                   kv=self._kv(),
                                   max_batch_tokens=p.max_batch_tokens, max_queue=p.max_queue,
                                   max_chunk_tokens=p.max_chunk_tokens, warmup_tokens=p.warmup_tokens,
                                   model_cache_dir=self.model_cache_dir)

    def decode_worker_config(self) -> DecodeWorkerConfig:
        d = self.decode
        # a disaggregated decode step runs one row per sequence, plus a LOCAL prompt chunk with the
        # per-request path; colocated, a prompt (chunk) too (None: a whole one)
        chunk = self.router.path_policy.max_chunk_tokens if self.local_prefill else d.prefill_chunk_size
        if self.disaggregated:
            step: int | None = d.max_num_seqs + (chunk if self.local_prefill else 0)
        else:
            step = max(d.max_num_seqs, d.prefill_chunk_size) if d.prefill_chunk_size else None
        return DecodeWorkerConfig(model=self.model, engine=self._engine(d, step), kv=self._kv(), mode=self.mode,
                                  prefill_chunk_size=chunk, local_prefill=self.local_prefill,
                                  tpot_safety=self.router.path_policy.tpot_safety,
                                  stream_interval=d.stream_interval,
                                  watermark_blocks=d.watermark_blocks, max_swap_blocks=d.max_swap_blocks,
                                  max_queue=d.max_queue, token_timeout_s=self.limits.token_timeout_s,
                                  model_cache_dir=self.model_cache_dir,
                                  prefill_deployment=PREFILL_DEPLOYMENT if self.disaggregated else None)

    def router_config(self) -> RouterConfig:
        lim = self.limits
        return RouterConfig(served_model_name=self.name, model=self.model, model_cache_dir=self.model_cache_dir,
                            mode=self.mode, api_keys=tuple(self.router.api_keys),
                            public_paths=tuple(self.router.public_paths), max_model_len=lim.max_model_len,
                            max_body_bytes=lim.max_body_bytes, default_max_tokens=lim.default_max_tokens,
                            prefill_timeout_s=lim.prefill_timeout_s, token_timeout_s=lim.token_timeout_s,
                            ready_timeout_s=lim.ready_timeout_s, migration_limit=lim.migration_limit,
                            max_choices=min(RouterConfig.max_choices,
                                                                                 self.decode.max_num_seqs),
                            max_inflight_requests=lim.max_inflight_requests or self.decode_capacity_per_router(),
                            objectives=self.objectives.build(), prefill_path=self.router.prefill_path,
                            path_policy=self.router.path_policy.build())

    def decode_capacity_per_router(self) -> int:
        """Requests the decode pool holds (running + queued, at its most replicas), per router replica.

        Past this a request would get token 0 from the prefill pool and then be refused by a full
        decode queue mid-stream; the router refuses it up front instead (`router.admission`).
        """
        d, r = self.decode, self.router
        decoders = max_replicas(d)
        routers = r.autoscaling.min_replicas if r.autoscaling is not None else r.num_replicas
        return max(1, decoders * (d.max_num_seqs + d.max_queue) // routers)

    def decode_policy(self) -> str:
        if self.decode.policy is not None:
            return self.decode.policy
        return "least_outstanding_tokens" if self.disaggregated else "prefix_affinity"

    def affinity(self, section: AffinitySection) -> AffinityParams:
        return AffinityParams(block_size=self.engine.block_size, max_prefix_blocks=section.max_prefix_blocks,
                              imbalance_ratio=section.imbalance_ratio, imbalance_tokens=section.imbalance_tokens)

    def deployments(self, every: bool = False) -> list[tuple[str, RouterSection | _Pool]]:
        """The deployments this config runs, by name (``every``: the prefill section in colocated mode too)."""
        out: list[tuple[str, RouterSection | _Pool]] = [("router", self.router), ("decode", self.decode)]
        if self.disaggregated or every:
            out.insert(1, ("prefill", self.prefill))
        return out

    def demands(self) -> list[Demand]:
        """What the deployments need at their maximum replica counts (`cluster.placement.pack`)."""
        return [demand(name, s, s.num_gpus if isinstance(s, _Pool) else 0.0) for name, s in self.deployments()]

    def total_cpus(self) -> float:
        """CPUs every replica together asks Ray for (for sizing a local cluster)."""
        total = self.router.num_replicas * self.router.num_cpus
        total += self.decode.num_replicas * self.decode.num_cpus
        if self.disaggregated:
            total += self.prefill.num_replicas * self.prefill.num_cpus
        return total

    def redacted(self) -> dict[str, Any]:
        """The effective config as plain data, secrets masked (for printing)."""
        data = self.model_dump(mode="json")
        data["router"]["api_keys"] = ["***"] * len(self.router.api_keys)
        if data["kv"].get("secret"):
            data["kv"]["secret"] = "***"
        data["served_model_name"] = self.name
        if not self.disaggregated:
            data.pop("prefill")
        return data


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_errors(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid pdserve config ({e.error_count()} problem{'s' * (e.error_count() > 1)}):"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {loc}: unknown key{_allowed(err['loc'])}")
        else:
            lines.append(f"  - {loc}: {msg}" if loc else f"  - {msg}")
    return "\n".join(lines)


def _allowed(loc: tuple[int | str, ...]) -> str:
    model: Any = ClusterConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return ""
        model = field.annotation
    return f" (allowed: {', '.join(model.model_fields)})"
