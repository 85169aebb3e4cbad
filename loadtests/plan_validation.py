"""`make bench-plan-validation`: the capacity planner's predicted attainment against the measured one.

Owns the validation, in four steps on one quiet machine: (1) measure attainment at three offered rates
on one server with the goodput benchmark itself (``loadtests.bench_goodput``: same client, schedule and
objectives); (2) profile this machine (``pdserve profile`` with the YAML the server ran); (3) run ``pdserve plan``
for the benchmark's workload and objectives at those rates (its best split per rate, for reading); (4)
`validate`: replay the very arrivals each rate sent through `cluster.planner.simulator.simulate` on that
profile with the server's own shape (`shape`) and report predicted beside measured, and the difference
in points. Writes ``results/plan_validation.json``; the target is every rate within ``tolerance``
(10 points).

Invariants: the simulated requests are the measured ones (kind → the profile's prompt and output
tokens, the chat template included once; send times as sent); the objectives are the sweep's, as the
server ran them (`loadtests.goodput_results.SLO.objectives_section`); the simulated shape is the YAML's
(replica counts, chunking, and the path decision on only for a server whose prefill path is ``auto``).
`validate`, `shape`, `arrivals` and `workload_spec` are pure; `main` runs the subprocesses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ClusterConfig
from cluster.planner.profile import ReplicaProfile, fit
from cluster.planner.simulator import Shape, simulate
from cluster.planner.workload import Arrival
from cluster.sections import ObjectivesSection
from loadtests.bench_common import REPO, RESULTS, log
from loadtests.goodput_results import SLO
from loadtests.goodput_servers import SERVERS
from loadtests.profiles import get_profile

DEFAULT_RATES = (0.25, 0.5, 0.7)
#: prompt sizes profiled: up past the workload's longest prompt (1,400 tokens and its chat template), so the
#: fitted prefill time need not extrapolate attention's growth from short prompts
PROFILE_SIZES = ["--prefill", "16,64,256,512,1024,1536"]
SMOKE_PROFILE_SIZES = ["--prefill", "16,64,256", "--batches", "1,4", "--contexts", "64,256", "--repeats", "1"]


def slo_of(goodput: Mapping[str, Any]) -> SLO:
    s = goodput["results"]["slo"]
    return SLO(float(s["ttft_ms"]["chat"]), float(s["ttft_ms"]["long"]), float(s["tpot_ms"]), s["reason"])


def shape(cfg: ClusterConfig, conditional: bool) -> Shape:
    """The simulated shape of a cluster config: a colocated one prefills its fixed chunk a step, oldest
    first; a disaggregated one has its prefill pool, and the path decision only when ``conditional``."""
    if not cfg.disaggregated:
        chunk = cfg.decode.prefill_chunk_size or (cfg.limits.max_model_len or 1 << 20)
        return Shape(0, cfg.decode.num_replicas, chunk_tokens=chunk, prefill_batch_tokens=chunk, tpot_budget=False)
    p = cfg.prefill
    return Shape(p.num_replicas, cfg.decode.num_replicas, chunk_tokens=p.max_chunk_tokens or p.max_batch_tokens,
                 prefill_batch_tokens=p.max_batch_tokens, conditional=conditional)


def arrivals(samples: Sequence[Sequence[Any]], profile: str) -> list[Arrival]:
    """One rate's requests (``[kind, sent_s, ...]`` each) as the planner's arrivals; a kind's prompt
    tokens already count the chat template (`loadtests.profiles`)."""
    kinds = {w.name: w for w, _ in get_profile(profile).workloads}
    return [Arrival(float(s[1]), kinds[s[0]].prompt_tokens, kinds[s[0]].max_tokens)
            for s in sorted(samples, key=lambda s: float(s[1]))]


def workload_spec(slo: SLO, profile: str, duration_s: float = 60.0, seed: int = 0) -> dict[str, Any]:
    """The benchmark's workload and objectives as a ``pdserve plan`` workload file (`cluster.planner.workload`)."""
    mix = [{"share": wt, "prompt": {"fixed": w.prompt_tokens}, "output": {"fixed": w.max_tokens}}
           for w, wt in get_profile(profile).workloads]
    return {"objectives": slo.objectives_section(profile), "duration_s": duration_s, "seed": seed, "mix": mix}


def validate(goodput: Mapping[str, Any], server: str, profile: ReplicaProfile, cfg: ClusterConfig,
             conditional: bool, tolerance: float = 0.10) -> dict[str, Any]:
    fp = fit(profile)
    slo = slo_of(goodput)
    workload = goodput["setup"]["sweep"]["profile"]
    obj = ObjectivesSection.model_validate(slo.objectives_section(workload)).build()
    sh = shape(cfg, conditional)
    rows = []
    for run in goodput["results"]["servers"][server]["rates"]:
        if not run["samples"]:
            continue
        predicted = simulate(fp, sh, arrivals(run["samples"], workload), obj, warmup_fraction=0.0).attainment
        rows.append({"rate": run["rate_rps"], "requests": len(run["samples"]), "measured": run["attainment"],
                     "predicted": round(predicted, 4), "diff_points": round(100 * (predicted - run["attainment"]), 1)})
    return {"server": server, "goodput_created": goodput.get("created"), "slo": slo.as_json(),
            "profile": {"label": profile.label, "source": profile.source, "hardware": profile.hardware},
            "shape": vars(sh), "tolerance_points": round(100 * tolerance, 3), "rates": rows,
            "within_tolerance": bool(rows) and all(abs(r["diff_points"]) <= 100 * tolerance for r in rows)}


def _run(cmd: list[str]) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, cwd=REPO, check=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="default", help="a pdserve server of the goodput benchmark")
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES), help="three rates (requests/s)")
    ap.add_argument("--smoke", action="store_true", help="a few seconds per rate and a small profile")
    ap.add_argument("--goodput-args", default="",
                    help="more arguments for bench_goodput (e.g. '--slo-ms 900,9000,150')")
    ap.add_argument("--profile", default=None, help="a profile JSON to use instead of measuring one")
    ap.add_argument("--measured", type=Path, default=None,
                    help="a goodput benchmark JSON that ran --server already (e.g. results/goodput.json): "
                         "its rates are validated instead of measuring again")
    ap.add_argument("--out", type=Path, default=RESULTS / "plan_validation.json")
    args = ap.parse_args(argv)
    spec = SERVERS.get(args.server)
    if spec is None or spec.config is None:
        ap.error(f"--server must be a pdserve server, one of {[s for s, v in SERVERS.items() if v.config]}")
    rates = args.rates
    out_dir = args.out.parent
    measured = args.measured or out_dir / "plan_validation_goodput.json"
    py = sys.executable
    if args.measured is None:
        _run([py, "-m", "loadtests.bench_goodput", "--servers", spec.name, "--rates", rates, "--out", str(measured),
              *(["--smoke"] if args.smoke else []), *args.goodput_args.split()])
    goodput = json.loads(measured.read_text())
    if spec.name not in goodput["results"]["servers"]:
        ap.error(f"{measured} has no run of server {spec.name!r} (it ran {sorted(goodput['results']['servers'])})")
    if args.measured is not None:  # the rates that run measured
        rates = ",".join(f"{r['rate_rps']:g}" for r in goodput["results"]["servers"][spec.name]["rates"])
    ran = out_dir / "plan_validation_server.yaml"  # the YAML the server ran: the benchmark's objectives and dtype
    ran.write_text(yaml.safe_dump(goodput["config"][spec.name]["yaml"], sort_keys=False))
    profile_path = Path(args.profile) if args.profile else out_dir / "profile_local.json"
    if not args.profile:
        _run([py, "-m", "cluster.cli", "profile", "--config", str(ran), "--out", str(profile_path),
              *(SMOKE_PROFILE_SIZES if args.smoke else PROFILE_SIZES)])
    workload_path = out_dir / "plan_workload.yaml"
    workload_path.write_text(yaml.safe_dump(workload_spec(slo_of(goodput), goodput["setup"]["sweep"]["profile"]),
                                            sort_keys=False))
    plan_path = out_dir / "plan_validation_plan.json"
    cfg = ClusterConfig.from_yaml(ran)
    replicas = cfg.decode.num_replicas + (cfg.prefill.num_replicas if cfg.disaggregated else 0)
    _run([py, "-m", "cluster.cli", "plan", "--profile", str(profile_path), "--workload", str(workload_path),
          "--gpus", str(replicas), "--rates", rates, "--out", str(plan_path)])
    doc = validate(goodput, spec.name, ReplicaProfile.load(profile_path), cfg, spec.prefill_path == "auto")
    doc = {"benchmark": "plan_validation", "smoke": args.smoke, **doc,
           "plan": json.loads(plan_path.read_text()), "files": {"measured": str(measured), "profile": str(profile_path),
                                                                "workload": str(workload_path), "server": str(ran)}}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for r in doc["rates"]:
        print(f"rate {r['rate']:g}: measured {100 * r['measured']:.1f}%, predicted {100 * r['predicted']:.1f}% "
              f"({r['diff_points']:+.1f} points, {r['requests']} requests)")
    print(f"within {doc['tolerance_points']:g} points at every rate: {doc['within_tolerance']}"
          + (" (smoke: a few requests a rate, not judged)" if args.smoke else "") + f"; wrote {args.out}")
    return 0 if doc["within_tolerance"] or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
