"""PNG figures of a bench with matplotlib (headless)."""
from __future__ import annotations

from pathlib import Path

from .results import ModeRun, figure

# (file name, title, y label, [(figure name, line style)])
PLOTS = (
    ("ttft.png", "TTFT vs request rate", "TTFT (ms)", [("ttft_p50", "-"), ("ttft_p90", "--")]),
    ("tpot.png", "TPOT vs request rate", "TPOT (ms)", [("tpot_p50", "-"), ("tpot_p90", "--")]),
    ("handoff.png", "Handoff gap (prefill answer -> decode first token, at the router)", "handoff gap (ms)",
     [("handoff_p50", "-"), ("handoff_p90", "--")]),
)


def write_plots(runs: list[ModeRun], out_dir: Path, subtitle: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for filename, title, ylabel, series in PLOTS:
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        drawn = False
        values: list[float] = []
        for i, run in enumerate(runs):
            color = f"C{i}"
            for name, style in series:
                xs = [p.rate for p in run.points if figure(p, name) is not None]
                ys = [figure(p, name) for p in run.points if figure(p, name) is not None]
                values += [y for y in ys if y]
                if xs:
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{run.mode} {name.split('_')[1]}")
                    drawn = True
        if not drawn:
            plt.close(fig)
            continue
        if values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")  # modes an order of magnitude apart stay readable
        ax.set_title(f"{title}\n{subtitle}", fontsize=10)
        ax.set_xlabel("request rate (req/s, Poisson arrivals)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
