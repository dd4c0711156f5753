#!/usr/bin/env bash
# `make demo`: the quick start on a machine with only Python.
#
#   1. installs what is missing: torch 2.13.0 if torch is not importable, then
#      pip install -e '.[dev]' if ptdp or one of its dependencies is missing;
#   2. builds, only if absent or older than their inputs:
#        demo/corpus.jsonl          English prose from the Python stdlib's docstrings
#        demo/tokenizer.model       a 512-token sentencepiece BPE tokenizer
#        demo/gpt_demo.{bin,idx}    the tokenised corpus (indexed dataset)
#   3. trains the tiny GPT of configs/gpt_demo.yaml (DEMO_MODEL=bert: the tiny BERT of
#      configs/bert_demo.yaml, on demo/bert_demo.{bin,idx}; DEMO_MODEL=llama: the tiny Llama-style
#      decoder of configs/llama_demo.yaml, on the GPT data; DEMO_MODEL=moe: its mixture-of-experts
#      form, configs/moe_tiny.yaml, with e = 2 expert ranks) with (p, t, d) = (2, 2, 2) on 8 local CPU
#      ranks (gloo) into a new run folder demo/runs/<date-time>/ (metrics.jsonl, config.yaml,
#      checkpoints/);
#   4. prints the first and last loss and fails unless the loss fell clearly
#      (last <= DEMO_MAX_RATIO x first, default 0.8);
#   5. prints a sample of text from the trained model (ptdp generate; not for BERT).
#
#   tools/demo.sh [--setup] [key=value ...]     (--setup: step 1 only; overrides go to ptdp train)
#
# Safe to re-run: data is reused and every run gets its own folder, so earlier runs are kept
# (`make clean` removes demo/). Environment: PYTHON [python3], DEMO_DIR [demo],
# DEMO_MAX_RATIO [0.8], DEMO_PROMPT ["Return the"], DEMO_MODEL [gpt] (gpt | bert | llama | moe).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
DEMO_DIR="${DEMO_DIR:-demo}"
DEMO_MODEL="${DEMO_MODEL:-gpt}"
[[ "$DEMO_MODEL" == gpt || "$DEMO_MODEL" == bert || "$DEMO_MODEL" == llama || "$DEMO_MODEL" == moe ]] || { echo "demo: error: DEMO_MODEL must be gpt, bert, llama or moe, got '$DEMO_MODEL'" >&2; exit 1; }
# A Llama-style decoder (and its mixture of experts) is a GPT with other blocks: the same data
# and launch script
DATA_MODEL="$DEMO_MODEL"; [[ "$DEMO_MODEL" == llama || "$DEMO_MODEL" == moe ]] && DATA_MODEL=gpt
CONFIG="configs/${DEMO_MODEL}_demo.yaml"; [[ "$DEMO_MODEL" == moe ]] && CONFIG=configs/moe_tiny.yaml
MAX_RATIO="${DEMO_MAX_RATIO:-0.8}"
# BERT's loss adds sentence order (ln 2 at chance, slow to fall): a looser default bar
[[ "$DEMO_MODEL" == bert && -z "${DEMO_MAX_RATIO:-}" ]] && MAX_RATIO=0.85
SETUP_ONLY=0
if [[ "${1:-}" == "--setup" ]]; then SETUP_ONLY=1; shift; fi

say() { echo "demo: $*"; }
die() { echo "demo: error: $*" >&2; exit 1; }
start=$SECONDS

# --- 1. dependencies ---------------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' on PATH; install Python >= 3.10 or set PYTHON=..."
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$("$PYTHON" --version 2>&1) is too old; ptdp needs Python >= 3.10"

pip_install() {
    "$PYTHON" -m pip --version >/dev/null 2>&1 \
        || die "$PYTHON has no pip; run '$PYTHON -m ensurepip --upgrade' (or install python3-pip) and retry"
    "$PYTHON" -m pip install "$@" \
        || die "pip install $* failed. If pip refused an 'externally managed' system Python, use a virtual environment: $PYTHON -m venv .venv && . .venv/bin/activate && make demo"
}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    say "torch is not importable: pip install torch==2.13.0"
    pip_install "torch==2.13.0"
fi
# ptdp counts as installed when pip knows it (an editable install of this or another checkout:
# the launch scripts put this checkout first on PYTHONPATH either way).
if ! "$PYTHON" - <<'EOF' >/dev/null 2>&1
import importlib.metadata, importlib.util, sys
importlib.metadata.version("ptdp")
missing = [m for m in ("yaml", "numpy", "tqdm", "sentencepiece", "pytest", "pytest_timeout", "xdist", "datasets",
                       "transformers", "safetensors", "matplotlib", "wandb")
           if importlib.util.find_spec(m) is None]
sys.exit(1 if missing else 0)
EOF
then
    say "installing ptdp and its dependencies: pip install -e '.[dev]'"
    pip_install -e ".[dev]"
fi
if [[ $SETUP_ONLY == 1 ]]; then
    say "dependencies ready ($((SECONDS - start)) s)"
    exit 0
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# --- 2. data -----------------------------------------------------------------------------------
mkdir -p "$DEMO_DIR"
corpus="$DEMO_DIR/corpus.jsonl"
tok_prefix="$DEMO_DIR/tokenizer"
data_prefix="$DEMO_DIR/${DATA_MODEL}_demo"
sentences=""; [[ "$DEMO_MODEL" == bert ]] && sentences="--split-sentences"   # BERT needs them

if [[ ! -s "$corpus" ]]; then
    say "building $corpus from the standard library's docstrings"
    "$PYTHON" tools/make_corpus.py --output "$corpus"
fi
if [[ ! -s "$tok_prefix.model" || "$corpus" -nt "$tok_prefix.model" ]]; then
    say "training the tokenizer $tok_prefix.model"
    "$PYTHON" -m ptdp tokenizer train --input "$corpus" --model-prefix "$tok_prefix" --vocab-size 512
fi
if [[ ! -s "$data_prefix.bin" || ! -s "$data_prefix.idx" || "$tok_prefix.model" -nt "$data_prefix.idx" ]]; then
    say "tokenising $corpus into $data_prefix.{bin,idx}"
    "$PYTHON" -m ptdp preprocess --input "$corpus" --tokenizer "$tok_prefix.model" \
        --output-prefix "$data_prefix" --json-key text --quiet $sentences
fi
say "data ready ($((SECONDS - start)) s)"

# --- 3. train ----------------------------------------------------------------------------------
run_dir="$DEMO_DIR/runs/$(date +%Y%m%d-%H%M%S)"
while [[ -e "$run_dir" ]]; do run_dir="$run_dir-x"; done   # two runs within one second
metrics="$run_dir/metrics.jsonl"
checkpoints="$run_dir/checkpoints"
mkdir -p "$run_dir"
say "training $CONFIG on 8 CPU ranks, (p, t, d) = (2, 2, 2), into $run_dir"
# Hide any GPU: the demo layout needs 8 ranks, which on this path are CPU processes.
CUDA_VISIBLE_DEVICES="" NPROC=8 GPUS_PER_NODE="" PYTHON="$PYTHON" \
    bash "tools/pretrain_$DATA_MODEL.sh" "$CONFIG" \
    data.paths="[$data_prefix]" data.tokenizer="$tok_prefix.model" \
    log.metrics_file="$metrics" checkpoint.dir="$checkpoints" "$@"

# --- 4. check ----------------------------------------------------------------------------------
"$PYTHON" - "$metrics" "$checkpoints" "$MAX_RATIO" "$((SECONDS - start))" <<'EOF'
import json, sys
from pathlib import Path
metrics, checkpoints, max_ratio, seconds = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
if not rows:
    sys.exit(f"demo: error: {metrics} has no iterations")
first, last = rows[0], rows[-1]
print(f"demo: {len(rows)} iterations in {seconds} s in all")
print(f"demo: first loss {first['loss']:.4f} (iter {first['iter']}), "
      f"last loss {last['loss']:.4f} (iter {last['iter']}), ratio {last['loss'] / first['loss']:.2f}")
latest = checkpoints / "latest"   # names the newest complete checkpoint (ptdp/checkpoint/layout.py)
saved = checkpoints / latest.read_text().strip() if latest.is_file() else None
if saved is None or not (saved / "metadata.json").is_file():
    sys.exit(f"demo: error: no complete checkpoint was written under {checkpoints}")
files = sum(1 for f in saved.iterdir() if f.is_file())
print(f"demo: checkpoint {saved} ({files} files); resume with checkpoint.load={checkpoints}")
if not last["loss"] <= max_ratio * first["loss"]:
    sys.exit(f"demo: error: the loss did not fall clearly: last {last['loss']:.4f} > "
             f"{max_ratio} x first {first['loss']:.4f}")
print(f"demo: OK, the loss fell from {first['loss']:.2f} to {last['loss']:.2f}")
EOF

# --- 5. a sample from the model ----------------------------------------------------------------
if [[ "$DEMO_MODEL" == bert ]]; then
    say "done in $((SECONDS - start)) s; this run is in $run_dir (earlier runs: $DEMO_DIR/runs/)"
    exit 0
fi
prompt="${DEMO_PROMPT:-Return the}"
say "a sample from the trained model: ptdp generate $checkpoints --prompt \"$prompt\" --max-new-tokens 40 --temperature 0.7 --top-k 40"
"$PYTHON" -m ptdp generate "$checkpoints" --prompt "$prompt" --max-new-tokens 40 \
    --temperature 0.7 --top-k 40 --device cpu
say "done in $((SECONDS - start)) s; this run is in $run_dir (earlier runs: $DEMO_DIR/runs/)"
