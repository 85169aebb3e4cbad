"""The goodput benchmark's picture: attainment against offered rate, one line per server, the target drawn.

Owns `plot`: from a ``results/goodput.json`` document, two panels: the share of requests within both
objectives per server (the target line at 90%, each server's knee marked) and the chat TTFT p50 per
server (what the path decision exists to keep low). The title carries the objectives and the machine,
so the PNG reads on its own. A function of the document alone: tests draw it from synthetic results.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    target = doc["setup"]["target_attainment"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    rates: list[float] = []
    for name, s in res["servers"].items():
        if not s["rates"]:
            continue
        xs = [p["rate_rps"] for p in s["rates"]]
        rates += xs
        (line,) = ax1.plot(xs, [100 * p["attainment"] for p in s["rates"]], marker="o", label=name)
        if s["knee_rps"] is not None:
            ax1.axvline(s["knee_rps"], color=line.get_color(), ls=":", lw=1)
        ax2.plot(xs, [(p["classes"]["chat"]["ttft_ms"]["p50"] or float("nan")) / 1e3 for p in s["rates"]],
                 marker="o", label=name)
    ax1.axhline(100 * target, color="0.4", ls="--", lw=1, label=f"{target:.0%} attainment")
    ax1.set(xlabel="offered rate (requests/s)", ylabel="requests within both objectives (%)",
            title="Attainment (dotted: each server's knee)", ylim=(-3, 103))
    ax2.set(xlabel="offered rate (requests/s)", ylabel="chat TTFT p50 (s)", title="Chat TTFT, median",
            yscale="log")
    for ax in (ax1, ax2):
        ax.set_xlim(left=0, right=max(rates, default=1.0) * 1.08)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    slo = res["slo"]
    machine = doc["machine"]
    fig.suptitle(textwrap.fill(
        f"Objectives: TTFT ≤ {slo['ttft_ms']['chat']:g} ms (chat) / {slo['ttft_ms']['long']:g} ms (long), "
        f"TPOT ≤ {slo['tpot_ms']:g} ms — {machine.get('cpu', '?')}, {machine.get('cpus', '?')} cores — "
        + doc["setup"]["description"], 170), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
