"""``--plot``: horizontal bars of every row, both layouts (matplotlib, optional)."""

from __future__ import annotations

import os
from typing import Any

from tools.bench.transfer.workload import Config


def plot(rows: list[dict[str, Any]], cfg: Config, path: str, load: float) -> str:
    """Horizontal bars, one row per system and path, both layouts, x from 0, spread bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed (pip install matplotlib)"
    keys: list[tuple[str, str]] = []
    for r in rows:
        if (r["mode"], r["system"]) not in keys:
            keys.append((r["mode"], r["system"]))
    label = {(r["mode"], r["system"]): r["label"] for r in rows}
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(keys) + 1.8))
    height = 0.38
    for j, (case, color) in enumerate((("contiguous", "tab:blue"), ("fragmented", "tab:orange"))):
        ys, vals, lo, hi = [], [], [], []
        for i, key in enumerate(keys):
            hit = [
                r
                for r in rows
                if (r["mode"], r["system"]) == key and r["case"] in (case, "one message")
            ]
            if not hit or (hit[0]["case"] == "one message" and case == "fragmented"):
                continue
            r = hit[0]
            ys.append(i + (j - 0.5) * height)
            vals.append(r["gbps"])
            lo.append(r["gbps"] - r["gbps_min"])
            hi.append(r["gbps_max"] - r["gbps"])
        ax.barh(
            ys,
            vals,
            height,
            xerr=[lo, hi],
            color=color,
            capsize=2,
            label=f"{case} (one message for raw ucxx)"
            if j == 0
            else "fragmented: runs of 1-8 pages",
        )
    names = []
    for mode, system in keys:
        where = "1 host" if mode == "same-host" else "2 netns/TCP"
        bold = system.startswith("kvstate")
        names.append(("\u25b6 " if bold else "") + f"[{where}] {label[(mode, system)]}")
    ax.set_yticks(range(len(keys)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("GB/s (median of the reps; bars: slowest..fastest rep)")
    fig.suptitle(  # centred on the figure: the long row labels push the axes right
        f"KV pages: {cfg.layers} layers x {cfg.pages} pages x {cfg.page_bytes // 1024} KiB "
        f"= {cfg.total_bytes / 2**20:.0f} MiB, contiguous and fragmented\n"
        "kvstate (\u25b6): CMA path on 1 host, UCX put path across 2 network namespaces "
        "(TCP)\nvs NIXL and Mooncake (every setting: one row each), raw ucxx, plain socket, "
        f"memcpy;\n{cfg.reps} reps each, in turn, load {load:.1f} on {os.cpu_count()} CPUs",
        fontsize=9,
    )
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot written to {path}"
