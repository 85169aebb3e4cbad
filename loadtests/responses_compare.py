"""The Responses API side by side: pdserve and vLLM's CPU build answer the same requests.

Owns: `main`, which serves the bundled model with ``pdserve serve`` (a config, default
deploy/local.yaml) and with vLLM's CPU build (`loadtests.vllm_peer`), sends each of `REQUESTS` to both
through the official ``openai`` client, streamed and not, and writes ``results/responses_compare.json``:
per server and request, the streamed event types in order (consecutive repeats of one type counted),
the final status, ``incomplete_details``, output item types and text, and usage.

Invariants: both servers load the same prepared weights and get the same greedy request; the
comparison is of the wire shape and of the text, not of speed (nothing here is timed). A peer that
cannot be installed or started is recorded with its reason instead of a result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

from openai import OpenAI

from loadtests.bench_common import MODEL, REPO, ServerProcess, log, machine

REQUESTS: dict[str, dict[str, Any]] = {
    "completed": {"input": "What is the capital of France? Answer in one sentence.", "max_output_tokens": 64},
    "incomplete": {"instructions": "You are a helpful assistant.",
                   "input": [{"role": "user", "content": "Tell me a long story about a dragon."}],
                   "max_output_tokens": 12},
}


def _runs(tokens: list[str]) -> list[str]:
    """Event types in order, a run of one type written ``type ×n``."""
    out: list[str] = []
    for t in tokens:
        if out and out[-1].split(" ×")[0] == t:
            head, _, n = out[-1].partition(" ×")
            out[-1] = f"{head} ×{int(n or 1) + 1}"
        else:
            out.append(t)
    return out


def exchange(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
    args = {"model": MODEL, "temperature": 0.0, **body}
    whole = client.responses.create(**args)
    events: list[str] = []
    seq: list[int] = []
    final: Any = None
    with client.responses.stream(**args) as stream:
        for ev in stream:
            events.append(ev.type)
            seq.append(ev.sequence_number)
            final = getattr(ev, "response", final)  # the last event's (completed / incomplete)
    return {
        "events": _runs(events),
        "sequence_numbers_consecutive": seq == list(range(seq[0], seq[0] + len(seq))) if seq else False,
        "status": whole.status,
        "incomplete_details": whole.incomplete_details.model_dump() if whole.incomplete_details else None,
        "output_types": [item.type for item in whole.output],
        "output_text": whole.output_text,
        "streamed_text_equals_whole": final.output_text == whole.output_text,
        "usage": {"input_tokens": whole.usage.input_tokens, "output_tokens": whole.usage.output_tokens}
        if whole.usage else None,
    }


def run_all(base_url: str) -> dict[str, Any]:
    return {name: exchange(base_url, body) for name, body in REQUESTS.items()}


def main() -> None:
    from loadtests.vllm_peer import PeerUnavailable, VllmPeer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="deploy/local.yaml")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "responses_compare.json")
    args = ap.parse_args()
    servers: dict[str, Any] = {}
    log(f"pdserve {args.config}")
    with ServerProcess(REPO / args.config) as srv:
        servers["pdserve"] = run_all(srv.base_url)
    try:
        peer = VllmPeer.prepare()
        log(f"vLLM {peer.version}")
        with peer.serve() as base:
            servers["vllm"] = {"version": peer.version, **run_all(base)}
    except PeerUnavailable as e:
        servers["vllm"] = {"skipped": str(e)}
    doc = {"benchmark": "responses_compare", "machine": machine(), "config": args.config,
           "requests": REQUESTS, "servers": servers}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"wrote {args.out}")
    with contextlib.suppress(KeyError):
        for name in REQUESTS:
            log(f"{name}: pdserve {servers['pdserve'][name]['events']}")
            log(f"{name}: vllm    {servers['vllm'][name]['events']}")


if __name__ == "__main__":
    main()
