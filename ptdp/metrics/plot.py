"""`ptdp plot`: training curves from metrics files (one JSON record per iteration, written by
ptdp/metrics/log.py), several runs overlaid: loss (train solid, validation dashed with markers),
learning rate, throughput (tokens/s) and the fp16 loss scale against the iteration; for a
mixture of experts also the expert load (the busiest expert's tokens over the mean, 1 =
balanced) and the auxiliary losses the stages add (router load-balancing and z losses)."""

from __future__ import annotations

from pathlib import Path

from ptdp.metrics.log import AUX_PREFIX, LOAD_FIELD, read_metrics

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"),
          ("loss_scale", "loss scale"))
MOE_PANELS = ((LOAD_FIELD, "expert load: max / mean tokens per expert"),
              (AUX_PREFIX, "auxiliary losses"))


def panels_for(runs: list[list[dict]]) -> tuple:
    """The panels to draw: the four, and the expert ones when any run has an expert load."""
    moe = any(LOAD_FIELD in r for records in runs for r in records)
    return PANELS + MOE_PANELS if moe else PANELS


def _series(records: list[dict], key: str) -> dict[str, list]:
    """{legend suffix: values} of one panel: the field itself, or every aux/<name> field."""
    if key != AUX_PREFIX:
        return {"": [r.get(key) for r in records]}
    names = sorted({k for r in records for k in r if k.startswith(AUX_PREFIX)})
    return {f" {k[len(AUX_PREFIX):]}": [r.get(k) for r in records] for k in names}


def run_label(path: Path, paths: list[Path]) -> str:
    """The file name, or its folder's name when the runs share a file name (runs/*/metrics.jsonl)."""
    same_name = sum(p.name == path.name for p in paths) > 1
    return path.parent.name or str(path) if same_name else path.stem


def plot_metrics(paths: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Draw the panels for every metrics file into `out` (PNG, PDF, SVG: by suffix)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [Path(p) for p in paths]
    runs = [read_metrics(path) for path in paths]
    for path, records in zip(paths, runs):
        if not records:
            raise ValueError(f"{path} has no records")
    panels = panels_for(runs)
    rows = len(panels) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.5 * rows), sharex=True)
    for path, records in zip(paths, runs):
        label = run_label(path, paths)
        iters = [r["iter"] for r in records]
        for ax, (key, _) in zip(axes.flat, panels):
            for suffix, values in _series(records, key).items():
                line, = ax.plot(iters, values, label=label + suffix, lw=1.2)
            if key == "loss":
                valid = [(r["iter"], r["valid_loss"]) for r in records if "valid_loss" in r]
                if valid:
                    ax.plot(*zip(*valid), "o--", color=line.get_color(), ms=3, lw=1,
                            label=f"{label} (validation)")
    for ax, (key, name) in zip(axes.flat, panels):
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if key == "loss_scale":
            ax.set_yscale("log", base=2)
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    axes[0, 0].legend(fontsize=8)
    if len(panels) > len(PANELS):
        axes[-1, 1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
