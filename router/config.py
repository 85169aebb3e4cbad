"""Configuration of the HTTP router replicas (built by `cluster.config.ClusterConfig`).

Invariants: frozen and picklable (it travels to every router replica); API keys never appear in
its repr; the router loads the tokenizer of ``model`` (prepared by `engine.loading.bundled.prepare_model`)
unless the `router.app.Router` is given a codec factory of its own (tests, tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.loading.bundled import DEFAULT_MODEL
from engine.sampling.choices import MAX_CHOICES
from engine.step_model import PRIOR
from router.objectives import Objectives
from router.path_policy import PathParams

#: ``prefill_path`` values: ``auto`` decides per request (`router.path_choice`), ``remote`` always
#: prefills in the prefill pool (the disaggregated behaviour before the per-request path)
PREFILL_PATHS = ("auto", "remote")


@dataclass(frozen=True)
class RouterConfig:
    served_model_name: str = DEFAULT_MODEL  # the name clients send as "model" (and /v1/models lists)
    model: str = DEFAULT_MODEL  # bundled name, .gguf file or Hugging Face folder: where the tokenizer is
    model_cache_dir: str | None = None
    mode: str = "disaggregated"  # "disaggregated": prefill then decode; "colocated": decode only
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no auth
    public_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")  # reachable without a key
    max_model_len: int | None = None  # None: the model's `ModelConfig.max_context`
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    # cap when a request sets none (None: the model's max_new_tokens, else the rest of the context)
    default_max_tokens: int | None = None
    prefill_timeout_s: float = 120.0  # one prefill call (queueing included); then 503
    token_timeout_s: float = 60.0  # longest wait for the next decode event; then an error event
    ready_timeout_s: float = 5.0  # each pool's ready() call behind /ready
    max_inflight_requests: int | None = None  # generations in flight on this replica; past it 429 (None: no bound)
    migration_limit: int = 3  # times a choice's stream may move off a decode replica that went away (router.migration)
    max_choices: int = MAX_CHOICES  # n per request (the cluster: no more than a decode replica runs at once)
    objectives: Objectives = field(default_factory=Objectives)  # TTFT/TPOT per request class (empty: none)
    prefill_path: str = "auto"  # disaggregated: "auto" (LOCAL or REMOTE per request) or "remote" (always)
    # the path decision's knobs; ``step`` is only the model of a decode replica that has reported no fit
    path_policy: PathParams = field(default_factory=lambda: PathParams(step=PRIOR))

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"router mode must be 'disaggregated' or 'colocated', got {self.mode!r}")
        if self.prefill_path not in PREFILL_PATHS:
            raise ValueError(f"prefill_path must be one of {PREFILL_PATHS}, got {self.prefill_path!r}")
        if self.mode == "colocated" and self.prefill_path != "auto":
            raise ValueError(f"prefill_path={self.prefill_path!r} needs mode 'disaggregated' (colocated, every "
                             "prompt is prefilled on the decode replica)")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.max_inflight_requests is not None and self.max_inflight_requests < 1:
            raise ValueError("max_inflight_requests must be at least 1")
        if not 1 <= self.max_choices <= MAX_CHOICES:
            raise ValueError(f"max_choices must be in 1..{MAX_CHOICES}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        for name in ("prefill_timeout_s", "token_timeout_s", "ready_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
