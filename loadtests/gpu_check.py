"""``make gpu-check`` / ``python -m loadtests.gpu_check``: one prepared run on a machine with an NVIDIA GPU.

Owns: the run's order and time budget, the machine description, the printed table and
``results/gpu_check.json``. The sections live beside it: `loadtests.gpu_check_families` (each
family against transformers, torch = reference, CUDA graphs on = off), `loadtests.gpu_check_sampler`
(device sampler = host sampler), `loadtests.gpu_check_nccl` (prefill → decode KV hand-off over
NCCL) and `loadtests.gpu_check_timing` (a random Llama-3-8B-shaped engine against the card's floors).

It assumes only torch, transformers and cupy (no Ray, no downloads: every model is built on the
spot) and fits `MAX_SECONDS` on an H100: each section has a deadline, and what would pass it is
reported as skipped, never dropped; the report is rewritten after each section (``complete:
false`` until the end), and a run that hangs past the budget dumps its stacks and exits 1.
Without a CUDA device it says so, measures nothing, writes nothing and exits 0. ``--device cpu``
is the smoke mode CI runs: the same code on CPU with tiny shapes, every CUDA-only verdict a skip
that says why; it writes JSON only where ``--out`` is given. The exit status is 1 when a
correctness check failed, else 0.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from loadtests.gpu_check_report import GPU_CHECK_SCHEMA, Check, failed, format_table, guarded, report_doc

DEFAULT_OUT = Path("results/gpu_check.json")
MAX_SECONDS = 450.0  # the 8 minutes, less start-up and a margin
HARD_EXTRA_S = 100.0  # past MAX_SECONDS + this, a hung run dumps its stacks and exits 1
#: a section starts only before this share of the run's time; later it is skipped
DEADLINES = {"families": 0.50, "sampler": 0.60, "nccl": 0.65, "timing": 0.70}
NO_GPU = "no CUDA GPU found (torch.cuda.is_available() is False): nothing was measured and nothing written"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
                            "fp32_matmul_precision": torch.get_float32_matmul_precision(),
                            "transformers": _version("transformers"),
                            "cupy": next((v for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy")
                                          if (v := _version(d)) != "not installed"), "not installed"),
                            "python": platform.python_version(), "gpu": None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1))
    return info


class Clock:
    """Seconds since the run began, and each section's deadline as a ``time.monotonic()`` value."""

    def __init__(self, max_seconds: float) -> None:
        self.t0 = time.monotonic()
        self.max_seconds = max_seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def deadline(self, section: str) -> float:
        return self.t0 + DEADLINES.get(section, 1.0) * self.max_seconds

    def late(self, section: str) -> bool:
        return time.monotonic() > self.deadline(section)

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


#: what the sections import, beyond torch and transformers (the engine's chain brings its own dependencies:
#: today gguf through engine.loading.bundled, llguidance through engine.sampling.grammar)
PREFLIGHT = ("engine.engine", "engine.generate", "tests.support.models", "loadtests.gpu_check_families",
             "loadtests.gpu_check_timing", "loadtests.gpu_check_sampler", "loadtests.gpu_check_nccl")


def preflight() -> Check:
    """Whether the engine imports here; a failure names the missing module (the device image has
    torch, transformers and cupy only, so a project dependency may be absent)."""
    import importlib

    for module in PREFLIGHT:
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or a compiled extension that does not load
            return Check("preflight", "engine imports", "fail", {"module": module},
                         reason=f"importing {module} failed: {e}; install that package or put it on PYTHONPATH")
    return Check("preflight", "engine imports", "pass", {"modules": list(PREFLIGHT)})


def late_skip(section: str, name: str) -> Check:
    return Check(section, name, "skip", reason="out of time (the run's budget)")


def run(device: torch.device, families: Sequence[str], timing: bool, clock: Clock, workdir: Path,
        checks: list[Check], saved: Callable[[], None]) -> None:
    """Every section in order, each behind its deadline, its checks appended to ``checks``;
    ``saved`` is called after each section (the partial report on disk)."""
    from loadtests import gpu_check_models as models
    from loadtests.gpu_check_families import check_family
    from loadtests.gpu_check_nccl import check_nccl_handoff
    from loadtests.gpu_check_sampler import check_sampler
    from loadtests.gpu_check_timing import GPU_PLAN, SMOKE_PLAN, run_timing

    tiny = workdir / "tiny"
    for family in families:
        if clock.late("families"):
            checks.append(late_skip("families", family))
            continue
        t = time.monotonic()
        got = guarded("families", family, lambda f=family: check_family(f, models.tiny_model(f, tiny), device))
        checks += got
        clock.say(f"{family}: {sum(c.status == 'pass' for c in got)}/{len(got)} passed ({time.monotonic() - t:.1f}s)")
        _release(device)
        saved()
    if clock.late("sampler"):
        checks.append(late_skip("sampler", "device=host rules"))
    else:
        checks += guarded("sampler", "device=host rules", lambda: [check_sampler(device)])
        clock.say(f"sampler: {checks[-1].status}")
    if clock.late("nccl"):
        checks.append(late_skip("nccl", "prefill->decode handoff"))
    else:
        def handoff() -> list[Check]:
            return [check_nccl_handoff(models.tiny_model("llama", tiny))]
        checks += guarded("nccl", "prefill->decode handoff", handoff)
        clock.say(f"nccl: {checks[-1].status} {checks[-1].reason}")
        _release(device)
    saved()
    if not timing:
        checks.append(Check("timing", "8B-shaped timings", "skip", reason="--no-timing", kind="timing"))
    elif clock.late("timing"):
        checks.append(Check("timing", "8B-shaped timings", "skip", reason="out of time (the run's budget)",
                            kind="timing"))
    else:
        plan = GPU_PLAN if device.type == "cuda" else SMOKE_PLAN
        clock.say(f"timing: {plan.shape['num_hidden_layers']}-layer Llama-3-shaped model in {plan.dtype}")
        end = clock.t0 + clock.max_seconds
        checks += guarded("timing", "8B-shaped timings", lambda: run_timing(plan, device, workdir / "shape", end))
        clock.say("timing: done")


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write(doc: dict[str, Any], out: Path, quiet: bool = False) -> None:
    try:
        import jsonschema
    except ImportError:
        if not quiet:
            print("jsonschema is not installed: the document is written unvalidated")
    else:
        jsonschema.validate(doc, GPU_CHECK_SCHEMA)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if not quiet:
        print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: the GPU check; cpu: the smoke mode (tiny shapes, CUDA-only checks skipped)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"where the JSON goes (default {DEFAULT_OUT} on cuda, none in the smoke mode)")
    ap.add_argument("--families", default="", help="comma-separated families to check (default: all seven)")
    ap.add_argument("--no-timing", action="store_true", help="skip the 8B-shaped timings")
    ap.add_argument("--max-seconds", type=float, default=MAX_SECONDS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    clock = Clock(args.max_seconds)
    machine = machine_info(device)
    clock.say(f"gpu check on {machine['gpu'] or 'cpu (smoke mode)'}: torch {machine['torch']}, "
              f"transformers {machine['transformers']}, cupy {machine['cupy']}")
    checks: list[Check] = [preflight()]
    if checks[0].status == "fail":
        clock.say(checks[0].reason)
        families: list[str] = []
    else:
        families = [f for f in args.families.split(",") if f] or list(_families())
        unknown = sorted(set(families) - set(_families()))
        if unknown:
            ap.error(f"unknown families {unknown}; expected some of {list(_families())}")
    setup = {"description": "tiny random models of each family against transformers; torch backend against "
                            "reference; CUDA graphs on against off; device sampler against host sampler; a KV "
                            "hand-off over NCCL; a random-weight Llama-3-8B-shaped engine's timings",
             "families": families, "smoke": device.type != "cuda", "max_seconds": args.max_seconds,
             "argv": list(argv if argv is not None else sys.argv[1:])}
    out = args.out if args.out is not None else (DEFAULT_OUT if device.type == "cuda" else None)

    def save(complete: bool) -> None:
        if out is not None:
            write(report_doc(checks, machine, setup, clock.elapsed(), complete=complete), out, quiet=not complete)

    # a section that hangs (a collective, a compile) still leaves the partial report and a traceback
    faulthandler.dump_traceback_later(args.max_seconds + HARD_EXTRA_S, exit=True)
    try:
        if checks[0].status == "pass":
            with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
                run(device, families, not args.no_timing, clock, Path(tmp), checks, lambda: save(False))
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(format_table(checks))
    save(True)
    bad = failed(checks)
    if bad:
        print(f"{len(bad)} correctness check(s) failed: " + ", ".join(f"{c.section}/{c.name}" for c in bad))
    return 1 if bad else 0


def _families() -> tuple[str, ...]:
    from loadtests.gpu_check_models import FAMILIES

    return FAMILIES


if __name__ == "__main__":
    sys.exit(main())
