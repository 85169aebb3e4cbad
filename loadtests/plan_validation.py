"""The capacity planner checked against a measured goodput sweep: predicted vs measured attainment per rate.

Owns `validate`: reads a `make bench-goodput` result (its SLOs, and for one mode every request's kind and
send time at each rate), replays those very arrivals through `cluster.planner.simulator.simulate` on a
measured profile (`pdserve profile`) with the mode's own cluster shape (read from its Serve YAML), and
reports both attainments side by side; `main` writes ``results/plan_validation.json``. The target is
the predicted attainment within ``tolerance`` (10 points) of the measured one at every rate.

Run on a quiet machine, after the sweep (both need the same machine, idle)::

    pdserve profile --config deploy/bench-disaggregated.yaml --out results/profile_local.json
    make bench-goodput
    python -m loadtests.plan_validation --profile results/profile_local.json --mode disaggregated

Kinds map to `loadtests.profiles.PROFILES` (prompt tokens with the chat template's, output tokens = the
kind's ``max_tokens``); the objectives are the sweep's: TTFT per kind, one TPOT, as two classes by length.
The mode's shape: its prefill and decode replica counts and chunking; the path decision is off for a
mode that does not run it (every shipped one today). Pure beyond the file reads: no Ray, no model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.planner.profile import ReplicaProfile, fit
from cluster.planner.simulator import Shape, simulate
from cluster.planner.workload import Arrival
from loadtests.profiles import CHAT_TEMPLATE_TOKENS, PROFILES
from router.objectives import Objectives, SLOClass

REPO = Path(__file__).resolve().parent.parent


def objectives(slo: Mapping[str, Any]) -> Objectives:
    """The sweep's SLOs as classes: chat up to its prompt length, long the catch-all."""
    chat = PROFILES["chat"].workloads[0][0]
    tpot_s = float(slo["tpot_ms"]) / 1e3
    return Objectives((SLOClass("chat", float(slo["ttft_ms"]["chat"]) / 1e3, tpot_s,
                                max_prompt_tokens=chat.prompt_tokens + CHAT_TEMPLATE_TOKENS),
                       SLOClass("long", float(slo["ttft_ms"]["long"]) / 1e3, tpot_s)))


def shape(cfg: ClusterConfig, conditional: bool = False) -> Shape:
    """The simulated shape of a cluster config as it runs today: a colocated one prefills its fixed chunk
    a step, oldest first; a disaggregated one sends every prompt to the prefill pool."""
    if not cfg.disaggregated:
        chunk = cfg.decode.prefill_chunk_size or (cfg.limits.max_model_len or 1 << 20)
        return Shape(0, cfg.decode.num_replicas, chunk_tokens=chunk, prefill_batch_tokens=chunk, tpot_budget=False)
    p = cfg.prefill
    return Shape(p.num_replicas, cfg.decode.num_replicas, chunk_tokens=p.max_chunk_tokens or p.max_batch_tokens,
                 prefill_batch_tokens=p.max_batch_tokens, conditional=conditional)


def arrivals(samples: Sequence[Sequence[Any]]) -> list[Arrival]:
    """The sweep's requests at one rate (``[kind, sent_s, ...]`` each) as the planner's arrivals."""
    kinds = {w.name: w for w, _ in PROFILES["mixed"].workloads}
    return [Arrival(float(s[1]), kinds[s[0]].prompt_tokens + CHAT_TEMPLATE_TOKENS, kinds[s[0]].max_tokens)
            for s in sorted(samples, key=lambda s: float(s[1]))]


def validate(goodput: Mapping[str, Any], mode: str, profile: ReplicaProfile, cfg: ClusterConfig,
             tolerance: float = 0.10) -> dict[str, Any]:
    fp = fit(profile)
    obj = objectives(goodput["results"]["slo"])
    sh = shape(cfg)
    rows = []
    for run in goodput["results"]["modes"][mode]["rates"]:
        if len(run["samples"]) < 2:
            continue
        predicted = simulate(fp, sh, arrivals(run["samples"]), obj, warmup_fraction=0.0).attainment
        rows.append({"rate": run["rate_rps"], "requests": len(run["samples"]), "measured": run["attainment"],
                     "predicted": round(predicted, 4), "diff_points": round(100 * (predicted - run["attainment"]), 1)})
    return {"benchmark": "plan_validation", "mode": mode, "goodput_created": goodput.get("created"),
            "profile": {"label": profile.label, "source": profile.source, "hardware": profile.hardware},
            "shape": vars(sh), "tolerance_points": 100 * tolerance, "rates": rows,
            "within_tolerance": bool(rows) and all(abs(r["diff_points"]) <= 100 * tolerance for r in rows)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="a measured profile of this machine (pdserve profile)")
    ap.add_argument("--goodput", default=str(REPO / "results/goodput.json"))
    ap.add_argument("--mode", default="disaggregated", help="a mode of the sweep")
    ap.add_argument("--config", default=None, help="the mode's Serve YAML (default deploy/bench-<mode>.yaml)")
    ap.add_argument("--out", default=str(REPO / "results/plan_validation.json"))
    args = ap.parse_args(argv)
    goodput = json.loads(Path(args.goodput).read_text())
    if args.mode not in goodput["results"]["modes"]:
        print(f"mode {args.mode!r} not in {args.goodput}: {sorted(goodput['results']['modes'])}", file=sys.stderr)
        return 2
    cfg = ClusterConfig.from_yaml(args.config or REPO / f"deploy/bench-{args.mode}.yaml")
    doc = validate(goodput, args.mode, ReplicaProfile.load(args.profile), cfg)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for r in doc["rates"]:
        print(f"rate {r['rate']:g}: measured {100 * r['measured']:.1f}%, predicted {100 * r['predicted']:.1f}% "
              f"({r['diff_points']:+.1f} points)")
    print(f"within {doc['tolerance_points']:g} points at every rate: {doc['within_tolerance']}")
    return 0 if doc["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
