"""JSON Schemas of the benchmark result files in ``results/`` (checked with `jsonschema` before writing).

Every result file has the same header: ``benchmark`` (its name), ``created`` (UTC ISO time),
``machine`` (`loadtests.machine.machine_info` plus CPU count and load), ``setup`` (what ran, in
words and numbers), ``config`` (the YAML(s) used) and ``results``. Each benchmark documents its
``results`` here; times are milliseconds unless a key says otherwise.

Owners: `INTERFERENCE_SCHEMA` and `GOODPUT_SCHEMA` belong to ``loadtests/bench_interference.py`` and
``loadtests/bench_goodput.py``; the engine benchmark keeps its ``ENGINE_SCHEMA`` beside them.
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


def _doc(name: str, results: dict[str, Any]) -> dict[str, Any]:
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

_TARGET: dict[str, Any] = {
    "type": "object",
    "required": ["name", "description", "value", "threshold", "met"],
    "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                   "value": _num(nullable=True), "threshold": _num(), "met": {"type": ["boolean", "null"]}},
}

INTERFERENCE_SCHEMA: dict[str, Any] = _doc("interference", {
    "type": "object",
    "required": ["modes", "targets"],
    "properties": {
        "modes": {"type": "object", "minProperties": 1, "additionalProperties": _INTERFERENCE_MODE,
                  "description": "colocated | colocated-chunked | disaggregated → its run"},
        "targets": {"type": "array", "items": _TARGET},
    },
})


# ---- goodput (loadtests/bench_goodput.py) ----

_SAMPLE: dict[str, Any] = {
    "type": "array",
    "description": "one request: [kind, sent s since the rate's start, TTFT ms or null, TPOT ms or null, finished]",
    "prefixItems": [{"enum": ["chat", "long"]}, _num(), _num(nullable=True), _num(nullable=True),
                    {"type": "boolean"}],
    "minItems": 5,
    "maxItems": 5,
}

_RATE_POINT: dict[str, Any] = {
    "type": "object",
    "required": ["rate_rps", "window_s", "sent", "finished", "attainment_ttft", "attainment_tpot",
                 "attainment", "goodput_rps", "throughput_rps", "ttft_ms", "tpot_ms", "samples"],
    "properties": {
        "rate_rps": _num(),
        "window_s": _num(),
        "sent": {"type": "integer", "minimum": 0},
        "finished": {"type": "integer", "minimum": 0},
        "attainment_ttft": _num(), "attainment_tpot": _num(),
        "attainment": {"type": "number", "minimum": 0, "maximum": 1, "description": "both SLOs, of all sent"},
        "goodput_rps": _num(),
        "throughput_rps": _num(),
        "ttft_ms": {"type": "object", "additionalProperties": SUMMARY, "description": "kind → summary"},
        "tpot_ms": {"type": "object", "additionalProperties": SUMMARY},
        "samples": {"type": "array", "items": _SAMPLE},
    },
}

_GOODPUT_MODE: dict[str, Any] = {
    "type": "object",
    "required": ["baseline", "rates"],
    "properties": {
        "baseline": {"type": "object", "description": "unloaded, one request at a time: ttft_ms per kind, tpot_ms",
                     "required": ["chat_ttft_ms", "chat_tpot_ms", "long_ttft_ms"],
                     "properties": {k: _num(nullable=True) for k in ("chat_ttft_ms", "chat_tpot_ms",
                                                                     "long_ttft_ms")}},
        "rates": {"type": "array", "items": _RATE_POINT},
        "server_metrics": {"type": "object"},
    },
}

GOODPUT_SCHEMA: dict[str, Any] = _doc("goodput", {
    "type": "object",
    "required": ["slo", "modes"],
    "properties": {
        "slo": {
            "type": "object",
            "required": ["ttft_ms", "tpot_ms", "reason"],
            "properties": {
                "ttft_ms": {"type": "object", "required": ["chat", "long"],
                            "additionalProperties": _num(), "description": "TTFT target per request kind"},
                "tpot_ms": _num(),
                "reason": {"type": "string"},
            },
        },
        "modes": {"type": "object", "minProperties": 1, "additionalProperties": _GOODPUT_MODE},
    },
})
