"""docs/planner.md's prediction tables, and the planner's figures quoted in its prose and in
docs/parallelism.md, are what `ptdp plan` predicts today.

Each row's layout is pinned with `--fix` and the planner's step time, TFLOP/s, MFU and memory
are compared with the row at the precision the table prints. The MoE table had drifted by up
to 6 % before this test existed: a change to the cost model now has to rerun the tables.
"""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "planner.md"
LLAMA_CONFIGS = {"Llama-3 8B": "llama3_8b.yaml", "Llama-3 70B": "llama3_70b.yaml"}
RECOMPUTE = {"no recompute": "none", "selective recompute": "selective",
             "full recompute": "full"}


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


def _check_row(plan_json, config: str, gpus: str, batch: str, layout: str, figures: list[str],
               expert: bool) -> None:
    pins, data = _pins(layout, expert)
    argv = ["--gpus", gpus, "--global-batch-size", batch, "--fix", ",".join(pins), "--top", "1"]
    if expert:
        argv.append("--allow-distributed-optimizer")
    result = plan_json(ROOT / "configs" / config, *argv)
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
def test_the_llama_table_is_what_the_planner_predicts(plan_json, row):
    model, gpus, batch, layout, *figures = row
    _check_row(plan_json, LLAMA_CONFIGS[model], gpus, batch, layout, figures, expert=False)


@pytest.mark.parametrize("row", _table("| config | GPUs | B | layout (p, t, d, e)"),
                         ids=lambda row: row[0].split("`")[1])
def test_the_moe_table_is_what_the_planner_predicts(plan_json, row):
    config, gpus, batch, layout, *figures = row
    _check_row(plan_json, config.split("`")[1], gpus, batch, layout, figures, expert=True)


def _prose(path: Path, pattern: str) -> tuple[str, ...]:
    text = " ".join(path.read_text().split())
    match = re.search(pattern, text)
    assert match, f"{path.relative_to(ROOT)} no longer says {pattern!r}"
    return match.groups()


def test_the_gpt_1t_paragraph_is_what_the_planner_predicts():
    """docs/planner.md's GPT-1T on 3,072 A100s: t = 16 across nodes against t = 8."""
    from ptdp.hardware import load_hardware
    from tests.planner.planner_cases import GPT_1T, Layout, run

    said = _prose(DOC, r"\(64, 16, 3\), selective, ([\d.]+) s per step \(tensor all-reduces "
                       r"([\d.]+) s\), against ([\d.]+) s for the best t = 8 layout, .*?"
                       r"\(its recomputation ([\d.]+) s\)\. t = 8 with selective recomputation "
                       r"needs ([\d.]+) GB \(p = 64\) or ([\d.]+) GB \(p = 128\).*?"
                       r"\(64, 8, 6\) selective fits \(([\d.]+) GB, ([\d.]+) s\)")
    a100 = load_hardware("a100-80gb")

    def predict(p, t, d, recompute, v=1, distopt=False):
        return run(a100, GPT_1T, 3072, Layout(p, t, d, v, 1, "interleaved" if v > 1 else "1f1b",
                                              recompute, True, distributed_optimizer=distopt,
                                              sequence_parallel=False))
    t16, full = predict(64, 16, 3, "selective"), predict(64, 8, 6, "full", v=2)
    t8, t8_deep = predict(64, 8, 6, "selective"), predict(128, 8, 3, "selective")
    sharded = predict(64, 8, 6, "selective", distopt=True)
    computed = (t16.step_time_s, t16.time["tensor_comm"], full.step_time_s,
                full.time["recompute"], t8.memory_gb_per_gpu, t8_deep.memory_gb_per_gpu,
                sharded.memory_gb_per_gpu, sharded.step_time_s)
    assert tuple(f"{x:.1f}" for x in computed) == said


def test_the_distributed_optimizer_example_is_what_the_planner_predicts(plan_json):
    """docs/parallelism.md's GPT-3 175B on 1,024 A100s with and without a sharded optimizer."""
    said = _prose(ROOT / "docs" / "parallelism.md",
                  r"p = 8, t = 4, d = 32, v = 6, predicted ([\d.]+) s per step \((\d+) TFLOP/s "
                  r"per GPU, ([\d.]+) GB\) against ([\d.]+) s \((\d+) TFLOP/s, ([\d.]+) GB\) for "
                  r"the best layout without it \(p = 32, t = 4, d = 8, zb-h1\)")
    common = ["--nodes", "128", "--global-batch-size", "1536", "--top", "1", "--fix"]
    sharded = plan_json(ROOT / "configs" / "gpt_175b.yaml", *common,
                   "p=8,t=4,v=6,b=1,schedule=interleaved,sp=true,recompute=none,distopt=true",
                   "--allow-distributed-optimizer", hardware="a100-80gb")["predicted"]
    whole = plan_json(ROOT / "configs" / "gpt_175b.yaml", *common,
                 "p=32,t=4,b=1,schedule=zb-h1,sp=true,recompute=none",
                 hardware="a100-80gb")["predicted"]
    shown = tuple(f"{x['step_time_s']:.1f}|{x['tflops_per_gpu']:.0f}|{x['memory_gb_per_gpu']:.1f}"
                  for x in (sharded, whole))
    assert shown == ("|".join(said[:3]), "|".join(said[3:]))
