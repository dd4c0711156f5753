"""The rules `ptdp config from-megatron` follows beyond one argument at a time (ptdp/megatron/
moe_flags.py, script_converters.py, adjustments.py, launch_script.py, commands/config.py):
MoE arguments into ptdp's MoE keys, a refusal that shapes the model stopping the translation,
Megatron's run-time adjustments, batch schedules, the spellings of weights-only loading and
W&B, and a launch script's if/elif/else. Torch-free and in-process."""

from __future__ import annotations

import pytest

from ptdp import cli
from ptdp.megatron.launch_script import read_invocation
from ptdp.megatron.translate import translate

MOE = ["--num-experts", "8", "--disable-bias-linear", "--num-layers", "4"]


def moe_values(*words: str) -> dict:
    values = translate(MOE + list(words), defaults=False).values
    return {k: v for k, v in values.items() if k.startswith(("model.moe", "parallel.expert"))}


@pytest.mark.parametrize("words, expected", [
    ([], {}),   # Megatron's defaults (k = 2, softmax over the top k, no losses) are ptdp's
    (["--moe-router-topk", "4", "--moe-ffn-hidden-size", "96", "--moe-z-loss-coeff", "1e-3",
      "--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate",
      "--expert-model-parallel-size", "4", "--moe-router-topk-scaling-factor", "2.5"],
     {"model.moe_top_k": 4, "model.moe_ffn_hidden_size": 96, "model.moe_z_loss_coeff": 1e-3,
      "model.moe_shared_ffn_hidden_size": 128, "model.moe_shared_expert_gate": True,
      "parallel.expert": 4, "model.moe_routed_scaling_factor": 2.5}),
    (["--moe-router-pre-softmax"], {"model.moe_renormalize": False}),
    (["--moe-router-score-function", "sigmoid", "--moe-router-topk", "1"],
     {"model.moe_score_function": "sigmoid", "model.moe_renormalize": False, "model.moe_top_k": 1}),
    (["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--moe-router-bias-update-rate", "1e-2"],
     {"model.moe_score_function": "sigmoid", "model.moe_renormalize": True,
      "model.moe_expert_bias_rate": 1e-2}),
    (["--moe-router-enable-expert-bias"], {}),   # softmax: Megatron does not use the bias
    (["--moe-layer-freq", "2"], {"model.moe_layer_freq": 2}),
    (["--moe-layer-freq", "([0]*1+[1]*3)"],
     {"model.moe_first_dense_layers": 1, "model.moe_layer_freq": 1}),
    (["--moe-layer-freq", "[0,1,0,1]"], {"model.moe_first_dense_layers": 1,
                                          "model.moe_layer_freq": 2}),
    (["--moe-layer-freq", "[1,0,0,1]"], {"model.moe_layer_freq": 3}),   # Megatron's 3
    (["--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "1e-2"], {}),
    # token dropping (models/capacity.py)
    (["--moe-expert-capacity-factor", "1.25", "--moe-token-drop-policy", "position"],
     {"model.moe_capacity_factor": 1.25, "model.moe_drop_policy": "position"}),
    # DeepSeek-V3's sequence-wise balance loss, with sigmoid scores (renormalised for the loss
    # by both, models/balance.py)
    (["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
      "--moe-router-score-function", "sigmoid"],
     {"model.moe_aux_loss_scope": "sequence", "model.moe_aux_loss_coeff": 1e-4,
      "model.moe_score_function": "sigmoid", "model.moe_renormalize": True}),
    # DeepSeek-V3's node-limited routing (sigmoid scores), DeepSeek-V2's (pre-softmax)
    (["--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4",
      "--moe-router-group-topk", "2"],
     {"model.moe_score_function": "sigmoid", "model.moe_renormalize": True,
      "model.moe_router_groups": 4, "model.moe_router_group_top_k": 2}),
    (["--moe-router-pre-softmax", "--moe-router-num-groups", "4", "--moe-router-group-topk", "1"],
     {"model.moe_renormalize": False, "model.moe_router_groups": 4,
      "model.moe_router_group_top_k": 1}),
    (["--moe-router-num-groups", "4"], {}),   # Megatron limits nothing without the group top-k
])
def test_moe_arguments_become_ptdps_moe_keys(words, expected):
    assert moe_values(*words) == expected


@pytest.mark.parametrize("words, line, blocks", [
    (["--num-experts", "8"], "refused: --num-experts 8: Megatron's experts have biases without "
     "--disable-bias-linear; ptdp's experts have none", True),
    (MOE + ["--moe-expert-capacity-factor", "1.0", "--sequence-parallel"],
     "approximate: --moe-expert-capacity-factor 1.0: Megatron drops among each rank's tokens "
     "(sequence or context parallelism split them), ptdp among the micro-batch's", False),
    (MOE + ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
     "ignored: --moe-pad-expert-input-to-capacity: the padding rows are zeros with gate 0: the "
     "same results, and ptdp does not pad", False),
    (MOE + ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     "refused: --moe-router-num-groups 4: softmax scores without --moe-router-pre-softmax: "
     "Megatron ranks the groups by their logits, ptdp by their scores", True),
    (MOE + ["--moe-router-group-topk", "2"], "refused: --moe-router-group-topk 2: needs "
     "--moe-router-num-groups (Megatron's groups)", True),
    (MOE + ["--moe-latent-size", "4"], "refused: --moe-latent-size 4: not one of "
     "ptdp's MoE options (docs/moe.md)", True),
    (MOE + ["--moe-layer-freq", "[1,1,0,1]"], "refused: --moe-layer-freq [1,1,0,1]: ptdp's MoE "
     "layers are every n-th after the first dense ones (model.moe_first_dense_layers, "
     "model.moe_layer_freq)", True),
    (MOE + ["--moe-router-load-balancing-type", "global_aux_loss"], "refused: "
     "--moe-router-load-balancing-type global_aux_loss: 'global_aux_loss': ptdp's balancing is "
     "the Switch/GShard loss per micro-batch (aux_loss) or per sequence (seq_aux_loss), the "
     "z-loss and the expert bias", True),
    (["--moe-router-topk", "4"], "ignored: --moe-router-topk 4: Megatron uses it only with "
     "--num-experts", False),
    (["--apply-residual-connection-post-layernorm"],
     "refused: --apply-residual-connection-post-layernorm: ptdp's blocks are pre-norm", True),
    (["--decoupled-lr", "1e-3"], "refused: --decoupled-lr 1e-3: ptdp has one learning rate",
     False),
    (["--fp8-format", "hybrid", "--bf16"], "approximate: --fp8-format hybrid: ptdp has no FP8 "
     "matrix multiplications: trains in bf16", False),
])
def test_what_cannot_be_mapped_says_why_and_whether_it_changes_the_model(words, line, blocks):
    found = [x for x in translate(words, defaults=False).lines if str(x) == line]
    assert len(found) == 1 and found[0].blocks is blocks


def test_a_refusal_that_shapes_the_model_writes_no_config_unless_allowed(tmp_path, capsys):
    out = tmp_path / "c.yaml"
    words = ["--num-layers", "2", "--apply-residual-connection-post-layernorm", "--decoupled-lr", "1e-3"]
    assert cli.main(["config", "from-megatron", "--out", str(out), "--", *words]) == 2
    err = capsys.readouterr().err.splitlines()
    assert not out.exists() and err[-1] == (
        "ptdp config from-megatron: refused --apply-residual-connection-post-layernorm: it shapes the model and ptdp has no "
        "counterpart, so the config would be another model; none written (--allow-refused "
        "writes it without it)")
    assert "  refused: --decoupled-lr 1e-3: ptdp has one learning rate" in err
    assert cli.main(["config", "from-megatron", "--allow-refused", "--out", str(out), "--",
                     *words]) == 0 and out.exists()
    # a refusal that does not shape the model is listed, and the config written
    assert cli.main(["config", "from-megatron", "--out", str(out), "--", *words[:2],
                     *words[3:]]) == 0


@pytest.mark.parametrize("words, expected", [
    (["--no-load-optim", "--no-load-rng", "--load", "/m", "--save", "/p"],
     {"checkpoint.load_optimizer": False, "checkpoint.load_rng": False, "checkpoint.load": "/m"}),
    (["--finetune", "--load", "/m"], {"checkpoint.finetune": True, "checkpoint.load": "/m"}),
    (["--grad-reduce-in-bf16", "--bf16"], {"train.grad_reduce_dtype": "bf16",
                                           "train.precision": "bf16"}),
    (["--wandb-project", "p", "--wandb-exp-name", "run"],
     {"log.wandb_project": "p", "log.wandb_name": "run"}),
    (["--apply-layernorm-1p", "--openai-gelu"],
     {"model.norm_zero_centered": True, "model.activation": "gelu_tanh"}),
    (["--qk-layernorm"], {"model.qk_norm": True}),
    (["--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "32"],
     {"model.head_dim": 32}),   # (16 = 64 / 4 is ptdp's default: nothing written)
    ([], {"model.activation": "gelu_tanh"}),   # the fused bias-GeLU, Megatron's default
    (["--no-bias-gelu-fusion"], {"model.activation": None}),   # exact, as ptdp's default GeLU
    # megatron-core ignores --openai-gelu: the unfused GeLU stays exact (as `convert` reads it)
    (["--openai-gelu", "--no-bias-gelu-fusion"], {"model.activation": None}),
    (["--disable-bias-linear"], {"model.activation": None}),   # no biases: no fused GeLU
])
def test_megatron_spellings_of_the_new_keys(words, expected):
    values = translate(words).values
    assert {k: values.get(k) for k in expected} == expected


def test_megatrons_run_time_adjustments_are_applied_with_a_note():
    t = translate(["--sequence-parallel", "--tensor-model-parallel-size", "1"])
    assert "parallel.sequence_parallel" not in t.values
    assert any(str(x).startswith("note: --sequence-parallel: not written: Megatron-LM turns "
                                 "sequence parallelism off") for x in t.lines)
    assert translate(["--sequence-parallel", "--tensor-model-parallel-size", "2"]).values[
        "parallel.sequence_parallel"] is True
    assert "checkpoint.async_save" not in translate(["--async-save"]).values
    assert translate(["--async-save", "--use-persistent-ckpt-worker"]).values[
        "checkpoint.async_save"] is True
    bert = translate(["pretrain_bert.py", "--data-path", "/d/x", "--openai-gelu"])
    assert "data.sampling" not in bert.values and "model.activation" not in bert.values
    assert translate(["pretrain_gpt.py", "--data-path", "/d/x"]).values["data.sampling"] == "megatron"
    blocked = translate(["pretrain_bert.py", "--apply-layernorm-1p"])
    assert "model.norm_zero_centered" not in blocked.values and len(blocked.blocking) == 1


def test_a_ramp_in_an_iteration_run_is_counted_in_samples():
    v = translate(["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
                   "--train-iters", "10", "--lr-warmup-iters", "2", "--lr-decay-iters",
                   "9"]).values
    # Megatron's ramp: +2 every 4 samples up to 12: batches 2, 2, 4, 6, then six of 8: 62
    assert (v["train.train_samples"], v["train.rampup_batch_size"]) == (62, [2, 2, 12])
    assert (v["train.lr_warmup_samples"], v["train.lr_decay_samples"]) == (16, 72)
    assert not {"train.iters", "train.lr_warmup_iters", "train.lr_decay_iters"} & set(v)


@pytest.mark.parametrize("schedule, expected", [
    ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536",       # Megatron-LM's GPT-3 example
     {"train.rampup_batch_size": [16, 304, 5859375], "train.global_batch_size": 1536}),
    ("0:1536", {"train.global_batch_size": 1536}),
    ("0:768 250B:1536 500B:3072 750B:6144", "refused: --step-batch-size-schedule 0:768 250B:1536 "
     "500B:3072 750B:6144: ptdp's batch ramp (train.rampup_batch_size) grows by equal "
     "increments at equal sample intervals; this schedule does not"),
])
def test_a_step_batch_size_schedule_is_a_ramp_or_refused(schedule, expected):
    t = translate(["--seq-length", "2048", "--train-samples", "10000000000",
                   "--step-batch-size-schedule", schedule], defaults=False)
    if isinstance(expected, str):
        assert [str(x) for x in t.lines] == [expected] and not t.blocking
    else:
        assert {k: t.values.get(k) for k in expected} == expected


SCRIPT = r"""#!/bin/bash
MODE=${1:-"small"}
USE_FP16=${USE_FP16:-}
ARGS=(--num-layers 2)
if [[ "$MODE" == "big" ]]; then
    ARGS+=(--hidden-size 1024)
elif [ "$MODE" != "tiny" ] && [[ -n "$MODE" ]]; then
    ARGS+=(--hidden-size 64)
    if [ -f /etc/hostname ]; then
        ARGS+=(--num-attention-heads 4)
    fi
else
    ARGS+=(--hidden-size 8)
fi
if [ -n "${WANDB_API_KEY}" ]; then
    ARGS+=(--wandb-project p)
fi
if [ ! -f pretrain_gpt.py ]; then
    echo "not found"
fi
if [[ "$MODE" == "small" ]]; then ARGS+=(--seq-length 32); else ARGS+=(--seq-length 8); fi
torchrun pretrain_gpt.py "${ARGS[@]}"
"""


def test_a_scripts_branches_follow_its_own_values_and_are_named(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text(SCRIPT)
    inv = read_invocation(path)
    # the elif is taken (MODE defaults to small); the nested file test and W&B: no branch
    assert inv.words == ["torchrun", "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                         "--seq-length", "32"]
    assert inv.branches == [
        ("if [ -f /etc/hostname ]", "no branch applied: it tests no variable (a file or a "
                                    "command); add the arguments of the branch that applies by "
                                    "hand"),
        ('if [[ "$MODE" == "big" ]]', "only the 'elif [ \"$MODE\" != \"tiny\" ] && [[ -n "
         "\"$MODE\" ]]' branch applied: it tests MODE=small (the default of $1); change these "
         "and translate again for another branch"),
        ('if [ -n "${WANDB_API_KEY}" ]', "no branch applied: it tests WANDB_API_KEY (not set "
                                         "in the script); add the arguments of the branch that "
                                         "applies by hand"),
        ('if [[ "$MODE" == "small" ]]', "only the 'then' branch applied: it tests MODE=small "
                                        "(the default of $1); change these and translate again "
                                        "for another branch")]
