"""JSON Schema of ``results/goodput.json`` (`make bench-goodput`), checked before the file is written.

Owns `GOODPUT_SCHEMA`: the common header (`loadtests.schemas.result_schema`) and the goodput results:
the objectives and where they came from, the lone baseline (None when the objectives were given),
per server its kind, the rates it ran (attainment overall and per class, TTFT / TPOT / ITL summaries,
pdserve's path decisions and its router's own judgement per rate, every request as a sample) and
its knee, or the reason it was skipped; and issue #33's targets. Times are milliseconds, rates
requests/s, attainment a share of the requests sent in the rate's window.
"""

from __future__ import annotations

from typing import Any

from loadtests.schemas import SUMMARY, TARGET, result_schema


def _num(nullable: bool = False) -> dict[str, Any]:
    return {"type": ["number", "null"]} if nullable else {"type": "number"}


_COUNT = {"type": "integer", "minimum": 0}
_SHARE = {"type": "number", "minimum": 0, "maximum": 1}
_LATENCY = {"ttft_ms": SUMMARY, "tpot_ms": SUMMARY, "itl_ms": SUMMARY}
_COUNTS: dict[str, Any] = {"type": ["object", "null"], "additionalProperties": _num(),
                           "description": "label values joined by '/' → count in this rate; null: not pdserve, "
                                          "or /metrics did not answer"}

_SAMPLE: dict[str, Any] = {
    "type": "array",
    "description": "one request: [kind, sent s since the rate's start, TTFT ms or null, TPOT ms or null, finished]",
    "prefixItems": [{"enum": ["chat", "long"]}, _num(), _num(nullable=True), _num(nullable=True),
                    {"type": "boolean"}],
    "minItems": 5,
    "maxItems": 5,
}

_CLASS: dict[str, Any] = {
    "type": "object",
    "required": ["sent", "attained", "attainment", *_LATENCY],
    "properties": {"sent": _COUNT, "attained": _COUNT, "attainment": {"type": ["number", "null"], "minimum": 0,
                                                                     "maximum": 1}, **_LATENCY},
}

_RATE_POINT: dict[str, Any] = {
    "type": "object",
    "required": ["rate_rps", "window_s", "sent", "finished", "attained", "attainment", "goodput_rps", *_LATENCY,
                 "classes", "path_decisions", "server_slo", "samples"],
    "properties": {
        "rate_rps": _num(), "window_s": _num(), "sent": _COUNT, "finished": _COUNT, "attained": _COUNT,
        "attainment": {**_SHARE, "description": "both objectives, of all sent"},
        "goodput_rps": _num(),
        **_LATENCY,
        "classes": {"type": "object", "required": ["chat", "long"], "additionalProperties": _CLASS},
        "path_decisions": {**_COUNTS, "description": "pdserve:path_decisions_total by path/reason"},
        "server_slo": {**_COUNTS, "description": "pdserve:slo_requests_total by slo_class/path/attained"},
        "samples": {"type": "array", "items": _SAMPLE},
    },
}

_SERVER: dict[str, Any] = {
    "type": "object",
    "required": ["kind", "prefill_path", "rates", "knee_rps"],
    "properties": {
        "kind": {"enum": ["pdserve", "vllm"]},
        "prefill_path": {"enum": ["auto", "remote", None]},
        "describe": {"type": "object", "description": "pdserve: YAML and log; vLLM: version, venv, env"},
        "rates": {"type": "array", "items": _RATE_POINT},
        "knee_rps": {**_num(nullable=True), "description": "highest rate up to which every rate held the target"},
        "skipped": {"type": "string"},
    },
}

GOODPUT_SCHEMA: dict[str, Any] = result_schema("goodput", {
    "type": "object",
    "required": ["slo", "baseline", "servers", "targets"],
    "properties": {
        "slo": {
            "type": "object",
            "required": ["ttft_ms", "tpot_ms", "reason"],
            "properties": {
                "ttft_ms": {"type": "object", "required": ["chat", "long"], "additionalProperties": _num()},
                "tpot_ms": _num(),
                "reason": {"type": "string"},
            },
        },
        "baseline": {"type": ["object", "null"], "required": ["chat_ttft_ms", "long_ttft_ms", "chat_tpot_ms", "server"],
                     "description": "medians of lone requests, one at a time, that the objectives scale"},
        "servers": {"type": "object", "minProperties": 1, "additionalProperties": _SERVER},
        "targets": {"type": "array", "items": TARGET},
    },
})
