"""JSON Schemas of the benchmark result files in ``results/`` (checked with `jsonschema` before writing).

Every result file has the same header: ``benchmark`` (its name), ``created`` (UTC ISO time),
``machine`` (`loadtests.machine.machine_info` plus CPU count and load), ``setup`` (what ran, in
words and numbers), ``config`` (the YAML(s) used) and ``results``. Each benchmark documents its
``results`` here; times are milliseconds unless a key says otherwise.

Owners: `INTERFERENCE_SCHEMA` belongs to ``loadtests/bench_interference.py``; the goodput benchmark's
schema is ``loadtests/goodput_schema.py``, built from the pieces here (`result_schema`, `SUMMARY`,
`TARGET`); the engine benchmark keeps its ``ENGINE_SCHEMA`` beside them, the serving benchmark
(``loadtests/bench_serving.py``) its ``SERVING_SCHEMA``.
"""

from __future__ import annotations

from typing import Any


def _num(nullable: bool = False) -> dict[str, Any]:
    return {"type": ["number", "null"]} if nullable else {"type": "number"}


#: `loadtests.bench_common.summarize`: n and nearest-rank percentiles of a list of values.
SUMMARY: dict[str, Any] = {
    "type": "object",
    "required": ["n", "mean", "p50", "p90", "p99", "max"],
    "properties": {"n": {"type": "integer", "minimum": 0},
                   **{k: _num(nullable=True) for k in ("mean", "p50", "p90", "p99", "max")}},
    "additionalProperties": False,
}

_HEADER_PROPS: dict[str, Any] = {
    "benchmark": {"type": "string"},
    "created": {"type": "string", "format": "date-time"},
    "machine": {"type": "object", "required": ["cpu", "cpus"]},
    "setup": {"type": "object", "required": ["description"], "properties": {"description": {"type": "string"}}},
    "config": {
        "type": "object",
        "description": "mode → the Serve YAML it ran: repo-relative path and parsed content",
        "additionalProperties": {"type": "object", "required": ["path", "yaml"],
                                 "properties": {"path": {"type": "string"}, "yaml": {"type": "object"}}},
    },
}


def result_schema(name: str, results: dict[str, Any]) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["benchmark", "created", "machine", "setup", "config", "results"],
        "properties": {**_HEADER_PROPS, "benchmark": {"const": name}, "results": results},
    }


# ---- interference (loadtests/bench_interference.py) ----

_PHASE: dict[str, Any] = {
    "type": "object",
    "description": "one phase of one mode: the chat streams' token gaps, first-token times and TPOT; "
                   "for the mixed phase also the long prompts",
    "required": ["window_s", "chat_itl_ms", "chat_ttft_ms", "chat_tpot_ms", "chat_requests", "chat_tokens_per_s"],
    "properties": {
        "window_s": {"type": "array", "items": _num(), "minItems": 2, "maxItems": 2,
                     "description": "[start, end] seconds since the chat users started"},
        "chat_itl_ms": SUMMARY,  # every gap between two token chunks arriving in the window
        "chat_ttft_ms": SUMMARY,  # chat requests sent in the window
        "chat_tpot_ms": SUMMARY,  # chat requests sent in the window that finished
        "chat_requests": {"type": "integer", "minimum": 0},
        "chat_tokens_per_s": _num(),
        "long_ttft_ms": SUMMARY,
        "long_itl_ms": SUMMARY,
        "long_sent": {"type": "integer", "minimum": 0},
        "long_first_token": {"type": "integer", "minimum": 0},
        "errors": {"type": "integer", "minimum": 0},
    },
}

_TIMELINE: dict[str, Any] = {
    "type": "object",
    "description": "every chat token gap (arrival time s, gap ms) and the long prompts' send / first-token times",
    "required": ["itl_t_s", "itl_ms", "long_sent_s", "long_first_token_s", "mixed_start_s", "end_s"],
    "properties": {
        "itl_t_s": {"type": "array", "items": _num()},
        "itl_ms": {"type": "array", "items": _num()},
        "long_sent_s": {"type": "array", "items": _num()},
        "long_first_token_s": {"type": "array", "items": _num()},
        "chat_only_start_s": _num(),
        "mixed_start_s": _num(),
        "end_s": _num(),
    },
}

_INTERFERENCE_MODE: dict[str, Any] = {
    "type": "object",
    "required": ["phases", "chat_only_p99_itl_ms", "mixed_p99_itl_ms", "timeline"],
    "properties": {
        "phases": {"type": "object", "required": ["chat_only", "mixed"],
                   "properties": {"chat_only": _PHASE, "mixed": _PHASE}, "additionalProperties": False},
        "chat_only_p99_itl_ms": _num(nullable=True),
        "mixed_p99_itl_ms": _num(nullable=True),
        "server_metrics": {"type": "object", "description": "router histograms at the end: count, mean_s"},
        "replica_affinity": {"type": "object", "description": "replica → distinct CPU sets of its threads"},
        "timeline": _TIMELINE,
    },
}

TARGET: dict[str, Any] = {
    "type": "object",
    "required": ["name", "description", "value", "threshold", "met"],
    "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                   "value": _num(nullable=True), "threshold": _num(), "met": {"type": ["boolean", "null"]}},
}

INTERFERENCE_SCHEMA: dict[str, Any] = result_schema("interference", {
    "type": "object",
    "required": ["modes", "targets"],
    "properties": {
        "modes": {"type": "object", "minProperties": 1, "additionalProperties": _INTERFERENCE_MODE,
                  "description": "default | colocated | colocated-chunked | disaggregated → its run"},
        "targets": {"type": "array", "items": TARGET},
    },
})


# ---- engine (loadtests/bench_engine.py) ----

_PROFILE: dict[str, Any] = {
    "type": "object",
    "description": "torch.profiler over a few decode steps: the top ops by self CPU time, per step",
    "required": ["batch", "context", "profiled_step_ms", "top_ops"],
    "properties": {
        "batch": {"type": "integer", "minimum": 1},
        "context": {"type": "integer", "minimum": 1},
        "profiled_step_ms": _num(),
        "top_ops": {"type": "array", "items": {
            "type": "object", "required": ["op", "self_ms_per_step", "calls_per_step", "share"],
            "properties": {"op": {"type": "string"}, "self_ms_per_step": _num(), "calls_per_step": _num(),
                           "share": {"type": "number", "minimum": 0, "maximum": 1}}}},
    },
}

_ENGINE_RUN: dict[str, Any] = {
    "type": "object",
    "description": "one dtype: the engine's prefill and decode, transformers on the same weights, a profile",
    "required": ["dtype", "weight_bytes", "kv_bytes_per_token", "linear_kernels", "decode_attention", "prefill",
                 "decode"],
    "properties": {
        "dtype": {"type": "string"},
        "linear_kernels": {"type": "array", "description": "the kernel each class of linears got "
                           "at load (engine.kernels.kernel_choice), with the timings behind it", "items": {
            "type": "object", "required": ["name", "out_features", "in_features", "count", "format", "ms_per_pass"],
            "properties": {"name": {"type": "string"},
                           "format": {"enum": ["packed", "plain", "upcast", "int8", "native"]},
                           "ms_per_pass": {"type": "object", "description": "format → rows → ms per pass"},
                           "native_max_rows": {"type": "integer", "description": "native: the most rows its C++ "
                                               "kernel takes (more go to the kernel it wraps); else 0"},
                           "wraps": {"type": "string", "description": "native: the format of the kernel it "
                                     "wraps (packed: the plain weight is kept beside it)"}}}},
        "decode_attention": {"type": "object", "description": "the decode attention method timed at "
                             "load (engine.kernels.attention_choice)", "required": ["method", "ms"], "properties": {
            "method": {"enum": ["sdpa", "per_head", "block_diagonal", "compiled", "native"]},
            "small_method": {"enum": ["sdpa", "per_head", "block_diagonal", "compiled", "native", None],
                             "description": "the method of steps of at most split_rows rows, if another"},
            "split_rows": {"type": "integer", "minimum": 0},
            "ms": {"type": "object", "description": "method → 'BxL' → best ms of one call"}}},
        "weight_bytes": {"type": "integer", "minimum": 1, "description": "bytes one forward streams"},
        "kv_bytes_per_token": {"type": "integer", "minimum": 1},
        "prefill": {"type": "array", "items": {
            "type": "object", "required": ["tokens", "seconds", "tokens_per_s", "gflops", "peak_fraction"],
            "properties": {"tokens": {"type": "integer"}, "seconds": _num(), "tokens_per_s": _num(),
                           "gflops": _num(), "peak_fraction": _num()},
            "description": "one prompt from position 0; gflops counts useful FLOPs (see the benchmark's doc)"}},
        "decode": {"type": "array", "items": {
            "type": "object",
            "required": ["batch", "context", "step_ms", "tokens_per_s", "weight_floor_ms", "vs_weight_floor",
                         "vs_weight_floor_best_bw", "weight_kv_floor_ms"],
            "properties": {"batch": {"type": "integer"}, "context": {"type": "integer"}, "step_ms": _num(),
                           "tokens_per_s": _num(), "weight_floor_ms": _num(), "vs_weight_floor": _num(),
                           "vs_weight_floor_best_bw": _num(), "weight_kv_floor_ms": _num(),
                           "matvec_gbs_interleaved": {**_num(), "description": "the matvec probe timed "
                                                      "between this config's steps (loadtests.machine.MatvecProbe)"},
                           "vs_weight_floor_interleaved": {**_num(), "description": "step ÷ (weight bytes ÷ "
                                                           "matvec_gbs_interleaved): the decode target's ratio"}}}},
        "transformers": {"type": "object", "required": ["prefill_s", "decode_step_s"], "properties": {
            "prefill_s": {"type": "object", "additionalProperties": _num(), "description": "tokens → seconds"},
            "decode_step_s": {"type": "object", "additionalProperties": _num(),
                              "description": "'BATCHxCONTEXT' → seconds per step"}}},
        "profile": {"type": "array", "items": _PROFILE},
    },
}

_INT8: dict[str, Any] = {
    "type": "object",
    "description": "weight-only int8 next to the unquantized engine of base_dtype (interleaved timings)",
    "required": ["base_dtype", "weight_bytes", "base_weight_bytes", "decode", "prefill", "accuracy"],
    "properties": {
        "base_dtype": {"type": "string"},
        "weight_bytes": {"type": "integer"}, "base_weight_bytes": {"type": "integer"},
        "decode": {"type": "array", "items": {
            "type": "object", "required": ["batch", "context", "step_ms", "base_step_ms", "tokens_per_s", "vs_base"],
            "properties": {"batch": {"type": "integer"}, "context": {"type": "integer"}, "step_ms": _num(),
                           "base_step_ms": _num(), "tokens_per_s": _num(), "vs_base": _num()}}},
        "prefill": {"type": "array", "items": {"type": "object", "required": ["tokens", "seconds"]}},
        "accuracy": {
            "type": "object",
            "required": ["prompts", "tokens_per_prompt", "greedy_agreement", "free_running_prefix_fraction",
                         "identical_continuations", "text_tokens", "nll_base", "nll_int8", "nll_delta"],
            "properties": {
                "prompts": {"type": "integer"}, "tokens_per_prompt": {"type": "integer"},
                "greedy_agreement": {"type": "number", "minimum": 0, "maximum": 1,
                                     "description": "teacher-forced top-1 agreement on the base's greedy tokens"},
                "fp32_greedy_agreement": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                                          "description": "the same for the fp32 model: plain rounding's share"},
                "free_running_prefix_fraction": {"type": "number", "minimum": 0, "maximum": 1,
                                                 "description": "mean share of each continuation before the "
                                                                "first differing token"},
                "identical_continuations": {"type": "integer", "minimum": 0},
                "text_tokens": {"type": "integer"},
                "nll_base": _num(), "nll_int8": _num(),
                "nll_delta": {"type": "number", "description": "mean NLL per token (nats), int8 − base"},
            },
        },
        "profile": {"type": "array", "items": _PROFILE},
    },
}

ENGINE_SCHEMA: dict[str, Any] = result_schema("engine", {
    "type": "object",
    "required": ["limits", "runs", "targets", "load_avg_1m"],
    "properties": {
        "limits": {"type": "object", "required": ["matmul_fp32_gflops", "matmul_bf16_gflops", "read_gbs",
                                                  "matvec_fp32_gbs", "matvec_bf16_gbs", "matvec_best_gbs"],
                   "additionalProperties": _num(), "description": "loadtests.machine, measured in this run"},
        "runs": {"type": "array", "minItems": 1, "items": _ENGINE_RUN},
        "int8": _INT8,
        "targets": {"type": "array", "items": {**TARGET, "required": [*TARGET["required"], "direction"],
                                               "properties": {**TARGET["properties"],
                                                              "direction": {"enum": ["<=", ">="]}}}},
        "load_avg_1m": {"type": "array", "items": _num(),
                        "description": "1-minute load average before and after each section: other work on the host"},
    },
})


# ---- serving (loadtests/bench_serving.py) ----

_SERVING_LEVEL: dict[str, Any] = {
    "type": "object",
    "required": ["prompt_len", "output_len", "users", "num_requests", "duration_s", "completed", "num_errors",
                 "ttft_ms", "tpot_ms", "itl_ms", "output_tok_s", "tokens_per_chunk"],
    "properties": {
        **{k: {"type": "integer", "minimum": 0} for k in ("prompt_len", "output_len", "users", "num_requests",
                                                          "completed", "num_errors")},
        "duration_s": _num(), "output_tok_s": _num(), "tokens_per_chunk": _num(),
        "ttft_ms": SUMMARY, "tpot_ms": SUMMARY, "itl_ms": SUMMARY,
        "errors": {"type": "array", "items": {"type": "string"}},
        # pdserve only: the engine's own step at (users, prompt + output / 2), and the live server's
        "engine_step_ms": _num(nullable=True), "tpot_over_engine_step": _num(nullable=True),
        "in_server_step_ms": _num(), "in_server_step_cpu_ms": _num(), "in_server_batch": _num(),
        "tpot_over_in_server_step": _num(nullable=True),
    },
}

_SERVER: dict[str, Any] = {
    "type": "object",
    "required": ["kind"],
    "properties": {"kind": {"enum": ["pdserve", "vllm"]}, "skipped": {"type": "string"},
                   "levels": {"type": "array", "items": _SERVING_LEVEL},
                   "engine": {"type": "object", "required": ["dtype", "decode_step_ms", "prefill_1024_ms"]}},
}

SERVING_SCHEMA: dict[str, Any] = result_schema("serving", {
    "type": "object",
    "required": ["servers", "targets"],
    "properties": {"servers": {"type": "object", "additionalProperties": _SERVER},
                   "targets": {"type": "array", "items": TARGET}},
})


# ---- sampler (loadtests/bench_sampler.py) ----

SAMPLER_SCHEMA: dict[str, Any] = result_schema("sampler", {
    "type": "object",
    "required": ["decode_step_ms", "cases", "targets"],
    "properties": {
        "decode_step_ms": _num(),
        "cases": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["ms", "of_step"],
            "properties": {"ms": _num(), "of_step": _num()}, "additionalProperties": False}},
        "targets": {"type": "array", "items": {
            "type": "object", "required": ["name", "value", "threshold", "met"],
            "properties": {"name": {"type": "string"}, "value": _num(), "threshold": _num(),
                           "met": {"type": "boolean"}}}},
    },
})
