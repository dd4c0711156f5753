"""Megatron-LM's command-line arguments and what each becomes in ptdp: ONE table.

Every row names a Megatron-LM argument (as megatron-core 0.16.1's `megatron/training/
arguments.py` spells it), the ptdp key it sets, how its value converts, its kind (exact,
approximate, ignored, refused) and, where Megatron's default differs from ptdp's, that default,
which the translation writes when the argument is absent, so a translated run behaves like the
Megatron run it came from. ptdp/megatron/translate.py applies the table; docs/migration.md's
argument table is generated from it (`ptdp config from-megatron --table`) and a test keeps the
two equal. Torch-free: `ptdp config from-megatron` runs anywhere in a fraction of a second.

The converters and the kinds are ptdp/megatron/converters.py's.
"""

from __future__ import annotations

from ptdp.megatron.converters import (
    APPROXIMATE, EXACT, IGNORED, REFUSED, Default, Differs, Unmapped, attention_dropout_default,
    choice, chunks, chunks_from_layers, const, consumed_by_tokenizer_type, data_paths, fp16_only,
    global_batch_default, hysteresis_default, ignore, integer,
    kv_heads, load, max_positions, megatron_ffn_hidden_size, merge_file,
    no_position_embedding, number, only, query_groups, recompute_method, refuse, rope_scaling,
    rope_scaling_factor, seed, split, tokenizer, vocab_size)
from ptdp.megatron.latent_flags import LATENT_ARGS, not_with_latent, qk_layernorm
from ptdp.megatron.moe_flags import MOE_ARGS, expert_tensor_parallel
from ptdp.megatron.mtp_flags import MTP_ARGS
from ptdp.megatron.rows import Arg
from ptdp.megatron.recompute_modules import recompute_modules, selective_default
from ptdp.megatron.script_converters import (
    GELU_FUSION_DEFAULT, gelu_fusion, grad_reduce_in_bf16, head_size, low_precision, partial_load,
    step_schedule)
from ptdp.megatron.pipeline_layers import accounted, first_last, layout


# The table ---------------------------------------------------------------------------------
# Order matters only where a converter reads what another writes: none does (converters read
# Megatron's values in `given`), so rows are grouped as in Megatron's --help.

_PERF = "a performance option; ptdp's results do not depend on it"
_KERNEL = "a kernel choice; ptdp picks its own fused kernels"
_OWN = "approximate when --load is --save: ptdp resumes its own checkpoints whole"
_FORMAT = "checkpoint-format detail; ptdp writes its own format (ptdp convert --to megatron)"

ARGS: tuple[Arg, ...] = (
    # Parallel layout
    Arg("--tensor-model-parallel-size", "parallel.tensor", EXACT, integer),
    Arg("--model-parallel-size", "parallel.tensor", EXACT, integer,
        note="Megatron's old spelling of --tensor-model-parallel-size"),
    Arg("--pipeline-model-parallel-size", "parallel.pipeline", EXACT, integer,
        note="Megatron's non-interleaved schedule is 1F1B, ptdp's default"),
    Arg("--num-layers-per-virtual-pipeline-stage", "parallel.chunks", EXACT, chunks_from_layers,
        note="v = num-layers / (p x layers per virtual stage); schedule.name: interleaved"),
    Arg("--num-virtual-stages-per-pipeline-rank", "parallel.chunks", EXACT, chunks,
        note="schedule.name: interleaved when > 1"),
    Arg("--virtual-pipeline-model-parallel-size", "parallel.chunks", EXACT, chunks,
        note="older spelling of --num-virtual-stages-per-pipeline-rank"),
    Arg("--context-parallel-size", "parallel.context", EXACT, integer,
        note="both split each sequence into 2c chunks, two per rank"),
    Arg("--sequence-parallel", "parallel.sequence_parallel", EXACT, const(True), nargs=0),
    Arg("--use-distributed-optimizer", "train.distributed_optimizer", EXACT, const(True), nargs=0),
    Arg("--decoder-first-pipeline-num-layers", "parallel.stage_layers", EXACT, first_last,
        note="the first rank's layers, the rest even; each of a rank's v chunks holds 1/v"),
    Arg("--decoder-last-pipeline-num-layers", "parallel.stage_layers", EXACT, first_last,
        note="the last rank's layers, the rest even; each of a rank's v chunks holds 1/v"),
    Arg("--pipeline-model-parallel-layout", "parallel.stage_layers", EXACT, layout,
        note="E, t, L and m (MTP depths, on the last stage only) stages; also "
             "parallel.chunks = stages / p"),
    Arg("--account-for-embedding-in-pipeline-split", "parallel.stage_layers", EXACT, accounted,
        note="the embedding counts as a layer of an even split", nargs=0),
    Arg("--account-for-loss-in-pipeline-split", "parallel.stage_layers", EXACT, accounted,
        note="the loss counts as a layer of an even split", nargs=0),
    Arg("--overlap-grad-reduce", None, IGNORED,
        ignore("ptdp always overlaps its bucketed gradient all-reduce with backward"), nargs=0),
    Arg("--overlap-param-gather", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--overlap-param-gather-with-optimizer-step", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--no-overlap-p2p-communication", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--tp-comm-overlap", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--ddp-bucket-size", None, IGNORED, ignore(f"{_PERF} (train.grad_bucket_mb is ptdp's)")),
    Arg("--distributed-backend", None, IGNORED, ignore("ptdp uses NCCL on GPUs, gloo on CPUs")),
    Arg("--distributed-timeout-minutes", "train.timeout_s", APPROXIMATE,
        lambda v, g: Differs(60.0 * float(v), "ptdp's hang detector ends a job stuck this long"),
        note="minutes x 60; ptdp's hang detector ends a job stuck that long"),
    Arg("--local-rank", None, IGNORED, ignore("torchrun passes it in the environment")),
    Arg("--use-torch-fsdp2", None, REFUSED,
        refuse("ptdp has no FSDP; the distributed optimizer shards Adam's state"), nargs=0),
    Arg("--use-megatron-fsdp", None, REFUSED,
        refuse("ptdp has no FSDP; the distributed optimizer shards Adam's state"), nargs=0),
    Arg("--expert-model-parallel-size", "parallel.expert", EXACT, integer,
        note="folded out of the data (and context) ranks in both"),
    Arg("--expert-tensor-parallel-size", None, EXACT, expert_tensor_parallel,
        note="only --tensor-model-parallel-size (Megatron's default)"),
    # Model shape
    Arg("--num-layers", "model.num_layers", EXACT, integer),
    Arg("--encoder-num-layers", "model.num_layers", EXACT, integer, note="BERT's spelling"),
    Arg("--hidden-size", "model.hidden_size", EXACT, integer),
    Arg("--ffn-hidden-size", "model.ffn_hidden_size", EXACT, integer,
        default=Default(megatron_ffn_hidden_size, "int(8h/3 / 64) x 64 with --swiglu"),
        note="with --swiglu ptdp's own default rounds 8h/3 up to 256"),
    Arg("--num-attention-heads", "model.num_heads", EXACT, integer),
    Arg("--group-query-attention", "model.num_kv_heads", EXACT, kv_heads, nargs=0,
        note="K/V heads = --num-query-groups (Megatron's default 1)"),
    Arg("--num-query-groups", "model.num_kv_heads", EXACT, query_groups,
        note="with --group-query-attention"),
    Arg("--kv-channels", "model.head_dim", EXACT,
        not_with_latent(head_size, "latent attention's heads are --qk-head-dim / --v-head-dim"),
        note="written where it is not hidden-size / num-attention-heads"),
    Arg("--seq-length", "model.seq_length", EXACT, integer),
    Arg("--encoder-seq-length", "model.seq_length", EXACT, integer, note="BERT's spelling"),
    Arg("--max-position-embeddings", None, APPROXIMATE, max_positions,
        note="ptdp's position table has model.seq_length rows"),
    Arg("--position-embedding-type", "model.position_embedding", EXACT,
        choice({"learned_absolute": "learned", "rope": "rope"},
               "ptdp has learned and rotary positions")),
    Arg("--use-rotary-position-embeddings", "model.position_embedding", EXACT,
        const("rope"), nargs=0),
    Arg("--no-position-embedding", None, EXACT, no_position_embedding, nargs=0,
        note="only with rotary positions", model=True),
    Arg("--rotary-base", "model.rope_theta", EXACT, number),
    Arg("--rotary-percent", None, EXACT, only(1.0, "ptdp rotates the whole head"),
        note="only 1.0", model=True),
    Arg("--rotary-interleaved", None, REFUSED,
        refuse("ptdp rotates halves, not interleaved pairs"), nargs=0, model=True),
    Arg("--rotary-seq-len-interpolation-factor", None, REFUSED,
        refuse("ptdp has Llama-3 scaling only"), model=True),
    Arg("--use-rope-scaling", "model.rope_scaling_factor", EXACT,
        not_with_latent(rope_scaling, "megatron-core's latent attention does not read it"), nargs=0,
        note="Llama-3.1 scaling, factor --rope-scaling-factor (default 8)"),
    Arg("--rope-scaling-factor", "model.rope_scaling_factor", EXACT, rope_scaling_factor,
        note="with --use-rope-scaling"),
    Arg("--normalization", "model.normalization", EXACT,
        choice({"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}, "ptdp has LayerNorm and RMSNorm")),
    Arg("--norm-epsilon", "model.layernorm_eps", EXACT, number),
    Arg("--layernorm-epsilon", "model.layernorm_eps", EXACT,
        number, note="older spelling of --norm-epsilon"),
    Arg("--apply-layernorm-1p", "model.norm_zero_centered", EXACT, const(True), nargs=0,
        note="the norm's gain is 1 + w, w starting at 0"),
    Arg("--qk-layernorm", "model.qk_norm", EXACT, qk_layernorm, nargs=0,
        note="each query and key head normalised by the model's norm before rotary; with "
             "--multi-latent-attention the latents' norms instead"),
    Arg("--apply-residual-connection-post-layernorm", None, REFUSED,
        refuse("ptdp's blocks are pre-norm"), nargs=0, model=True),
    Arg("--fp32-residual-connection", None, APPROXIMATE,
        lambda v, g: Differs({}, "ptdp keeps the residual in the model's dtype, not fp32"),
        nargs=0, note="ptdp keeps the residual in the model's dtype, not fp32"),
    Arg("--swiglu", "model.activation", EXACT, const("swiglu"), nargs=0),
    Arg("--openai-gelu", None, IGNORED,
        ignore("megatron-core's GPT ignores it (Megatron-LM's legacy models only): its GeLU "
               "follows --bias-gelu-fusion"), nargs=0),
    Arg("--squared-relu", None, REFUSED, refuse("ptdp has GeLU, SwiGLU and GeGLU"), nargs=0, model=True),
    Arg("--window-size", None, REFUSED, refuse("the converter does not translate Megatron's "
                                                "sliding windows yet (model.sliding_window)"),
        model=True),
    Arg("--window-attn-skip-freq", None, REFUSED, refuse("only with --window-size"), model=True),
    Arg("--quick-geglu", None, REFUSED, refuse("ptdp's GeGLU gates with the tanh GeLU, not "
                                                        "the quick (sigmoid) GeLU"), nargs=0, model=True),
    Arg("--disable-bias-linear", "model.bias", EXACT, const(False), nargs=0),
    Arg("--add-qkv-bias", "model.qkv_bias", EXACT, const(True), nargs=0),
    Arg("--untie-embeddings-and-output-weights", "model.tie_embeddings", EXACT,
        const(False), nargs=0),
    Arg("--hidden-dropout", "model.dropout", EXACT, number, default=0.1,
        note="ptdp's default is 0"),
    Arg("--attention-dropout", "model.attention_dropout", EXACT, number,
        default=Default(attention_dropout_default, "0.1 (written when hidden dropout differs)"),
        note="null follows model.dropout"),
    Arg("--init-method-std", "model.init_std", EXACT, number,
        note="both scale output projections by 1/sqrt(2 x layers)"),
    Arg("--init-method-xavier-uniform", None, REFUSED,
        refuse("ptdp initialises from a normal distribution"), nargs=0, model=True),
    Arg("--make-vocab-size-divisible-by", None, EXACT,
        only(128, "ptdp pads the vocabulary to a multiple of 128 x t"),
        note="only 128: ptdp pads to 128 x t", model=True),
    Arg("--vocab-size", "model.vocab_size", EXACT,
        vocab_size, note="NullTokenizer: + 1 (its end-of-document id)"),
    Arg("--padded-vocab-size", None, IGNORED, ignore("ptdp pads model.vocab_size itself")),
    Arg("--bert-no-binary-head", None, REFUSED,
        refuse("ptdp's BERT always has the sentence-order head"), nargs=0, model=True),
    Arg("--spec", None, REFUSED, refuse("ptdp builds its own layers"), nargs="*", model=True),
    Arg("--yaml-cfg", None, REFUSED, refuse("pass the arguments it holds instead"), model=True),
    Arg("--transformer-impl", None, IGNORED, ignore(_KERNEL)),
    Arg("--attention-backend", None, IGNORED, ignore(_KERNEL)),
    Arg("--use-flash-attn", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--no-masked-softmax-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--no-bias-gelu-fusion", "model.activation", EXACT, gelu_fusion, nargs=0,
        default=GELU_FUSION_DEFAULT,
        note="Megatron's unfused GeLU is exact (model.activation gelu); its fused one, the "
             "default with biases, is the tanh approximation"),
    Arg("--no-bias-swiglu-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--no-bias-dropout-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--no-rope-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--no-persist-layer-norm", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--no-gradient-accumulation-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--cross-entropy-loss-fusion", None, IGNORED, ignore(_KERNEL), nargs=0),
    Arg("--no-async-tensor-model-parallel-allreduce", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--attention-softmax-in-fp32", None, IGNORED,
        ignore("ptdp's attention keeps softmax statistics in fp32"), nargs=0),
    Arg("--apply-query-key-layer-scaling", None, IGNORED,
        ignore("an fp16 overflow guard; the same attention"), nargs=0),
    Arg("--use-mcore-models", None, IGNORED, ignore("the same model in ptdp"), nargs=0),
    Arg("--use-legacy-models", None, IGNORED, ignore("the same model in ptdp"), nargs=0),
    Arg("--use-cpu-initialization", None, IGNORED,
        ignore("ptdp initialises each shard from the full tensor's stream"), nargs=0),
    Arg("--deterministic-mode", None, IGNORED, ignore(_KERNEL), nargs=0),
    *MOE_ARGS,   # ptdp/megatron/moe_flags.py
    *LATENT_ARGS,   # ptdp/megatron/latent_flags.py
    *MTP_ARGS,   # ptdp/megatron/mtp_flags.py
    # Precision
    Arg("--fp16", "train.precision", EXACT, const("fp16"), nargs=0),
    Arg("--bf16", "train.precision", EXACT, const("bf16"), nargs=0),
    Arg("--fp8-format", None, APPROXIMATE, low_precision("FP8"),
        note="ptdp has no FP8 matrix multiplications: trains in bf16 (--bf16) or fp16"),
    Arg("--fp4-format", None, APPROXIMATE, low_precision("FP4"),
        note="ptdp has no FP4 matrix multiplications: trains in bf16 (--bf16) or fp16"),
    Arg("--fp8-*", None, IGNORED, ignore("an FP8 option; ptdp trains without FP8 (--fp8-format)")),
    Arg("--fp4-*", None, IGNORED, ignore("an FP4 option; ptdp trains without FP4 (--fp4-format)")),
    Arg("--first-last-layers-bf16", None, IGNORED,
        ignore("an FP8 option; ptdp trains without FP8 (--fp8-format)"), nargs=0),
    Arg("--initial-loss-scale", "train.initial_loss_scale", EXACT,
        number, default=fp16_only(2.0 ** 32, "2^32"),
        note="ptdp's default is 2^16"),
    Arg("--loss-scale", None, REFUSED, refuse("ptdp's fp16 loss scale is always dynamic")),
    Arg("--min-loss-scale", None, EXACT,
        only(1.0, "ptdp's minimum loss scale is 1"), note="only 1"),
    Arg("--loss-scale-window", None, EXACT,
        only(1000.0, "ptdp doubles the scale after 1000 good steps"),
        note="only 1000"),
    Arg("--hysteresis", None, APPROXIMATE,
        lambda v, g: {} if int(v) == 1 else Differs({}, "ptdp halves the loss scale at every "
                                                        "overflow (--hysteresis 1)"),
        default=Default(hysteresis_default, "2 (noted with --fp16)"),
        note="1 is exact: ptdp halves the scale at every overflow"),
    Arg("--accumulate-allreduce-grads-in-fp32", None, EXACT, const({}), nargs=0,
        note="ptdp always accumulates and all-reduces fp32 gradients"),
    Arg("--grad-reduce-in-bf16", "train.grad_reduce_dtype", APPROXIMATE, grad_reduce_in_bf16,
        nargs=0, note="Megatron also accumulates in bf16; ptdp accumulates in fp32"),
    Arg("--fp16-lm-cross-entropy", None, IGNORED,
        ignore("ptdp computes the loss in fp32"), nargs=0),
    # Training
    Arg("--micro-batch-size", "train.micro_batch_size", EXACT, integer),
    Arg("--batch-size", "train.micro_batch_size", EXACT, integer, note="Megatron's old spelling"),
    Arg("--global-batch-size", "train.global_batch_size", EXACT, integer,
        default=Default(global_batch_default, "micro-batch-size x data-parallel size (noted)")),
    Arg("--rampup-batch-size", "train.rampup_batch_size", EXACT,
        lambda v, g: [int(x) for x in v], nargs=3),
    Arg("--step-batch-size-schedule", "train.rampup_batch_size", EXACT, step_schedule,
        nargs="*", note="where its steps are a ramp's (equal increments at equal intervals); "
                        "also train.global_batch_size"),
    Arg("--train-iters", "train.iters", EXACT, integer),
    Arg("--train-samples", "train.train_samples", EXACT, integer),
    Arg("--exit-interval", None, REFUSED, refuse("set train.iters")),
    Arg("--exit-duration-in-mins", None, REFUSED,
        refuse("ptdp has no time limit; the scheduler's ends the job")),
    Arg("--exit-signal-handler", None, IGNORED, ignore("ptdp saves on its own schedule"), nargs=0),
    Arg("--recompute-granularity", "train.recompute", EXACT,
        choice({"full": "full", "selective": "selective"}, "ptdp has full and selective")),
    Arg("--recompute-method", None, EXACT, recompute_method, note="uniform; block is approximate"),
    Arg("--recompute-num-layers", "train.recompute_num_layers", EXACT, integer),
    Arg("--recompute-activations", "train.recompute", EXACT, const("selective"), nargs=0),
    Arg("--checkpoint-activations", "train.recompute", EXACT, const("full"), nargs=0,
        note="Megatron's old spelling of --recompute-granularity full"),
    Arg("--recompute-modules", "train.recompute_modules", EXACT, recompute_modules, nargs="*",
        default=Default(selective_default, "[core_attn] with selective granularity"),
        note="core_attn, layernorm, mlp; moe_act, moe, shared_experts, mla_up_proj refused"),
    Arg("--optimizer", None, EXACT,
        only("adam", "ptdp trains with AdamW"), note="only adam (AdamW)"),
    Arg("--lr", "train.lr", EXACT, number),
    Arg("--min-lr", "train.min_lr", EXACT, number),
    Arg("--lr-decay-style", "train.lr_decay_style", EXACT,
        choice({"constant": "constant", "linear": "linear", "cosine": "cosine",
                "inverse-square-root": "inverse-square-root", "WSD": "wsd"},
               "not a decay style ptdp has"),
        default="linear", note="ptdp's default is cosine"),
    Arg("--lr-decay-iters", "train.lr_decay_iters", EXACT, integer),
    Arg("--lr-decay-samples", "train.lr_decay_samples", EXACT, integer),
    Arg("--lr-warmup-iters", "train.lr_warmup_iters", EXACT, integer),
    Arg("--lr-warmup-samples", "train.lr_warmup_samples", EXACT, integer),
    Arg("--lr-warmup-fraction", "train.lr_warmup_fraction", EXACT, number),
    Arg("--lr-warmup-init", "train.lr_warmup_init", EXACT, number),
    Arg("--lr-wsd-decay-style", "train.lr_wsd_decay_style", EXACT,
        choice({s: s for s in ("exponential", "linear", "cosine", "minus_sqrt")},
               "not a WSD style ptdp has")),   # (exponential by default in both)
    Arg("--lr-wsd-decay-iters", "train.lr_wsd_decay_iters", EXACT, integer),
    Arg("--lr-wsd-decay-samples", "train.lr_wsd_decay_samples", EXACT, integer),
    Arg("--warmup", None, REFUSED, refuse("Megatron's obsolete warm-up; use --lr-warmup-iters")),
    Arg("--decoupled-lr", None, REFUSED, refuse("ptdp has one learning rate")),
    Arg("--decoupled-min-lr", None, REFUSED, refuse("ptdp has one learning rate")),
    Arg("--override-opt-param-scheduler", None, IGNORED,
        ignore("ptdp's schedule always comes from the config"), nargs=0),
    Arg("--use-checkpoint-opt-param-scheduler", None, IGNORED,
        ignore("ptdp's schedule always comes from the config"), nargs=0),
    Arg("--weight-decay", "train.weight_decay", EXACT, number),
    Arg("--weight-decay-incr-style", None, EXACT,
        only("constant", "ptdp's weight decay is constant"),
        note="only constant"),
    Arg("--start-weight-decay", None, REFUSED, refuse("ptdp's weight decay is constant")),
    Arg("--end-weight-decay", None, REFUSED, refuse("ptdp's weight decay is constant")),
    Arg("--clip-grad", "train.clip_grad", EXACT, number),
    Arg("--adam-beta1", "train.adam_beta1", EXACT, number),
    Arg("--adam-beta2", "train.adam_beta2", EXACT,
        number, default=0.999, note="ptdp's default is 0.95"),
    Arg("--adam-eps", "train.adam_eps", EXACT, number),
    Arg("--sgd-momentum", None, IGNORED, ignore("ptdp trains with AdamW")),
    Arg("--seed", "train.seed", APPROXIMATE,
        seed, note="ptdp's initialisation draws other numbers"),
    Arg("--calculate-per-token-loss", None, REFUSED,
        refuse("ptdp averages the loss per micro-batch"), nargs=0),
    Arg("--no-check-for-nan-in-loss-and-grad", None, IGNORED,
        ignore("ptdp's divergence check is its own"), nargs=0),
    Arg("--manual-gc", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--manual-gc-interval", None, IGNORED, ignore(_PERF)),
    Arg("--empty-unused-memory-level", None, IGNORED, ignore(_PERF)),
    Arg("--eval-interval", "train.eval_interval", EXACT, integer, default=1000,
        note="ptdp's default is 0 (no validation)"),
    Arg("--eval-iters", "train.eval_iters", EXACT,
        integer, default=100, note="ptdp's default is 2"),
    Arg("--skip-train", None, REFUSED, refuse("ptdp has no evaluation-only run"), nargs=0),
    # Data and tokenizer
    Arg("--data-path", "data.paths", EXACT, data_paths, nargs="*",
        note="also data.source: indexed, data.sampling: megatron"),
    Arg("--split", "data.split", EXACT, split,
        default=Default(lambda g: "969, 30, 1" if "--data-path" in g else None,
                        "969, 30, 1 (with --data-path)"),
        note="ptdp's default is 98,1,1"),
    Arg("--train-data-path", None, REFUSED,
        refuse("ptdp splits one blend (data.paths, data.split)"), nargs="*"),
    Arg("--valid-data-path", None, REFUSED,
        refuse("ptdp splits one blend (data.paths, data.split)"), nargs="*"),
    Arg("--test-data-path", None, REFUSED,
        refuse("ptdp splits one blend (data.paths, data.split)"), nargs="*"),
    Arg("--data-args-path", None, REFUSED, refuse("list the blend in --data-path")),
    Arg("--per-split-data-args-path", None, REFUSED,
        refuse("ptdp splits one blend (data.paths, data.split)")),
    Arg("--data-cache-path", None, IGNORED, ignore("ptdp keeps its own sample-index cache")),
    Arg("--mock-data", "data.source", APPROXIMATE,
        lambda v, g: Differs("synthetic", "ptdp's synthetic tokens are not Megatron's mock data"),
        nargs=0),
    Arg("--num-workers", "data.num_workers", EXACT, integer),
    Arg("--dataloader-type", None, EXACT,
        only("single", "ptdp's order is Megatron's single sampler"),
        note="only single"),
    Arg("--num-dataset-builder-threads", None, IGNORED, ignore(_PERF)),
    Arg("--no-mmap-bin-files", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--reset-position-ids", "data.reset_position_ids", EXACT, const(True), nargs=0),
    Arg("--reset-attention-mask", "data.reset_attention_mask", EXACT, const(True), nargs=0),
    Arg("--eod-mask-loss", "data.eod_mask_loss", EXACT, const(True), nargs=0),
    Arg("--no-create-attention-mask-in-dataloader", None, IGNORED, ignore(_PERF), nargs=0),
    Arg("--mask-prob", "data.mask_prob", EXACT, number),
    Arg("--short-seq-prob", None, REFUSED, refuse("ptdp's BERT samples are full length")),
    Arg("--tokenizer-type", "data.tokenizer", EXACT, tokenizer,
        note="with --vocab-file or --tokenizer-model"),
    Arg("--vocab-file", "data.tokenizer", EXACT, consumed_by_tokenizer_type,
        note="as --tokenizer-type reads it; without one, the file itself"),
    Arg("--merge-file", "data.tokenizer", EXACT, merge_file,
        note="read beside --vocab-file (NAME-merges.txt for NAME-vocab.json, or merges.txt); "
             "elsewhere approximate: copy it there"),
    Arg("--tokenizer-model", "data.tokenizer", EXACT, consumed_by_tokenizer_type,
        note="as --tokenizer-type reads it; without one, the file itself"),
    Arg("--vocab-extra-ids", None, EXACT, only(0, "ptdp adds no extra ids"), note="only 0",
        model=True),
    Arg("--tokenizer-hf-use-fast", None, IGNORED,
        ignore("ptdp always uses the fast tokenizers library"), nargs=0),
    Arg("--tokenizer-special-tokens", None, REFUSED,
        refuse("ptdp reads special tokens from the tokenizer"), nargs="*"),
    Arg("--fim-*", None, REFUSED, refuse("ptdp has no fill-in-the-middle data")),
    # Checkpoints
    Arg("--save", "checkpoint.dir", EXACT),
    Arg("--load", "checkpoint.load", APPROXIMATE, load,
        note="auto when equal to --save; a Megatron checkpoint must first be converted"),
    Arg("--save-interval", "checkpoint.save_interval", EXACT, integer),
    Arg("--persistent-save-interval", "checkpoint.save_interval", EXACT, integer),
    Arg("--async-save", "checkpoint.async_save", EXACT, const(True), nargs=0),
    Arg("--ckpt-format", None, IGNORED, ignore(_FORMAT)),
    Arg("--use-persistent-ckpt-worker", None, IGNORED,
        ignore("ptdp's asynchronous save has its own writer (checkpoint.async_save)"), nargs=0),
    Arg("--auto-detect-ckpt-format", None, IGNORED, ignore(_FORMAT), nargs=0),
    Arg("--use-dist-ckpt", None, IGNORED, ignore(_FORMAT), nargs=0),
    Arg("--ckpt-fully-parallel-save", None, IGNORED, ignore(_FORMAT), nargs=0),
    Arg("--ckpt-fully-parallel-load", None, IGNORED, ignore(_FORMAT), nargs=0),
    Arg("--ckpt-assume-constant-structure", None, IGNORED, ignore(_FORMAT), nargs=0),
    Arg("--dist-ckpt-strictness", None, IGNORED, ignore(_FORMAT)),
    Arg("--no-save-optim", None, REFUSED,
        refuse("ptdp's checkpoints always hold the optimizer"), nargs=0),
    Arg("--no-save-rng", None, REFUSED,
        refuse("ptdp's checkpoints always hold the random streams"), nargs=0),
    Arg("--no-load-optim", "checkpoint.load_optimizer", EXACT,
        partial_load("checkpoint.load_optimizer", False, "without the optimizer state"),
        nargs=0, note=_OWN),
    Arg("--no-load-rng", "checkpoint.load_rng", EXACT,
        partial_load("checkpoint.load_rng", False, "without the random streams"), nargs=0,
        note=_OWN),
    Arg("--finetune", "checkpoint.finetune", EXACT,
        partial_load("checkpoint.finetune", True, "from iteration 0 with the weights only"),
        nargs=0, note=f"the weights only, from iteration 0; {_OWN}"),
    Arg("--use-checkpoint-args", None, REFUSED, refuse("ptdp's config is the YAML"), nargs=0,
        model=True),
    Arg("--exit-on-missing-checkpoint", None, REFUSED,
        refuse("a named checkpoint.load must exist; auto may start fresh"), nargs=0),
    Arg("--non-persistent-*", None, REFUSED, refuse("ptdp has no non-persistent checkpoints")),
    # Logging
    Arg("--log-interval", "log.interval", EXACT, integer, default=100, note="ptdp's default is 1"),
    Arg("--tensorboard-dir", "log.tensorboard_dir", EXACT),
    Arg("--log-*", None, IGNORED, ignore("ptdp's metrics file records loss, rates, norms, "
                                            "throughput and memory every iteration")),
    Arg("--timing-log-level", None, IGNORED, ignore("ptdp's trace is log.trace_file")),
    Arg("--tensorboard-log-interval", None, IGNORED,
        ignore("ptdp writes TensorBoard every iteration")),
    Arg("--tensorboard-queue-size", None, IGNORED, ignore(_PERF)),
    Arg("--wandb-project", "log.wandb_project", EXACT),
    Arg("--wandb-exp-name", "log.wandb_name", EXACT),
    Arg("--wandb-entity", None, IGNORED, ignore("W&B's default entity; set WANDB_ENTITY")),
    Arg("--wandb-save-dir", None, IGNORED, ignore("ptdp's W&B run is written under ./wandb or "
                                                  "WANDB_DIR")),
    Arg("--profile*", None, IGNORED, ignore("ptdp's profiles are ptdp profile and log.trace_file")),
    Arg("--nsys-*", None, IGNORED, ignore("ptdp's profiles are ptdp profile and log.trace_file")),
    Arg("--straggler-*", None, IGNORED, ignore("ptdp's hang detector names a rank that stops")),
    Arg("--inprocess-*", None, IGNORED,
        ignore("ptdp restarts from its last checkpoint (the tools/ scripts)")),
    Arg("--one-logger-*", None, IGNORED, ignore("ptdp logs to its metrics file and TensorBoard")),
    # Other kinds of training
    Arg("--inference-*", None, REFUSED, refuse("ptdp pretrains; ptdp generate continues prompts")),
    Arg("--rl-*", None, REFUSED, refuse("ptdp has no reinforcement learning")),
    Arg("--grpo-*", None, REFUSED, refuse("ptdp has no reinforcement learning")),
    Arg("--mamba-*", None, REFUSED, refuse("ptdp has no state-space layers"), model=True),
    Arg("--muon-*", None, REFUSED, refuse("ptdp trains with AdamW")),
    Arg("--sft*", None, REFUSED, refuse("ptdp pretrains")),
)

BY_FLAG: dict[str, Arg] = {arg.flag: arg for arg in ARGS if not arg.family}
FAMILIES: tuple[Arg, ...] = tuple(arg for arg in ARGS if arg.family)


def lookup(flag: str) -> Arg | None:
    """The row of a Megatron flag (or of its family, e.g. --moe-*), or None."""
    if flag in BY_FLAG:
        return BY_FLAG[flag]
    return next((arg for arg in FAMILIES if flag.startswith(arg.flag[:-1])), None)


def _default_text(arg: Arg) -> str:
    if arg.default is None:
        return ""
    if isinstance(arg.default, Default):
        return arg.default.text
    return str(arg.default)


def docs_table() -> str:
    """The argument table of docs/migration.md, from ARGS (a test keeps the two equal)."""
    lines = ["| Megatron-LM argument | ptdp key | kind | Megatron default written when absent "
             "| note |", "| --- | --- | --- | --- | --- |"]
    for arg in ARGS:
        key = f"`{arg.key}`" if arg.key else "—"
        default = _default_text(arg)
        note = arg.note or _row_reason(arg)
        if arg.kind == REFUSED and arg.changes_model:
            note += " (shapes the model: no config is written)"
        lines.append(f"| `{arg.flag}` | {key} | {arg.kind} | {default} | {note} |")
    return "\n".join(lines) + "\n"


def _row_reason(arg: Arg) -> str:
    """The why of a refusing or ignoring converter, for the docs table."""
    if arg.kind in (REFUSED, IGNORED) and arg.convert is not None:
        try:
            arg.convert(True if arg.nargs == 0 else "", {})
        except Unmapped as err:
            return err.why
    return ""
