"""ptdp.planner stays pure: planning imports no torch (and neither does the hardware catalogue
it shares with the trainer)."""

import subprocess
import sys


def test_planner_imports_no_torch():
    code = ("import pkgutil, sys, importlib, ptdp.planner, ptdp.hardware\n"
            "for mod in pkgutil.iter_modules(ptdp.planner.__path__):\n"
            "    importlib.import_module('ptdp.planner.' + mod.name)\n"
            "import ptdp.commands.profile\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"torch imported by the planner: {out.stdout.strip()}"


def test_ptdp_plan_runs_without_torch(tmp_path):
    # The whole `ptdp plan` command: parse, search, print, with torch made unimportable.
    model = tmp_path / "m.yaml"
    model.write_text("model: {arch: gpt, num_layers: 4, hidden_size: 256, num_heads: 8, "
                     "seq_length: 128, vocab_size: 1000}\n")
    code = ("import sys; sys.modules['torch'] = None\n"   # `import torch` now raises
            "from ptdp.cli import main\n"
            f"sys.exit(main(['plan', {str(model)!r}, '--hardware', 'a100-80gb', '--gpus', '8',"
            " '--global-batch-size', '16', '--top', '2']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "p=" in out.stdout
