"""The house rules of docs/architecture.md, read from the code's own imports (no code is run):
no import cycle, packages import only downwards, the pure packages stay pure, no module over
500 lines, the package list of pyproject.toml equals the folders, and no schedule name or
parameter-role attribute is spelled out outside the one place that defines it."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

from tests.background import end, finish, start
from tests.deadline import within

ROOT = Path(__file__).resolve().parents[1]

# The packages from the ground up (docs/architecture.md, "Floors"): a package imports itself and
# packages of lower floors only.
FLOORS = [
    ["__init__", "config", "hardware", "kernels"],
    ["parallel"],
    ["models", "optim", "data", "runtime", "planner"],
    ["pipeline"],
    ["metrics"],
    ["checkpoint"],
    ["training", "inference", "checks", "job_summary"],
    ["hf", "megatron", "profiler"],
    ["commands"],
    ["cli"],
    ["__main__"],
]
FLOOR_OF = {package: i for i, floor in enumerate(FLOORS) for package in floor}


def _modules() -> dict[str, Path]:
    """Module name -> file, for ptdp/ and models/ (installed as ptdp.models)."""
    out = {}
    for path in sorted((ROOT / "ptdp").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "models").glob("*.py")):
        stem = path.stem
        out["ptdp.models" if stem == "__init__" else f"ptdp.models.{stem}"] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every project module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


GRAPH = {module: _imports(path) - {module} for module, path in MODULES.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1].removesuffix(".py")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return out


def test_the_module_graph_has_no_cycle():
    assert _cycles(GRAPH) == []


def test_every_package_has_a_floor():
    packages = {_package(m) for m in MODULES}
    assert packages == set(FLOOR_OF), (packages ^ set(FLOOR_OF))


def test_packages_import_only_downwards():
    upward = [f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
              if _package(a) != _package(b) and FLOOR_OF[_package(b)] >= FLOOR_OF[_package(a)]]
    assert upward == []


@pytest.mark.parametrize("package, allowed", [
    ("config", set()),                                   # torch-free ground
    ("hardware", set()),
    ("planner", {"config", "hardware"}),                 # torch-free: `ptdp plan` runs anywhere
    ("models", {"parallel", "config", "kernels"}),       # one model, any layout
    ("pipeline", {"config", "parallel", "optim", "runtime"}),   # knows nothing about GPT
])
def test_pure_packages_import_only_what_they_may(package, allowed):
    wrong = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() if _package(a) == package
                   for b in targets if _package(b) not in allowed | {package})
    assert wrong == []


def test_no_module_is_over_500_lines():
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def test_pyproject_installs_every_package_and_no_top_level_models():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert listed == on_disk
    assert config["package-dir"] == {"ptdp.models": "models"}
    assert not any(name == "models" or name.startswith("models.") for name in listed)


def test_architecture_doc_names_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(p for p in FLOOR_OF if p not in ("__init__", "__main__", "cli")
                     and f"ptdp/{p}" not in text and f"`{p}`" not in text
                     and not (p == "models" and "models/" in text))
    assert missing == []


def _spelled(names, skip: str, also=lambda node: None) -> list[str]:
    """'module:line what' for every string constant equal to one of `names` in ptdp/ and
    models/ outside module `skip`, and for every node `also` describes (a non-empty text)."""
    found = []
    for module, path in MODULES.items():
        if module == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{module}:{node.lineno} {node.value!r}")
            elif what := also(node):
                found.append(f"{module}:{node.lineno} {what}")
    return found


def test_schedule_names_and_role_attributes_are_spelled_in_one_place():
    """Code asks the catalogue and `role_of`; names appear only as user-facing text."""
    from ptdp.config.catalogue import NAMES
    roles = ("tp_split_dim", "vocab_padded", "shared_embedding", "duplicate", "sequence_parallel",
             "reduce_axes")

    def reads_a_role(node) -> str | None:
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr")
                and len(node.args) > 1 and getattr(node.args[1], "value", None) in roles):
            return f"getattr(..., {node.args[1].value!r})"
        return None

    assert _spelled(NAMES, "ptdp.config.catalogue", reads_a_role) == []


def test_a_command_that_fails_to_import_is_an_error(monkeypatch):
    from ptdp import cli
    monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "ptdp.commands.nonexistent"])
    with pytest.raises(ModuleNotFoundError, match="ptdp.commands.nonexistent"):
        cli.build_parser()


def test_every_command_module_registers_a_command():
    from ptdp import cli
    listed = {m.rpartition(".")[2] for m in cli.COMMAND_MODULES}
    on_disk = {p.stem for p in (ROOT / "ptdp" / "commands").glob("*.py") if p.stem != "__init__"}
    assert listed == on_disk


def _reads_arch(node: ast.AST) -> bool:
    """`x.arch` or a variable named `arch`: model.arch's value, a family's name."""
    return (isinstance(node, ast.Attribute) and node.attr == "arch") or \
        (isinstance(node, ast.Name) and node.id == "arch")


def test_model_family_names_are_spelled_only_in_the_model_catalogue():
    """Code asks a family's traits (`cfg.model.family.causal`, `.samples`, `.heads`, ...) or
    names a catalogue entry (`GPT.name`, `DEFAULT_PRESET`); it never spells a family's name nor
    compares model.arch. Outside ptdp/config/models.py, in ptdp/ and models/, a literal is a
    string constant equal to a name of `FAMILY_NAMES` ('gpt', 'bert'); text that only contains
    one (messages, docstrings, the text parts of f-strings) is not. A comparison is ==, !=, in
    or not in with `x.arch` or `arch` on either side."""
    from ptdp.config.models import FAMILY_NAMES

    def compares_arch(node) -> str | None:
        sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
        return "compares model.arch" if any(map(_reads_arch, sides)) else None

    assert _spelled(FAMILY_NAMES, "ptdp.config.models", compares_arch) == []


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def test_stage_placement_is_computed_only_by_the_stage_map():
    """Which rank holds a stage is the schedule's placement (`ScheduleSpec.stage_map`,
    ptdp/config/stages.py); nothing else works it out with `stage % p`, `stage // p` or
    `rank + chunk * p`, which would silently assume the round-robin placement."""
    pipeline = {"p", "pipeline", "pp"}
    found = []
    files = {**MODULES, **{f"tools.{p.stem}": p for p in (ROOT / "tools").glob("*.py")}}
    for module, path in files.items():
        if module == "ptdp.config.stages":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.BinOp):
                continue
            left, right = _names(node.left), _names(node.right)
            by_stage = (isinstance(node.op, (ast.Mod, ast.FloorDiv))
                        and any("stage" in n for n in left) and right & pipeline)
            by_chunk = isinstance(node.op, ast.Mult) and (
                "chunk" in left and right & pipeline or "chunk" in right and left & pipeline)
            if by_stage or by_chunk:
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def test_tools_stay_under_500_lines_and_leave_sys_path_alone():
    """tools/*.py: no module over 500 lines, and none touches sys.path (they import the installed
    ptdp, and their siblings as tools/harness.py's docstring says)."""
    long, touches = {}, []
    for path in sorted((ROOT / "tools").glob("*.py")):
        text = path.read_text()
        if (n := len(text.splitlines())) > 500:
            long[path.name] = n
        touches += [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert long == {}
    assert touches == []


def test_process_groups_are_built_only_by_the_grid():
    """Every process group comes from ptdp/parallel/grid.py (named axes, one creation order
    on every rank); nothing else calls torch's group constructors."""
    builders = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
                "init_device_mesh", "DeviceMesh"}
    found = []
    for module, path in MODULES.items():
        if module == "ptdp.parallel.grid":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (getattr(node, "attr", None) if isinstance(node, ast.Attribute)
                    else getattr(node, "id", None) if isinstance(node, ast.Name)
                    else node.name if isinstance(node, ast.alias) else None)
            if name in builders:
                found.append(f"{module}:{getattr(node, 'lineno', '?')} {name}")
    assert found == []


def test_collectives_new_in_torch_come_through_their_fallbacks():
    """`dist.all_gather_single` and `dist.reduce_scatter_single` exist only in torch releases
    after 2.11, the GPU machines' one: code calls ptdp/parallel/mappings.py's names, which fall
    back to all_gather_into_tensor and reduce_scatter_tensor."""
    newer = {"all_gather_single", "reduce_scatter_single"}
    found = [f"{module}:{node.lineno} dist.{node.attr}"
             for module, path in MODULES.items() if module != "ptdp.parallel.mappings"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in newer
             and isinstance(node.value, ast.Name) and node.value.id == "dist"]
    assert found == []


# ------------------------------------------------------------------ commands run in processes

# A source checkout's imports, run with PYTHONPATH=the repository and no install.
SOURCE_CHECKOUT = (
    "import sys\n"   # drop the editable install's finder, as if nothing were installed
    "sys.meta_path = [f for f in sys.meta_path if 'editable' not in str(f)]\n"
    f"sys.path.insert(0, {str(ROOT)!r})\n"
    "import ptdp.models.gpt, ptdp.training\n"
    "print(ptdp.models.gpt.__file__)\n")


@pytest.fixture(scope="module", autouse=True)
def launched(tmp_path_factory):
    """The two commands the last tests below run, started as the module starts: each is
    seconds of one core importing torch, while the module's other tests read code in this
    process."""
    procs = {"help": start([sys.executable, "-m", "ptdp", "--help"]),
             "source checkout": start([sys.executable, "-c", SOURCE_CHECKOUT],
                                      cwd=tmp_path_factory.mktemp("checkout"))}
    yield procs
    end(procs.values())


def test_ptdp_help_lists_every_command(launched):
    out = finish(launched["help"], within(60))
    assert out.returncode == 0, out.stderr
    for command in ("train", "check", "plan", "profile", "tokenizer", "preprocess", "timeline",
                    "convert", "generate", "plot", "config"):
        assert re.search(rf"^\s+{command}\b", out.stdout, re.M), command


def test_a_source_checkout_imports_ptdp_models_without_an_install(launched):
    """PYTHONPATH=the repository, no install: ptdp.models is still models/ (ptdp/__init__.py)."""
    out = finish(launched["source checkout"], within(120))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(ROOT / "models" / "gpt.py")
