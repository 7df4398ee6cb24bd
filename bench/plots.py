"""PNG figures of a bench with matplotlib (headless)."""
from __future__ import annotations

from pathlib import Path

from .modes import mode_label
from .results import ModeRun, figure

GOODPUT_PLOT = "goodput.png"

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

    written = [_goodput_plot(plt, runs, out_dir, subtitle)] if any(p.tails for r in runs for p in r.points) else []
    for filename, title, ylabel, series in PLOTS:
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        drawn = False
        values: list[float] = []
        for i, run in enumerate(runs):
            color = f"C{i}"
            for name, style in series:
                shown = [(p.rate, y) for p in run.points if (y := figure(p, name)) is not None]
                xs, ys = [x for x, _ in shown], [y for _, y in shown]
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
        _save(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def _goodput_plot(plt, runs: list[ModeRun], out_dir: Path, subtitle: str) -> Path:
    """What a user reads first: goodput per mode against the offered rate, with 95% intervals."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    slo = None
    top = 0.0
    for i, run in enumerate(runs):
        points = [(p.rate, p.tails, value) for p in run.points
                  if p.tails is not None and (value := p.tails.goodput.value) is not None]
        if not points:
            continue
        slo = points[0][1].slo
        xs = [rate for rate, _, _ in points]
        ys = [y for _, _, y in points]
        below = [max(0.0, y - (t.goodput.low if t.goodput.low is not None else y)) for _, t, y in points]
        above = [max(0.0, (t.goodput.high if t.goodput.high is not None else y) - y) for _, t, y in points]
        ax.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, color=f"C{i}", label=mode_label(run.mode))
        top = max([top, *xs])
    if top:
        ax.plot([0, top], [0, top], ":", color="grey", label="offered rate")
    where = f"TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms" if slo else "SLO"
    ax.set_title(f"Goodput vs request rate (requests meeting {where}, 95% CI)\n{subtitle}", fontsize=10)
    ax.set_xlabel("request rate (req/s, Poisson arrivals)")
    ax.set_ylabel("goodput (req/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / GOODPUT_PLOT
    _save(fig, path)
    plt.close(fig)
    return path


def _save(fig, path: Path) -> None:
    """A PNG of 256 colours: the same picture at about a third of the bytes, so results folders
    (which keep the plots beside the raw data) stay small."""
    import io

    from PIL import Image  # matplotlib's own dependency

    raw = io.BytesIO()
    fig.savefig(raw, format="png", facecolor="white")
    with Image.open(raw) as image:
        image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
            path, "PNG", optimize=True)
