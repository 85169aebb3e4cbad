"""The capacity plan as a picture: predicted attainment against offered rate.

Owns `plot_plans`: one PNG with, per rate, the best candidate's attainment (its split and chunk size
written beside each point), the colocated and always-remote candidates at the same budget, and the
target attainment as a line; the profile's source (measured, or a roofline estimate) in the title, so
a plot from an estimate never passes for a measurement. matplotlib (Agg, no display) is imported here
only, when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cluster.planner.profile import ReplicaProfile
from cluster.planner.search import RatePlan


def plot_plans(plans: Sequence[RatePlan], profile: ReplicaProfile, gpus: int, out: str | Path,
               target: float = 0.9) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [p.rate for p in plans]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(rates, [100 * p.best.result.attainment for p in plans], "o-", label="best split (conditional path)")
    ax.plot(rates, [100 * p.colocated.result.attainment for p in plans], "s--", label="colocated")
    remote = [(p.rate, 100 * p.always_remote.result.attainment) for p in plans if p.always_remote is not None]
    if remote:
        ax.plot(*zip(*remote, strict=True), "^--", label="always remote")
    for p in plans:
        pre, dec = p.split(p.best)
        ax.annotate(f"{pre}P:{dec}D c{p.best.shape.chunk_tokens}",
                    (p.rate, 100 * p.best.result.attainment), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7)
    ax.axhline(100 * target, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("requests within both objectives (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{profile.label}, {gpus} GPUs: predicted ({profile.source})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
