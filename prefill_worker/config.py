"""Configuration of one prefill replica (built by `cluster.config.ClusterConfig`).

Each default is stated here once; the cluster's YAML ``prefill`` section takes its defaults from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.loading.bundled import DEFAULT_MODEL
from kv_transfer.config import KVTransferConfig


@dataclass(frozen=True)
class PrefillWorkerConfig:
    model: str = DEFAULT_MODEL  # bundled name, a .gguf file or a Hugging Face folder
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)
    max_batch_tokens: int = 2048  # token budget of one prefill forward
    max_chunk_tokens: int | None = 512  # one prompt's most tokens per forward (short ones pass it); None: budget
    max_queue: int = 256  # waiting requests beyond this are refused (the router answers 429)
    warmup_tokens: int | None = None  # start-up forward of this many tokens; None: max_batch_tokens, 0: none
    model_cache_dir: str | None = None
