"""`ptdp plot`: training curves from metrics files (one JSON record per iteration, written by
ptdp/metrics/log.py), several runs overlaid: loss (train solid, validation dashed with markers),
learning rate, throughput (tokens/s) and the fp16 loss scale against the iteration."""

from __future__ import annotations

from pathlib import Path

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"),
          ("loss_scale", "loss scale"))


def run_label(path: Path, paths: list[Path]) -> str:
    """The file name, or its folder's name when the runs share a file name (runs/*/metrics.jsonl)."""
    same_name = sum(p.name == path.name for p in paths) > 1
    return path.parent.name or str(path) if same_name else path.stem


def plot_metrics(paths: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Draw the four panels for every metrics file into `out` (PNG, PDF, SVG: by suffix)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ptdp.metrics.log import read_metrics

    paths = [Path(p) for p in paths]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for path in paths:
        records = read_metrics(path)
        if not records:
            raise ValueError(f"{path} has no records")
        label = run_label(path, paths)
        iters = [r["iter"] for r in records]
        for ax, (key, _) in zip(axes.flat, PANELS):
            line, = ax.plot(iters, [r.get(key) for r in records], label=label, lw=1.2)
            if key == "loss":
                valid = [(r["iter"], r["valid_loss"]) for r in records if "valid_loss" in r]
                if valid:
                    ax.plot(*zip(*valid), "o--", color=line.get_color(), ms=3, lw=1,
                            label=f"{label} (validation)")
    for ax, (key, name) in zip(axes.flat, PANELS):
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if key == "loss_scale":
            ax.set_yscale("log", base=2)
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    axes[0, 0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
