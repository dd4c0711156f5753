"""The shipped configs, the launch scripts that run them, and the README and docs/ pages.

Configs: each one validates for the number of GPUs its header comment names, with the
(p, t, d) the comment states; the Llama-3 ones have Meta's shapes and parameter counts. Launch scripts: run with DRY_RUN=1 (and a fake `scontrol` and
`srun` for SLURM), so the tests check the torchrun command line they build without starting
any rank. README and docs/: the configuration table equals the dataclasses, the paths and
links they mention exist.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from ptdp.config import Config, ConfigError, load_config
from tests.background import end, finish, start
from tests.deadline import within

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
TOOLS = ROOT / "tools"

# name -> (GPUs it is meant for, (p, t, d), billions of parameters by Eq. 4.3)
REALISTIC = {
    "gpt_1.3b": (32, (1, 1, 32), 1.3),
    "gpt_8.3b": (512, (1, 8, 64), 8.3),
    "gpt_175b": (96, (12, 8, 1), 175),
    "bert_large": (8, (1, 1, 8), 0.34),
}


def header_layout(path: Path) -> tuple[tuple[int, int, int], int]:
    """The '(p, t, d) = (a, b, c) on N GPUs/ranks' statement in a config's top comment."""
    header = "".join(line for line in path.read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    match = re.search(r"\(p, t, d\) = \((\d+), (\d+), (\d+)\)[^\n]*? on (\d+) (?:local CPU )?"
                      r"(?:GPUs|ranks)", header)
    assert match, f"{path.name}: the header comment must say '(p, t, d) = (..) on N GPUs'"
    p, t, d, n = map(int, match.groups())
    return (p, t, d), n


def eq43_parameters(cfg: Config) -> float:
    m = cfg.model
    l, h, s, v = m.num_layers, m.hidden_size, m.seq_length, m.vocab_size
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_realistic_config_layout(name):
    gpus, layout, billions = REALISTIC[name]
    path = CONFIGS / f"{name}.yaml"
    assert header_layout(path) == (layout, gpus)
    cfg = load_config(path, world_size=gpus)
    assert (cfg.parallel.pipeline, cfg.parallel.tensor, cfg.parallel.data) == layout
    assert cfg.train.precision == "bf16"
    assert eq43_parameters(cfg) / 1e9 == pytest.approx(billions, rel=0.05)


# name -> (GPUs it is meant for, (p, t, d), parameters by Eq. 4.3 generalised (Meta's counts),
# (layers, hidden, heads, K/V heads, ffn))
LLAMA3 = {
    "llama3_8b": (8, (2, 2, 2), 8_030_261_248, (32, 4096, 32, 8, 14336)),
    "llama3_70b": (64, (16, 4, 1), 70_553_706_496, (80, 8192, 64, 8, 28672)),
}


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_llama3_configs_follow_meta(name):
    from ptdp.planner.formulas import ModelShape, parameter_total
    gpus, layout, params, sizes = LLAMA3[name]
    path = CONFIGS / f"{name}.yaml"
    assert header_layout(path) == (layout, gpus)
    cfg = load_config(path, world_size=gpus)
    assert (cfg.parallel.pipeline, cfg.parallel.tensor, cfg.parallel.data) == layout
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == sizes
    assert (m.seq_length, m.vocab_size, m.rope_theta, m.layernorm_eps) == (8192, 128256, 5e5, 1e-5)
    assert (m.position_embedding, m.normalization, m.activation) == ("rope", "rmsnorm", "swiglu")
    assert not m.bias and not m.tie_embeddings
    assert cfg.train.precision == "bf16"
    assert parameter_total(ModelShape.from_config(m)) == params
    if name == "llama3_8b":   # 64 GPUs keep (p, t)
        assert load_config(path, world_size=64).parallel.data == 16


def test_gpt_175b_follows_the_source():
    cfg = load_config(CONFIGS / "gpt_175b.yaml", world_size=96)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.seq_length) == (96, 12288, 96, 2048)
    assert cfg.parallel.tensor == 8 and cfg.parallel.chunks > 1
    assert cfg.schedule.name == "interleaved" and cfg.parallel.scatter_gather
    assert cfg.train.recompute == "full"
    for gpus, d in ((384, 4), (768, 8), (1536, 16)):  # the scale-out of Table 4.2
        assert load_config(CONFIGS / "gpt_175b.yaml", world_size=gpus).parallel.data == d


def test_demo_config():
    path = CONFIGS / "gpt_demo.yaml"
    assert header_layout(path) == ((2, 2, 2), 8)
    cfg = load_config(path, world_size=8)
    assert (cfg.parallel.pipeline, cfg.parallel.tensor, cfg.parallel.data) == (2, 2, 2)
    assert cfg.model.hidden_size <= 128
    assert cfg.data.source == "indexed"
    # The demo tokenizer is trained with this vocabulary size (tools/demo.sh).
    assert f"--vocab-size {cfg.model.vocab_size}" in (TOOLS / "demo.sh").read_text()
    with pytest.raises(ConfigError):
        load_config(path, world_size=6)


@pytest.mark.parametrize("name", ["gpt_tiny", "bert_tiny", "llama_tiny"])
def test_tiny_configs_run_on_one_to_eight_ranks(name):
    for world in (1, 2, 4, 8):
        assert load_config(CONFIGS / f"{name}.yaml", world_size=world).parallel.data == world


# --------------------------------------------------------------------------------------------
# Launch scripts
# --------------------------------------------------------------------------------------------

SCRIPTS = ["pretrain_gpt.sh", "pretrain_bert.sh", "slurm_pretrain.sh", "demo.sh"]


def _script_env(env=None) -> dict:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("NNODES", "NUM_NODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                             "GPUS_PER_NODE", "NPROC", "TORCHRUN", "TORCHRUN_ARGS")}
    full_env.update(PYTHON=sys.executable, DRY_RUN="1", **(env or {}))
    return full_env


def start_script(args, env=None, cwd=ROOT) -> subprocess.Popen:
    """A launch script with DRY_RUN=1, started now (tests/background.py)."""
    return start(["bash", *args], cwd=cwd, env=_script_env(env))


def torchrun_line(stderr: str) -> list[list[str]]:
    return [line.split(": ", 1)[1].split() for line in stderr.splitlines()
            if re.match(r"pretrain_(gpt|bert)\.sh: .*? --nnodes ", line)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_strict_bash(script):
    text = (TOOLS / script).read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in text
    assert os.access(TOOLS / script, os.X_OK)
    subprocess.run(["bash", "-n", str(TOOLS / script)], check=True)


PRETRAIN_ERRORS = [
    (["configs/missing.yaml"], "config file not found: configs/missing.yaml"),
    (["configs/gpt_tiny.yaml", "--nproc-per-node", "2"], "pass overrides as key=value"),
    (["configs/gpt_tiny.yaml", "iters=5"], "not a section.key=value override"),
    (["configs/gpt_tiny.yaml", "parallel.tensor=3"], "not divisible by parallel.pipeline"),
]
NUM_NODES_ENV = dict(NODE_RANK="1", MASTER_ADDR="10.1.2.3", GPUS_PER_NODE="4", TORCHRUN="torchrun")


def _fake_slurm(bin_dir: Path) -> Path:
    """Stand-ins for SLURM's scontrol and srun in `bin_dir`."""
    bin_dir.mkdir(exist_ok=True)
    # The pause makes a reader that stops after the first host (`| head -n 1`) kill the fake
    # with SIGPIPE, which `set -o pipefail` would turn into a failed job.
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] || exit 1\n'
        'echo gpu-node-07; sleep 0.3; echo gpu-node-08\n')
    # A fake srun: runs the command once per node, here, with SLURM_NODEID set.
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
        'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" || exit; done\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _launches(bin_dir: Path) -> dict:
    """name -> (arguments, environment) of every dry run the tests below read."""
    out = {
        "multi-node": ([TOOLS / "pretrain_gpt.sh", "configs/gpt_tiny.yaml", "parallel.tensor=2",
                        "parallel.pipeline=2"],
                       dict(NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3",
                            MASTER_PORT="6000", GPUS_PER_NODE="4", TORCHRUN="torchrun")),
        "num-nodes": ([TOOLS / "pretrain_gpt.sh", "parallel.tensor=4"],
                      dict(NUM_NODES_ENV, NUM_NODES="2")),
        "num-nodes-conflict": ([TOOLS / "pretrain_gpt.sh"],
                               dict(NUM_NODES_ENV, NUM_NODES="2", NNODES="3")),
        "cpu-defaults": ([TOOLS / "pretrain_gpt.sh"], dict(CUDA_VISIBLE_DEVICES="", NPROC="4")),
        "bert-default": ([TOOLS / "pretrain_bert.sh", "train.iters=3"],
                         dict(CUDA_VISIBLE_DEVICES="", NPROC="2")),
        "slurm": ([TOOLS / "slurm_pretrain.sh", "configs/gpt_tiny.yaml", "train.iters=2"],
                  dict(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="123",
                       SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu-node-[07-08]",
                       SLURM_SUBMIT_DIR=str(ROOT), SLURM_GPUS_PER_NODE="a100:4",
                       TORCHRUN="torchrun")),
        "slurm-outside": ([TOOLS / "slurm_pretrain.sh", "configs/gpt_tiny.yaml"],
                          dict(SLURM_JOB_ID="")),
    }
    for i, (args, _) in enumerate(PRETRAIN_ERRORS):
        out[f"error {i}"] = ([TOOLS / "pretrain_gpt.sh", *args],
                             dict(CUDA_VISIBLE_DEVICES="", NPROC="8"))
    return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every dry run of the tests below, started at once (each spends seconds in its
    `ptdp check`, and without GPUS_PER_NODE in importing torch to count GPUs: one core's work
    each); each test waits for its own (`ran`). {name: process}."""
    bin_dir = _fake_slurm(tmp_path_factory.mktemp("slurm") / "bin")
    started = {}
    try:
        for name, (args, env) in _launches(bin_dir).items():
            started[name] = start_script(args, env)
        yield started
    finally:
        end(started.values())


def ran(launches, name: str) -> subprocess.CompletedProcess:
    return finish(launches[name], within(120))


def test_pretrain_gpt_multi_node_command(launches):
    res = ran(launches, "multi-node")
    assert res.returncode == 0, res.stderr
    [cmd] = torchrun_line(res.stderr)
    assert cmd == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4",
                   "--master-addr", "10.1.2.3", "--master-port", "6000", "-m", "ptdp", "train",
                   "configs/gpt_tiny.yaml", "parallel.tensor=2", "parallel.pipeline=2"]
    assert "(p, t, d) = (2, 2, 2)" in res.stderr


def test_pretrain_accepts_megatrons_num_nodes(launches):
    res = ran(launches, "num-nodes")
    assert res.returncode == 0, res.stderr
    [cmd] = torchrun_line(res.stderr)
    assert cmd[cmd.index("--nnodes") + 1] == "2"
    res = ran(launches, "num-nodes-conflict")
    assert res.returncode == 2 and "NNODES=3 and NUM_NODES=2 disagree" in res.stderr


def test_pretrain_cpu_defaults(launches):
    res = ran(launches, "cpu-defaults")
    assert res.returncode == 0, res.stderr
    [cmd] = torchrun_line(res.stderr)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("--nnodes") + 1] == "1"
    assert cmd[-1].endswith("configs/gpt_tiny.yaml")
    assert "cpu (gloo)" in res.stderr


def test_pretrain_bert_default_config(launches):
    res = ran(launches, "bert-default")
    assert res.returncode == 0, res.stderr
    [cmd] = torchrun_line(res.stderr)
    assert cmd[-2:] == ["configs/bert_tiny.yaml", "train.iters=3"]


@pytest.mark.parametrize("case", range(len(PRETRAIN_ERRORS)),
                         ids=[f"args{i}-{message}" for i, (_, message) in enumerate(PRETRAIN_ERRORS)])
def test_pretrain_errors(launches, case):
    res, message = ran(launches, f"error {case}"), PRETRAIN_ERRORS[case][1]
    assert res.returncode == 2
    assert message in res.stderr
    assert not torchrun_line(res.stderr)


def test_slurm_script(launches):
    res = ran(launches, "slurm")
    assert res.returncode == 0, res.stderr
    cmds = torchrun_line(res.stderr)
    assert len(cmds) == 2
    for node, cmd in enumerate(cmds):
        args = dict(zip(cmd[1:11:2], cmd[2:11:2]))
        assert args == {"--nnodes": "2", "--node-rank": str(node), "--nproc-per-node": "4",
                        "--master-addr": "gpu-node-07", "--master-port": "20123"}
        assert cmd[-3:] == ["train", "configs/gpt_tiny.yaml", "train.iters=2"]


def test_slurm_script_outside_slurm(launches):
    res = ran(launches, "slurm-outside")
    assert res.returncode == 2 and "not inside a SLURM job" in res.stderr


# --------------------------------------------------------------------------------------------
# README.md and docs/
# --------------------------------------------------------------------------------------------

DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def config_keys() -> dict[str, object]:
    """'section.key' -> default, for every key of every section of Config."""
    keys = {}
    for section in dataclasses.fields(Config):
        section_cls = typing.get_type_hints(Config)[section.name]
        for f in dataclasses.fields(section_cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            keys[f"{section.name}.{f.name}"] = default
    return keys


def yaml_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def test_configuration_doc_documents_every_config_key():
    doc = (DOCS / "configuration.md").read_text()
    rows = {m.group(1): m.group(2) for m in
            re.finditer(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| `([^`]*)` \|", doc, re.M)}
    keys = config_keys()
    missing = sorted(set(keys) - set(rows))
    assert not missing, f"docs/configuration.md's config table lacks {missing}"
    stale = sorted(set(rows) - set(keys))
    assert not stale, (f"docs/configuration.md's config table lists keys ptdp/config/schema.py "
                       f"does not have: {stale}")
    wrong = {k: (rows[k], yaml_text(v)) for k, v in keys.items() if rows[k] != yaml_text(v)}
    assert not wrong, (f"docs/configuration.md's defaults differ from ptdp/config/schema.py "
                       f"(docs, code): {wrong}")


def test_readme_commands_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(MARKDOWN) > 1, "docs/*.md is missing"
    for page in MARKDOWN:
        name = page.relative_to(ROOT)
        text = page.read_text()
        for path in re.findall(r"\b((?:tools|configs)/[\w./-]+\.(?:sh|yaml|py))\b", text):
            assert (ROOT / path).exists(), f"{name} mentions {path}, which does not exist"
    make_args = re.search(r"^TEST_ARGS \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_args, "the Makefile's test target lost its TEST_ARGS"
    assert f"python -m pytest -q {make_args.group(1)}" in readme, \
        "README.md's test command differs from what `make test` runs"
    assert shutil.which("bash")


FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lowercased, punctuation dropped,
    spaces as hyphens; a repeated heading gets -1, -2, ..."""
    slugs, counts = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = counts[slug] = counts.get(slug, -1) + 1
        slugs.add(f"{slug}-{n}" if n else slug)
    return slugs


def test_markdown_links_resolve():
    """Every relative link of README.md and docs/*.md, `[text](path)` or `[text](path#anchor)`,
    names a file that exists and, for a markdown page, one of its headings."""
    broken = []
    for page in MARKDOWN:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not file.exists():
                broken.append(f"{where}: no file {os.path.relpath(file, ROOT)}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{where}: no heading #{anchor} in {os.path.relpath(file, ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)
