#!/usr/bin/env bash
# The GPU check, one command on one GPU (about 7 minutes on one H200, compilation included:
# its stages took 82 + 119 + 91 + 38 s, and 102 + 111 + 105 + 33 s on a later run, on
# 2026-11-27; with paired rounds and the kernel stages 96 + 132 + 105 + 34 + 22 + 10 s, 412 s
# in all; with regions of 8 layers, 94 + 149 + 121 + 42 + 22 + 9 + 22 s, 472 s; on
# 2026-11-28 104 + 171 + 121 + 42 + 22 + 11 + 25 s, BERT then still without CUDA graphs; the
# budget leaves slack inside a 10-minute command limit and stops the last stages first):
#   0. pre-flight (fails fast): CUDA visible, free GPU memory, Triton's compiler, pytest;
#   1. the GPU tier of the suite (PTDP_GPU_TESTS=1 pytest -m gpu, tests/gpu/), over 4
#      processes when pytest-xdist is installed (most of its time is compiling, on the CPU);
#   2. tools/bench_gpu.py for GPT-1.3B and BERT-large against their references (BERT-large as
#      configs/bert_large.yaml trains it, its regions replayed as CUDA graphs), each with one
#      profiled step per model (OUT/profile_<arch>_<model>.txt: where each step's time goes,
#      by device and by host time; .trace.json.gz beside it, the step's timeline);
#   3. ptdp plan's predicted step time and memory against measured ones for two layouts
#      (tools/gpu_check.py plan --measure);
#   4. candidates, measured before they are built: each SDPA kernel for GPT-1.3B's causal
#      attention against torch's pick (tools/bench_attention_backends.py), its weight gradients
#      accumulated into main_grad by the GEMM against GEMM + add (tools/bench_wgrad_fusion.py);
#   5. the loss, fused against eager (tools/bench_cross_entropy.py), BERT's heads on the
#      masked positions against every token (tools/bench_bert_head.py), at the two models'
#      shapes, and GPT-1.3B's MLP block on token rows against [s, b, h]
#      (tools/bench_mlp_chain.py --kernels);
# then one JSON and one Markdown table (tools/gpu_check.py report): OUT/gpu_check.json and
# OUT/gpu_check.md, each target with its measured value and whether it is met.
#
#   tools/gpu_check.sh [--dry-run] [--out DIR]
#
# --dry-run: print each stage's command and run only what needs no GPU (the planner's
# predictions and the report), e.g. on a CPU machine to check the script itself; its files go
# to a fresh temporary folder unless OUT or --out names one (not into the checkout).
# Offline machines: what the GPU machine lacks is fetched beforehand on a machine with
# network, into the ignored folder .whl/ of the repository (the lent H100/H200 image, Python
# 3.12 with torch 2.11 and transformers, has pytest, pytest-timeout and pytest-xdist: nothing
# to fetch there;
# the pre-flight names whatever is missing):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform any -d .whl pytest pytest-timeout pluggy iniconfig packaging
# and installed from there (no network) into a private folder before the stages run.
# Environment: PYTHON [python3]; OUT [bench/gpu_check/<date-time>; a dry run: a temporary
# folder]; WHEELS [.whl]; BUDGET_S,
# the whole run's limit [470]; STAGES, the stages to run
# [gpu_tier,bench_gpt,bench_bert,plan,attention,wgrad,loss,bert_head,mlp_chain] (to rerun what
# a cut-short run missed; `bert_eager`, BERT-large without train.cuda_graphs against Hugging
# Face, runs only when named: EAGER_S 170);
# each stage stops at its share (TIER_S 160, GPT_S 190, BERT_S 150, PLAN_S 50: what each took
# on one H200, 2026-11-27, 82, 119, 91 and 38 s, with room for an H100's slower memory where
# the step is longest, and for bench_gpu's paired rounds: GPT took 132 s with them, BERT 105;
# 30 s more each for compiling regions of 8 layers, and 40 s more for the tier's three new
# compiled tests: the fifth run took 149, 121 and 94 s there; BERT with CUDA graphs took 57 s
# unprofiled, on a warm compile cache, on 2026-11-28; ATTN_S 30, WGRAD_S 20: eager kernels,
# unmeasured; LOSS_S 25,
# HEAD_S 25: about 12 s each there; MLP_S 25, three compiled MLP blocks) or at what the
# budget has left, whichever is less, with SIGINT first (pytest then still writes its junit
# file, bench_gpu.py has written each model's row as it went), and the report says which
# stopped.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-}"
DRY_RUN=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (--dry-run, --out DIR)" >&2; exit 2 ;;
    esac
done
if [[ -z "$OUT" ]]; then
    if [[ "$DRY_RUN" -eq 1 ]]; then OUT="$(mktemp -d -t gpu_check-dry-run.XXXXXX)"
    else OUT="bench/gpu_check/$(date +%Y%m%d-%H%M%S)"; fi
fi
BUDGET_S="${BUDGET_S:-470}"
for name in BUDGET_S TIER_S GPT_S BERT_S PLAN_S ATTN_S WGRAD_S LOSS_S HEAD_S MLP_S EAGER_S; do   # seconds
    value="${!name:-1}"
    if ! [[ "$value" =~ ^[1-9][0-9]*$ ]]; then
        echo "gpu_check.sh: $name='$value' is not a whole number of seconds" >&2
        exit 2
    fi
done
ALL_STAGES="gpu_tier,bench_gpt,bench_bert,plan,attention,wgrad,loss,bert_head,mlp_chain"
ON_REQUEST="bert_eager"   # only when STAGES names it
STAGES="${STAGES:-$ALL_STAGES}"
for name in ${STAGES//,/ }; do   # a misspelt stage would silently run nothing
    if [[ ",$ALL_STAGES,$ON_REQUEST," != *",$name,"* ]]; then
        echo "gpu_check.sh: STAGES names '$name'; the stages are ${ALL_STAGES//,/, }" \
             "(and on request ${ON_REQUEST//,/, })" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
STAGES_FILE="$OUT/stages.tsv"
: > "$STAGES_FILE"

WHEELS="${WHEELS:-$ROOT/.whl}"
INSTALL=("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
         --target "$OUT/site")
if [[ "$DRY_RUN" -eq 0 ]]; then
    if compgen -G "$WHEELS/*.whl" > /dev/null; then   # offline: the wheels fetched beforehand
        "${INSTALL[@]}" "$WHEELS"/*.whl || { echo "gpu_check.sh: installing $WHEELS failed" >&2; exit 2; }
        export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # Pre-flight: each missing piece is one line, before any stage spends the budget.
    if ! "$PYTHON" - <<'PREFLIGHT' >&2
import importlib.util, shutil, sys
import torch
problems = []
if not torch.cuda.is_available():
    problems.append("no CUDA device is visible (use --dry-run to check the script)")
else:
    free, total = torch.cuda.mem_get_info(0)
    print(f"gpu_check.sh: {torch.cuda.get_device_name(0)}, {free / 2**30:.0f} of "
          f"{total / 2**30:.0f} GiB free, torch {torch.__version__}")
    if free < 0.8 * total:
        problems.append(f"only {free / 2**30:.0f} GiB of {total / 2**30:.0f} GiB is free: "
                        "another process holds the GPU")
for module in ("triton", "pytest", "pytest_timeout", "transformers"):
    if importlib.util.find_spec(module) is None:
        problems.append(f"python module '{module}' is missing (fetch it into .whl/, see --help)")
if shutil.which("cc") is None and shutil.which("gcc") is None:
    problems.append("no C compiler (cc/gcc): Triton cannot build its launchers")
for line in problems:
    print(f"gpu_check.sh: pre-flight: {line}")
sys.exit(1 if problems else 0)
PREFLIGHT
    then
        exit 2
    fi
    DEVICE="$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")"
else
    DEVICE="dry run (no GPU used)"
    if compgen -G "$WHEELS/*.whl" > /dev/null; then   # the offline step as a real run takes it
        echo "[dry run] offline install: ${INSTALL[*]} $WHEELS/*.whl ($(compgen -G "$WHEELS/*.whl" | wc -l) wheels)"
    else
        echo "[dry run] offline install: none ($WHEELS holds no wheels: the machine's own packages; the fetch command: --help)"
    fi
fi

# stage NAME SECONDS COMMAND...: run it under `timeout`, for at most what the budget has left
stage() {
    local name="$1" share="$2"; shift 2
    if [[ ",$STAGES," != *",$name,"* ]]; then
        printf '%s\tnot run\t0\n' "$name" >> "$STAGES_FILE"
        return 0
    fi
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    local limit=$(( share < left ? share : left ))
    if [[ "$DRY_RUN" -eq 1 ]]; then
        echo "[dry run] $name (at most ${share} s): $*"
        printf '%s\tdry-run\t0\n' "$name" >> "$STAGES_FILE"
        return 0
    fi
    if [[ "$limit" -le 10 ]]; then
        echo "gpu_check.sh: $name skipped: the ${BUDGET_S} s budget is spent" >&2
        printf '%s\tskipped\t0\n' "$name" >> "$STAGES_FILE"
        return 0
    fi
    echo "gpu_check.sh: $name (at most ${limit} s): $*" >&2
    local t0 rc
    t0=$(date +%s)
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [[ "$rc" -eq 124 || "$rc" -eq 137 ]] && echo "gpu_check.sh: $name stopped after ${limit} s" >&2
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STAGES_FILE"
    tail -n 3 "$OUT/$name.log" >&2
}

# The tier's tiny bench_gpu test is left to the bench stages, which run that script at scale.
TIER_ARGS=(--deselect tests/gpu/test_gpu_tier.py::test_bench_gpu_tiny_on_cuda)
if "$PYTHON" -c "import xdist" 2> /dev/null; then TIER_ARGS+=(-n 4); fi
stage gpu_tier "${TIER_S:-160}" env PTDP_GPU_TESTS=1 "$PYTHON" -m pytest -m gpu tests/gpu -q \
    -p no:cacheprovider --junitxml "$OUT/gpu_tier.xml" "${TIER_ARGS[@]}"
stage bench_gpt "${GPT_S:-190}" "$PYTHON" tools/bench_gpu.py --device cuda --arch gpt \
    --steps 6 --warmup 3 --json "$OUT/bench_gpt.json" --profile "$OUT"
# BERT-large as configs/bert_large.yaml trains it: its regions replayed as CUDA graphs
stage bench_bert "${BERT_S:-150}" "$PYTHON" tools/bench_gpu.py --device cuda --arch bert \
    --steps 6 --warmup 3 --cuda-graphs --json "$OUT/bench_bert.json" --profile "$OUT"
if [[ ",$STAGES," == *",bert_eager,"* ]]; then   # BERT-large without train.cuda_graphs
    stage bert_eager "${EAGER_S:-170}" "$PYTHON" tools/bench_gpu.py --device cuda --arch bert \
        --steps 6 --warmup 3 --json "$OUT/bench_bert_eager.json"
fi
if [[ "$DRY_RUN" -eq 1 && ",$STAGES," == *",plan,"* ]]; then   # the planner's half needs no GPU
    "$PYTHON" tools/gpu_check.py plan --out "$OUT" --hardware h100-80gb
    printf 'plan\t%s\t0\n' "$?" >> "$STAGES_FILE"
else
    stage plan "${PLAN_S:-50}" "$PYTHON" tools/gpu_check.py plan --out "$OUT" --measure
fi
# Candidates, measured before they are built: another SDPA kernel for GPT's attention, and the
# weight-gradient GEMM accumulating into main_grad (eager kernels, nothing to compile)
stage attention "${ATTN_S:-30}" "$PYTHON" tools/bench_attention_backends.py --device cuda \
    --json "$OUT/attention.json"
stage wgrad "${WGRAD_S:-20}" "$PYTHON" tools/bench_wgrad_fusion.py --device cuda \
    --json "$OUT/wgrad.json"
stage loss "${LOSS_S:-25}" "$PYTHON" tools/bench_cross_entropy.py --device cuda \
    --json "$OUT/loss.json"
stage bert_head "${HEAD_S:-25}" "$PYTHON" tools/bench_bert_head.py --device cuda \
    --json "$OUT/bert_head.json"
stage mlp_chain "${MLP_S:-25}" "$PYTHON" tools/bench_mlp_chain.py --device cuda --kernels \
    --json "$OUT/mlp_chain.json"

"$PYTHON" - "$STAGES_FILE" "$OUT/stages.json" "$DEVICE" "$START" <<'EOF'
import json, sys, time
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
stages = {name: {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": float(s)}
          for name, rc, s in rows}
json.dump({"device": sys.argv[3], "started": time.strftime("%Y-%m-%d %H:%M:%S",
           time.localtime(int(sys.argv[4]))), "elapsed_s": time.time() - int(sys.argv[4]),
           "stages": stages}, open(sys.argv[2], "w"), indent=2)
EOF
"$PYTHON" tools/gpu_check.py report --dir "$OUT"
echo "gpu_check.sh: $OUT/gpu_check.json and $OUT/gpu_check.md ($(( $(date +%s) - START )) s)" >&2
