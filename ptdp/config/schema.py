"""The configuration's shape: one dataclass per YAML section, with every key's default, and
the one error type every configuration problem raises.

Everything under ptdp/config is plain Python (no torch), so the planner and the CLI use it
cheaply and validation runs before any process group exists.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ptdp.config.catalogue import DEFAULT
from ptdp.config.models import (BLOCK_OPTIONS, DEFAULT_FAMILY, DEFAULT_PRESET,
                                GATED_ACTIVATIONS, PRESETS, ModelFamily, model_family)


class ConfigError(ValueError):
    """One or more configuration problems; each names the key and says how to fix it.

    `errors` holds one line per problem; str() joins them with newlines.
    """

    def __init__(self, errors: str | list[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


VOCAB_PAD_MULTIPLE = 128  # vocab is padded to a multiple of 128 * t (GEMM-friendly shards)


def moe_layer(layer: int, experts: int, first_dense: int, freq: int) -> bool:
    """The rule of which layers are MoE (model.num_experts, moe_first_dense_layers,
    moe_layer_freq), for the model and the planner (ptdp/planner/moe.py): layer i (0-based) is
    when there are experts, i >= first_dense and (i - first_dense) % freq == 0."""
    after = layer - first_dense
    return experts > 0 and after >= 0 and after % freq == 0


@dataclass
class ModelConfig:
    arch: str = DEFAULT_FAMILY.name      # gpt | bert (ptdp/config/models.py)
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: int | None = None   # default 4h (gelu), 2/3 of 4h rounded up to 256 (swiglu)
    seq_length: int = 32
    vocab_size: int = 256                # the tokenizer's real size; padded internally
    dropout: float = 0.0                 # hidden (and, by default, attention) dropout
    attention_dropout: float | None = None  # on the attention probabilities; null = dropout
    layernorm_eps: float = 1e-5          # epsilon of LayerNorm or RMSNorm
    init_std: float = 0.02
    num_tokentypes: int = 2              # BERT segment embeddings
    # The block (null = the preset's choice; ptdp/config/models.py PRESETS)
    preset: str = DEFAULT_PRESET         # gpt | llama
    position_embedding: str | None = None  # learned | rope
    normalization: str | None = None     # layernorm | rmsnorm
    activation: str | None = None        # gelu | gelu_tanh | swiglu | geglu
    bias: bool | None = None             # biases in every linear layer
    qkv_bias: bool | None = None         # biases on Q, K, V only (Qwen2); null = model.bias
    tie_embeddings: bool | None = None   # output layer shares the input word table
    num_kv_heads: int | None = None      # grouped-query attention: K/V heads; null = num_heads
    rope_theta: float = 10000.0          # rotary base (Llama 3: 500000)
    rope_scaling_factor: float = 1.0     # frequency scaling; 1 = off (Llama 3.1: 8)
    rope_scaling_type: str = "llama3"    # with a factor > 1: llama3 | yarn (models/rotary.py)
    rope_low_freq_factor: float = 1.0    # llama3 only
    rope_high_freq_factor: float = 4.0   # llama3 only
    rope_original_seq_length: int = 8192  # the context the scaled frequencies were trained at
    rope_yarn_beta_fast: float = 32.0    # YaRN: rotations where the ramp starts (extrapolated)
    rope_yarn_beta_slow: float = 1.0     # YaRN: ... and ends (interpolated)
    rope_yarn_mscale: float | None = None          # YaRN: cos/sin factor's numerator weight
    rope_yarn_mscale_all_dim: float | None = None  # ... its denominator's (and DeepSeek's
                                                   # softmax scale, latent attention only)
    rope_yarn_attention_factor: float | None = None  # YaRN: cos/sin factor; null = derived
    rope_yarn_truncate: bool = True      # YaRN: the ramp's ends rounded to whole dimensions
    head_dim: int | None = None          # per-head size; null = hidden_size / num_heads
    norm_zero_centered: bool = False     # norm gain 1 + w, w starting at 0 (Gemma; Megatron's
                                         # --apply-layernorm-1p)
    qk_norm: bool = False                # normalise each query and key head (Qwen3, Gemma 3)
    scale_embeddings: bool = False       # word embeddings times sqrt(hidden_size) (Gemma)
    # Multi-head latent attention (DeepSeek-V2/V3; models/latent_attention.py): K and V from a
    # compressed latent; head_dim is then each query and key head's non-rotary part
    mla_kv_lora_rank: int = 0            # the K/V latent's size; 0 = the usual QKV projection
    mla_q_lora_rank: int = 0             # the query latent's size; 0 = queries from h directly
    mla_rope_head_dim: int = 64          # each query and key head's rotary part (one key part
                                         # shared by the heads)
    mla_v_head_dim: int | None = None    # each value head's size; null = head_dim
    # Mixture of experts (0 experts = a dense MLP in every layer; docs/moe.md)
    num_experts: int = 0                 # E, routed experts per MoE layer
    moe_top_k: int = 2                   # k, experts each token is routed to
    moe_ffn_hidden_size: int | None = None  # each expert's hidden size; null = ffn_hidden_size
    moe_shared_ffn_hidden_size: int = 0  # shared experts' hidden size (every token); 0 = none
    moe_shared_expert_gate: bool = False  # a sigmoid gate on the shared expert (Qwen2-MoE)
    moe_layer_freq: int = 1              # every n-th layer is MoE (counted after the dense ones)
    moe_first_dense_layers: int = 0      # the first layers stay dense (DeepSeek-V3: 3)
    moe_score_function: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    moe_renormalize: bool = True         # top-k weights renormalised to sum 1 (Mixtral, Qwen3)
    moe_routed_scaling_factor: float = 1.0  # the routed experts' weights times this (DeepSeek)
    moe_aux_loss_coeff: float = 0.0      # Switch/GShard load-balancing loss E * sum_i f_i * P_i
    moe_aux_loss_scope: str = "micro_batch"  # ... over each micro-batch's tokens | sequence's
    moe_z_loss_coeff: float = 0.0        # router z-loss: mean of logsumexp(scores)^2
    moe_expert_bias_rate: float = 0.0    # aux-loss-free balancing: per-expert bias update rate
    moe_capacity_factor: float | None = None  # token dropping: an expert keeps at most
                                         # ceil(N k / E * factor) choices; null = dropless
    moe_drop_policy: str = "probs"       # which it keeps: the largest gates | the first tokens
    moe_router_groups: int = 1           # node-limited routing: the experts in G groups...
    moe_router_group_top_k: int = 1      # ...and each token's k from its best G' of them
    # Multi-token prediction (DeepSeek-V3; models/mtp.py): D extra depths on the last stage,
    # depth k predicting the token k + 1 places ahead of the main head's
    mtp_layers: int = 0                  # D, one transformer layer each; 0 = off
    mtp_loss_scale: float = 0.1          # lambda: the objective adds lambda / D * their losses
    # The longest position a rotary model supports (HF's max_position_embeddings); any
    # model.seq_length up to it loads its checkpoint. null = model.seq_length
    max_position_embeddings: int | None = None
    # Sliding-window attention (Mistral v0.1, Qwen2, Gemma 2/3's local layers; models/attention.py)
    sliding_window: int | None = None    # key j visible to query i iff 0 <= i - j < window
    sliding_window_layers: list[int] | None = None  # the local layers (0-based); null = all

    def __post_init__(self):
        # an unknown preset: validation says so
        preset = PRESETS.get(self.preset, PRESETS[DEFAULT_PRESET])
        for key in BLOCK_OPTIONS:
            if getattr(self, key) is None:
                setattr(self, key, preset[key])
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None and self.num_heads > 0 and self.hidden_size % self.num_heads == 0:
            self.head_dim = self.hidden_size // self.num_heads   # (else validation says so)
        if self.mla_v_head_dim is None:
            self.mla_v_head_dim = self.head_dim
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.activation)
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size

    @property
    def word_table_on_last_stage(self) -> bool:
        """The last pipeline stage uses the word table too: for the logits (tied embeddings) or
        to embed the multi-token-prediction depths' tokens. With p > 1 it holds a copy whose
        gradient is summed with the first stage's."""
        return self.tie_embeddings or self.mtp_layers > 0

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (model.mla_kv_lora_rank > 0)."""
        return self.mla_kv_lora_rank > 0

    def heads_text(self) -> str:
        """The attention heads for summaries: "32 heads (8 K/V)", or latent attention's."""
        if self.latent_attention:
            q = f", Q latent {self.mla_q_lora_rank}" if self.mla_q_lora_rank else ""
            return (f"{self.num_heads} heads (latent attention: K/V latent "
                    f"{self.mla_kv_lora_rank}{q})")
        kv = f" ({self.num_kv_heads} K/V)" if self.num_kv_heads != self.num_heads else ""
        return f"{self.num_heads} heads{kv}"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether transformer layer `layer` (0-based) has a mixture of experts as its MLP.
        Layers num_layers, num_layers + 1, ... are the multi-token-prediction depths' (model.
        mtp_layers): of the last decoder layer's kind, as Megatron builds them."""
        return moe_layer(min(layer, self.num_layers - 1), self.num_experts,
                         self.moe_first_dense_layers, self.moe_layer_freq)

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of transformer layer `layer` (0-based), None where it is global;
        a multi-token-prediction depth's layer has the last decoder layer's."""
        layer = min(layer, self.num_layers - 1)
        local = self.sliding_window_layers is None or layer in self.sliding_window_layers
        return self.sliding_window if local else None

    @property
    def family(self) -> ModelFamily:
        """The traits of model.arch's family (ptdp/config/models.py)."""
        return model_family(self.arch)

    @property
    def attention_dropout_rate(self) -> float:
        """Dropout on the attention probabilities (Megatron's --attention-dropout)."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def max_positions(self) -> int:
        """The positions the model computes: a learned table's model.seq_length rows; for
        rotary positions model.max_position_embeddings when set."""
        if self.position_embedding == "rope" and self.max_position_embeddings:
            return self.max_position_embeddings
        return self.seq_length

    @property
    def gated(self) -> bool:
        """The MLP's first GEMM makes a gate and an up projection (SwiGLU, GeGLU)."""
        return self.activation in GATED_ACTIVATIONS


def default_ffn_hidden_size(hidden: int, activation: str) -> int:
    """4h; for a gated activation (SwiGLU, GeGLU), whose first GEMM is twice as wide, 2/3 of 4h rounded
    up to a multiple of 256 (Llama's rule), so the MLP keeps about the parameters of a 4h GeLU
    MLP."""
    if activation in GATED_ACTIVATIONS:
        return 256 * math.ceil(8 * hidden / 3 / 256)
    return 4 * hidden


@dataclass
class ParallelConfig:
    tensor: int = 1                      # t
    pipeline: int = 1                    # p
    data: int | None = None              # d; None = world_size / (p * t)
    chunks: int = 1                      # v, model chunks per pipeline rank (interleaving)
    context: int = 1                     # c, ranks splitting each sequence (ring attention)
    scatter_gather: bool = False         # send 1/t of each boundary tensor, all-gather after
    sequence_parallel: bool = False      # LayerNorm/dropout regions split along the sequence
    expert: int = 1                      # e, expert parallelism: folded out of d x c (e | d*c)
    stage_layers: list | None = None     # transformer layers of each virtual stage, in order
                                         # (p*v entries summing to model.num_layers); null = even


@dataclass
class ScheduleConfig:
    name: str = DEFAULT.name             # gpipe | 1f1b | interleaved | zb-h1 | 2bw | pipedream
                                         # (ptdp/config/catalogue.py)
    vertical_sync: bool = False          # pipedream: every stage uses the input stage's version


LR_DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root", "wsd")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass
class TrainConfig:
    micro_batch_size: int = 2            # b
    global_batch_size: int = 8           # B
    rampup_batch_size: list | None = None  # [start, increment, ramp_samples]: B ramps up
                                           # (ptdp/config/batches.py); sample-based runs only
    iters: int = 10
    train_samples: int | None = None     # a sample-based run: iters from it (and the ramp)
    seed: int = 1234
    precision: str = "fp32"              # fp32 | bf16 | fp16
    recompute: str = "none"              # none | full | selective
    recompute_num_layers: int = 1        # layers per checkpointed group with recompute=full
    recompute_modules: list | None = None  # recompute=selective's modules (ptdp/config/
                                           # recompute.py); null: its default
    # Learning rate (ptdp/optim/lr.py): Megatron-LM's schedule, lengths counted in samples
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0          # the rate the warm-up starts from
    lr_warmup_iters: int = 0             # iteration-based runs
    lr_warmup_samples: int = 0           # sample-based runs (train.train_samples)
    lr_warmup_fraction: float | None = None  # warm-up as a fraction of the decay length
    lr_decay_style: str = "cosine"       # cosine | linear | constant | inverse-square-root | wsd
    lr_decay_iters: int | None = None    # default: iters
    lr_decay_samples: int | None = None  # sample-based runs; default: train_samples
    lr_wsd_decay_style: str = "exponential"  # wsd's anneal: exponential | linear | cosine |
                                             # minus_sqrt
    lr_wsd_decay_iters: int | None = None    # wsd: length of the final anneal (iteration-based)
    lr_wsd_decay_samples: int | None = None  # the same for sample-based runs
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0               # 0 disables clipping
    grad_bucket_mb: float = 25.0         # data-parallel all-reduce bucket size
    distributed_optimizer: bool = False  # shard fp32 masters + Adam state over the data group
    initial_loss_scale: float = 2.0 ** 16
    fp16_max_skips: int = 10             # stop after this many overflows in a row at scale 1
    eval_interval: int = 0               # 0 disables validation
    eval_iters: int = 2
    device: str = "auto"                 # auto | cpu | cuda
    compile: bool | None = None          # torch.compile the layers; null = on for CUDA only
    compile_layers: int | None = None    # layers per compiled region (ptdp/config/compilation.py);
                                         # null = up to 8 with d = 1 and one-graph layers, else 1
    cuda_graphs: bool = False            # CUDA: replay each compiled region as a CUDA graph
                                         # (ptdp/config/compilation.py)
    timeout_s: float = 180.0             # a rank stuck 80 % of this long ends the job (exit 4)
    startup_timeout_s: float = 600.0     # the same for the first iteration and validation
                                         # (compilation); the backend gives up after the larger
    tf32: bool = True                    # CUDA: TF32 tensor cores for fp32 matmuls/convolutions
    grad_reduce_dtype: str | None = "fp32"  # fp32 | bf16: the data-parallel gradient
                                            # reduction's dtype (gradients are fp32 always);
                                            # null, older configs' default, is fp32


@dataclass(frozen=True)
class ScheduleLengths:
    """The learning-rate schedule's lengths in samples (ptdp/optim/lr.py). Warm-up may be
    fractional: a fraction of the decay length, as in Megatron-LM."""

    warmup: float
    decay: int
    wsd_decay: int | None


def schedule_lengths(train: TrainConfig) -> ScheduleLengths:
    """Warm-up, decay and WSD's anneal in samples, by Megatron-LM's rules
    (`get_optimizer_param_scheduler`): iteration-based runs give them in iterations, times the
    global batch; sample-based runs (train.train_samples) in samples."""
    if train.train_samples is not None:
        decay = train.lr_decay_samples or train.train_samples
        warmup = train.lr_warmup_samples
        wsd = train.lr_wsd_decay_samples
    else:
        batch = train.global_batch_size
        decay = (train.lr_decay_iters or train.iters) * batch
        warmup = train.lr_warmup_iters * batch
        wsd = train.lr_wsd_decay_iters * batch if train.lr_wsd_decay_iters is not None else None
    if train.lr_warmup_fraction is not None:
        warmup = train.lr_warmup_fraction * decay
    return ScheduleLengths(warmup, decay, wsd)


@dataclass
class DataConfig:
    source: str = "synthetic"            # synthetic | indexed
    paths: list = field(default_factory=list)  # [path] or [weight, path, weight, path, ...]
    tokenizer: str | None = None         # sentencepiece .model, or a Hugging Face tokenizer.json
    split: str = "98,1,1"                # train,valid,test ratios
    num_workers: int = 0
    mask_prob: float = 0.15              # BERT masking
    sampling: str = "ptdp"               # ptdp | megatron: sample order, splits, blending
                                         # (docs/data.md "Sample order")
    # GPT end-of-document options, as Megatron's (the <eod> id comes from the data/tokenizer)
    reset_position_ids: bool = False     # positions restart at 0 after each <eod>
    reset_attention_mask: bool = False   # tokens attend only within their own document
    eod_mask_loss: bool = False          # no loss on predictions made from an <eod> input


@dataclass
class LogConfig:
    interval: int = 1
    metrics_file: str | None = None
    trace_file: str | None = None
    tensorboard_dir: str | None = None
    progress: bool = True                # tqdm bar on rank 0 (only when stderr is a terminal)
    hardware: str | None = None          # profile name/path for MFU; auto-detected on known GPUs
    verbose: bool = False                # print the full resolved config at start-up (--verbose)
    wandb_project: str | None = None     # Weights & Biases project: log the TensorBoard scalars
    wandb_name: str | None = None        # the W&B run's name (null: W&B picks one)


AUTO_LOAD = "auto"   # checkpoint.load: the newest complete checkpoint in checkpoint.dir, if any


@dataclass
class CheckpointConfig:
    dir: str | None = None
    save_interval: int = 0               # 0 = only at the end when dir is set
    load: str | None = None              # a checkpoint path, or auto (the newest in dir, if any)
    async_save: bool = False             # write in the background while training goes on
    mtbf_hours: float | None = None      # expected hours between failures: suggests an interval
    keep_last: int = 0                   # keep this many newest checkpoints (0: keep all)
    keep_every: int = 0                  # and, of the older ones, each at a multiple of this
    load_optimizer: bool = True          # checkpoint.load's optimizer state and loss scale
    load_rng: bool = True                # checkpoint.load's random streams
    finetune: bool = False               # checkpoint.load's weights only, from iteration 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # Derived quantities used everywhere -------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        """m: micro-batches per data-parallel rank per iteration."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data)

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence one rank's layers hold outside attention: s/c, and s/(c*t)
        with sequence parallelism (the stage-boundary tensors' first dimension)."""
        par = self.parallel
        sp = par.tensor if par.sequence_parallel and par.tensor > 1 else 1
        return self.model.seq_length // (par.context * sp)

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.model.vocab_size, self.parallel.tensor)


def padded_vocab_size(vocab_size: int, tensor: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * tensor
    return int(math.ceil(vocab_size / multiple) * multiple)
