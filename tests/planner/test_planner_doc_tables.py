"""docs/planner.md's prediction tables are what `ptdp plan` predicts today.

Each row's layout is pinned with `--fix` and the planner's step time, TFLOP/s, MFU and memory
are compared with the row at the precision the table prints. The MoE table had drifted by
3-5 % before this test existed: a change to the cost model now has to rerun the tables.
"""

import json
import re
from pathlib import Path

import pytest

from tests.planner.conftest import plan as run_plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "planner.md"
LLAMA_CONFIGS = {"Llama-3 8B": "llama3_8b.yaml", "Llama-3 70B": "llama3_70b.yaml"}
RECOMPUTE = {"no recompute": "none", "selective recompute": "selective",
             "full recompute": "full"}


@pytest.fixture
def plan(capsys):
    """`ptdp plan PATH --hardware h100-80gb --json ARGV` -> its JSON."""
    def run(path, *argv):
        assert run_plan([str(path), "--hardware", "h100-80gb", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)
    return run


def _table(header_start: str) -> list[list[str]]:
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert rows, f"no rows under {header_start!r} in {DOC}"
    return rows


def _pins(layout: str, expert: bool) -> tuple[list[str], str]:
    """`(p, t, d[, e]) schedule[ v = V], flags, b = B, R recompute` -> (--fix pins, its d)."""
    match = re.fullmatch(r"\(([\d, ]+)\) (\S+)(?: v = (\d+))?, (.+)", layout)
    assert match, f"unreadable layout {layout!r}"
    sizes = [int(x) for x in match[1].split(",")]
    schedule, chunks, rest = match[2], match[3], [x.strip() for x in match[4].split(",")]
    pins = [f"p={sizes[0]}", f"t={sizes[1]}", f"schedule={schedule}", f"v={chunks or 1}",
            f"sp={'sp' in rest}".lower(), f"sg={'sg' in rest}".lower(),
            f"recompute={RECOMPUTE[rest[-1]]}"]
    pins += [f"b={x.split('=')[1].strip()}" for x in rest if x.startswith("b =")]
    if expert:
        pins += [f"e={sizes[3]}", "distopt=true"]
    return pins, str(sizes[2])


def _check_row(plan, config: str, gpus: str, batch: str, layout: str, figures: list[str],
               expert: bool) -> None:
    pins, data = _pins(layout, expert)
    argv = ["--gpus", gpus, "--global-batch-size", batch, "--fix", ",".join(pins), "--top", "1"]
    if expert:
        argv.append("--allow-distributed-optimizer")
    result = plan(ROOT / "configs" / config, *argv)
    assert str(result["parallel"]["data"]) == data
    step, tflops, mfu, memory = figures
    predicted = result["predicted"]
    decimals = len(step.split(".")[1]) if "." in step else 0
    shown = {"step s": f"{predicted['step_time_s']:.{decimals}f}",
             "TFLOP/s": f"{predicted['tflops_per_gpu']:.1f}",
             "MFU": f"{predicted['mfu'] * 100:.0f} %",
             "GiB": f"{predicted['memory_gb_per_gpu']:.1f}"}
    assert shown == {"step s": step, "TFLOP/s": tflops, "MFU": mfu, "GiB": memory}, \
        f"docs/planner.md's row for {config} on {gpus} GPUs, B = {batch} ({layout})"


@pytest.mark.parametrize("row", _table("| model | GPUs | B | layout (p, t, d)"),
                         ids=lambda row: f"{row[0]}-{row[1]}-{row[2]}".replace(" ", ""))
def test_the_llama_table_is_what_the_planner_predicts(plan, row):
    model, gpus, batch, layout, *figures = row
    _check_row(plan, LLAMA_CONFIGS[model], gpus, batch, layout, figures, expert=False)


@pytest.mark.parametrize("row", _table("| config | GPUs | B | layout (p, t, d, e)"),
                         ids=lambda row: row[0].split("`")[1])
def test_the_moe_table_is_what_the_planner_predicts(plan, row):
    config, gpus, batch, layout, *figures = row
    _check_row(plan, config.split("`")[1], gpus, batch, layout, figures, expert=True)
