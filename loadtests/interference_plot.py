"""The interference benchmark's picture: every chat token gap against time, one panel per mode.

Owns `plot`: from a ``results/interference.json`` document, per mode a scatter of the chat streams'
token gaps (log scale) over the run, the chat-only window shaded, each long prompt's send time as a
vertical line, and the phases' p50 / p99 ITL in the panel's title. A function of the document alone.
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

    modes = doc["results"]["modes"]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 2.9 * len(modes)), sharex=True, squeeze=False)
    for ax, (name, m) in zip(axes[:, 0], modes.items(), strict=True):
        tl = m["timeline"]
        ax.scatter(tl["itl_t_s"], tl["itl_ms"], s=3, alpha=0.5, color="tab:blue", label="chat token gap")
        for i, t in enumerate(tl["long_sent_s"]):
            ax.axvline(t, color="tab:red", lw=0.8, alpha=0.7, label="2,000-token prompt sent" if i == 0 else None)
        ax.axvspan(tl.get("chat_only_start_s", 0), tl["mixed_start_s"], color="0.92", zorder=0)
        ph = m["phases"]
        alone, mixed = ph["chat_only"]["chat_itl_ms"], ph["mixed"]["chat_itl_ms"]
        ax.set_title(f"{name}: p99 ITL chat-only {fmt_ms(alone['p99'])} ms, mixed {fmt_ms(mixed['p99'])} ms "
                     f"(p50 {fmt_ms(alone['p50'])} / {fmt_ms(mixed['p50'])})", fontsize=9)
        ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the chat users started (grey: chat-only window; then mixed)")
    machine = doc["machine"]
    fig.suptitle(f"Decode interference, {doc['setup']['plan']['chat_users']} chat streams + long prompts every "
                 f"{doc['setup']['plan']['long_interval_s']:g} s — {machine.get('cpu', '?')}, "
                 f"{machine.get('cpus', '?')} cores\n" + textwrap.fill(doc["setup"]["description"], 150), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"
