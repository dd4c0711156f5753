"""The dissertation's closed-form formulas, torch-free so anything can import them cheaply.

Equation numbers are those of Narayanan's dissertation (chapter 4 is the PTD-P paper). The
trainer reports model TFLOP/s per rank from these formulas (`ptdp/metrics/throughput.py`), so the
conventions here are the paper's, not a hardware FLOP count:

* Eq. 4.2 counts 4 passes per transformer layer (forward, backward = 2x, and the extra forward
  of activation recomputation) whether or not recomputation is on. Pass
  `recompute_forward=False` for the 3-pass "model FLOPs" of a run without it.
* Eq. 4.3 counts parameters of a GPT with a tied output embedding.
* Eq. 4.4 estimates training time as 8*T*P / (n*X).

BERT is not a GPT: its loss runs a dense + GeLU + LayerNorm transform before the tied logits
(with a vocabulary bias), a pooler and a binary head, and it embeds token types
(models/bert.py). `bert_flops_per_iteration` and `bert_parameter_count` count those;
`model_flops` and `model_parameters` pick the formula by the family's heads (the model
catalogue, ptdp/config/models.py).

Llama-style blocks (the model.* options of ptdp/config/schema.py: grouped-query attention,
SwiGLU, bias-free linears, RMSNorm, rotary positions, an untied output layer) change both
counts. `ModelShape` holds a model's dimensions and block; `iteration_flops` (Eq. 4.2
generalised) and `parameter_total` (Eq. 4.3 generalised) take one, and give the dissertation's
numbers bit for bit for its GPT block and BERT.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.models import GATED_ACTIVATIONS, Heads, ModelFamily, model_family
from ptdp.config.schema import DataConfig
from ptdp.planner.latent import (attention_forward_flops, attention_parameter_split,
                                 latent_fields)
from ptdp.planner.moe import (dense_mlp_forward_flops, moe_layer_count, moe_mlp_forward_flops,
                              moe_parameter_change)
from ptdp.planner.mtp import depth_own_parameters, mtp_forward_flops

SECONDS_PER_DAY = 86_400.0
BERT_MASKED_SHARE = DataConfig.mask_prob   # the share of tokens BERT's loss reads (its default)


def _any_dropout(m) -> bool:
    """Whether a layer keeps dropout masks: hidden or attention dropout (one flag for both, so
    a model with only one of them is costed with both masks: a slight overestimate)."""
    attention = getattr(m, "attention_dropout", None)
    return m.dropout > 0 or (attention is not None and attention > 0)


@dataclass(frozen=True)
class ModelShape:
    """A model's dimensions and block, as the formulas and the cost model need them (hashable,
    so costs can be cached). The fields after `dropout` default to the dissertation's GPT block
    (GPT-2's); `from_config` reads them from a ModelConfig.

    `vocab` is the tokenizer's vocabulary; callers pass the padded one where GEMMs see it."""

    arch: str                            # model.arch: its family's name
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    vocab: int
    dropout: bool
    kv_heads: int | None = None          # grouped-query attention; None = heads
    activation: str = "gelu"             # gelu | gelu_tanh | swiglu | geglu
    normalization: str = "layernorm"     # layernorm | rmsnorm
    position_embedding: str = "learned"  # learned | rope
    bias: bool = True                    # biases of QKV, projection, fc1, fc2
    qkv_bias: bool | None = None         # biases of Q, K, V only; None = bias
    tie_embeddings: bool = True          # the logits reuse the word table
    tokentypes: int = 2                  # BERT's segment embeddings
    # Mixture of experts (ptdp/planner/moe.py); 0 experts = dense MLPs everywhere
    experts: int = 0                     # E, routed experts per MoE layer
    top_k: int = 2                       # k, experts each token passes
    moe_ffn: int = 0                     # each expert's width
    shared_ffn: int = 0                  # the shared expert's width; 0 = none
    shared_gate: bool = False            # a sigmoid gate h -> 1 on the shared expert
    moe_freq: int = 1                    # every n-th layer is MoE ...
    dense_first: int = 0                 # ... after this many dense ones
    capacity_factor: float = 0.0         # token dropping's capacity factor; 0 = dropless
    head_dim: int | None = None          # per-head size d; None = hidden / heads
    qk_norm: bool = False                # a norm of size d on every query and key head
    window: int = 0                      # sliding-window attention's window; 0 = none
    local_layers: int = 0                # the layers that use it (the MTP depths' included)
    # Multi-head latent attention (ptdp/planner/latent.py); 0 = the usual QKV projection
    mla_kv_lora: int = 0                 # the K/V latent's size
    mla_q_lora: int = 0                  # the query latent's size; 0 = queries from h
    mla_rope_dim: int = 0                # each query/key head's rotary part (head_dim: the rest)
    mla_v_dim: int = 0                   # each value head's size
    mtp_layers: int = 0                  # multi-token prediction's depths (ptdp/planner/mtp.py)

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @classmethod
    def from_config(cls, m) -> "ModelShape":
        # a dense model's shape keeps the MoE fields' defaults, whatever its moe_* keys say
        moe = (dict(experts=m.num_experts, top_k=m.moe_top_k, moe_ffn=m.moe_ffn_hidden_size,
                    shared_ffn=m.moe_shared_ffn_hidden_size,
                    shared_gate=m.moe_shared_expert_gate, moe_freq=m.moe_layer_freq,
                    dense_first=m.moe_first_dense_layers,
                    capacity_factor=m.moe_capacity_factor or 0.0) if m.num_experts else {})
        return cls(m.arch, m.num_layers, m.hidden_size, m.num_heads, m.ffn_hidden_size,
                   m.seq_length, m.vocab_size, _any_dropout(m), m.num_kv_heads, m.activation,
                   m.normalization, m.position_embedding, m.bias, m.qkv_bias, m.tie_embeddings,
                   m.num_tokentypes, head_dim=m.head_dim, qk_norm=m.qk_norm, **moe,
                   **_window_fields(m), **latent_fields(m), mtp_layers=m.mtp_layers)

    @property
    def family(self) -> ModelFamily:
        return model_family(self.arch)

    def attention_flops_saved(self, batch: float) -> float:
        """Forward FLOPs the sliding window saves over full attention: a local layer's query
        attends to min(window, s) keys instead of s (4*B*s*h per key), Eq. 4.2's convention of
        counting s keys per query in a global layer (causal or not)."""
        if not self.window or self.window >= self.seq:
            return 0.0
        if self.latent:   # scores of width h_q, probabilities times V of width heads * v
            return (2.0 * batch * self.seq * (self.q_hidden + self.heads * self.v_head_dim)
                    * (self.seq - self.window) * self.local_layers)
        return 4.0 * batch * self.seq * self.q_hidden * (self.seq - self.window) * self.local_layers

    @property
    def bert_heads(self) -> bool:
        """BERT's heads and token types on top of the layers (models/bert.py), counted by the
        bert_* formulas, instead of a decoder's output layer."""
        return self.family.heads is Heads.BERT

    def head_rows(self, tokens: float) -> float:
        """The rows the output layer and the loss compute: every token for a decoder; for BERT
        the masked ones only (models/bert.py runs its masked-LM head on those), at
        data.mask_prob's default share. The FLOP formulas still count every token (the
        model's FLOPs, as Megatron and Hugging Face compute them)."""
        return tokens * BERT_MASKED_SHARE if self.bert_heads else tokens

    @property
    def word_table_on_last_stage(self) -> bool:   # with p > 1: a copy, summed with the first's
        return self.tie_embeddings or self.mtp_layers > 0

    @property
    def latent(self) -> bool:   # multi-head latent attention (ptdp/planner/latent.py)
        return self.mla_kv_lora > 0

    @property
    def qk_head_dim(self) -> int:   # a query or key head: head_dim (latent: + its rotary part)
        return self.head_dim + self.mla_rope_dim if self.latent else self.head_dim

    @property
    def v_head_dim(self) -> int:    # a value head, and a head's share of attention's output
        return self.mla_v_dim if self.latent else self.head_dim

    @property
    def q_hidden(self) -> int:
        """Width of Q and of the attention output: heads * head_dim; h unless model.head_dim
        sets another head size. (Latent attention: Q's, heads * qk_head_dim; its output is
        heads * v_head_dim wide.)"""
        return self.heads * self.qk_head_dim

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): num_kv_heads * head_dim; h without grouped-query attention.
        (Latent attention: K's, heads * qk_head_dim; V is heads * v_head_dim wide.)"""
        return self.kv_heads * self.qk_head_dim

    @property
    def gated(self) -> int:   # 1 when fc1 makes a gate and an up projection (SwiGLU, GeGLU)
        return int(self.activation in GATED_ACTIVATIONS)

    @property
    def rope(self) -> bool:
        return self.position_embedding == "rope"

    @property
    def norm_parameters(self) -> int:
        """Parameters per hidden unit of one norm: LayerNorm's weight and bias, RMSNorm's gain."""
        return 2 if self.normalization == "layernorm" else 1

    @property
    def dissertation_block(self) -> bool:
        """The block Eq. 4.2 and 4.3 are written for: GPT-2's, with f = 4h."""
        return (self.ffn == 4 * self.hidden and self.kv_heads == self.heads and not self.gated
                and self.q_hidden == self.hidden and not self.qk_norm
                and self.normalization == "layernorm" and not self.rope and self.bias
                and self.qkv_bias and self.tie_embeddings and not self.experts
                and not self.latent and not self.mtp_layers)

    def block_key(self) -> dict:
        """What a measured profile row must match beyond the sizes (ptdp/planner/compute.py);
        rows without these keys were measured on the dissertation's block."""
        return dict(kv_heads=self.kv_heads, head_dim=self.head_dim, qk_norm=self.qk_norm,
                    activation=self.activation,
                    normalization=self.normalization,
                    position_embedding=self.position_embedding, bias=self.bias,
                    qkv_bias=self.qkv_bias, mla_kv_lora=self.mla_kv_lora,
                    mla_q_lora=self.mla_q_lora, mla_rope_dim=self.mla_rope_dim,
                    mla_v_dim=self.mla_v_dim)


def _window_fields(m) -> dict:
    """ModelShape's sliding-window fields of a ModelConfig (none without a window)."""
    if getattr(m, "sliding_window", None) is None:
        return {}
    local = sum(m.attention_window(i) is not None for i in range(m.num_layers + m.mtp_layers))
    return dict(window=m.sliding_window, local_layers=local)


def model_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                              recompute_forward: bool = True) -> float:
    """Eq. 4.2: F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h)) floating-point operations.

    Derivation: a layer's forward pass costs 24Bsh^2 + 4Bs^2h; backward twice
    that; recomputation one more forward -> 4x. The logit layer costs 6BshV (fwd + bwd) and
    is never recomputed. With `recompute_forward=False` the layer factor is 3 instead of 4.
    """
    b, s, l, h, v = float(batch), float(seq), float(layers), float(hidden), float(vocab)
    passes = 4.0 if recompute_forward else 3.0
    per_layer_forward = 24.0 * b * s * h * h + 4.0 * b * s * s * h
    return passes * l * per_layer_forward + 6.0 * b * s * h * v


def parameter_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Eq. 4.3: P = 12*l*h^2 * (1 + 13/(12h) + (V+s)/(12*l*h)).

    Per layer 12h^2 weights + 13h biases/LayerNorm parameters, plus word (V*h) and position
    (s*h) embeddings; the output layer shares the word embedding.
    """
    l, h, v, s = float(layers), float(hidden), float(vocab), float(seq)
    return 12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (v + s) / (12.0 * l * h))


def bert_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                             recompute_forward: bool = True) -> float:
    """Eq. 4.2's encoder layers (bidirectional attention computes the same full s x s scores)
    plus BERT's heads, forward and backward (3 passes, never recomputed):

    * masked-LM head on every position (models/bert.py computes all logits and masks the
      loss): the dense h x h transform and the tied logits, 2Bs(h^2 + hV) forward;
    * pooler (h x h) and binary head (h x 2) on the [CLS] position, 2B(h^2 + 2h) forward.
    """
    b, s, h, v = float(batch), float(seq), float(hidden), float(vocab)
    encoder = model_flops_per_iteration(batch, seq, layers, hidden, vocab,
                                        recompute_forward) - 6.0 * b * s * h * v
    return encoder + 6.0 * b * s * (h * h + h * v) + 6.0 * b * (h * h + 2.0 * h)


def bert_parameter_count(layers: int, hidden: int, vocab: int, seq: int,
                         tokentypes: int = 2) -> float:
    """Parameters of models/bert.py: per layer 12h^2 + 13h, word (V h), position (s h) and
    token-type (tokentypes h) embeddings, the final LayerNorm (2h), the LM head's dense
    transform (h^2 + h), LayerNorm (2h) and vocabulary bias (V; the logits reuse the word
    table), the pooler (h^2 + h) and the binary head (2h + 2)."""
    l, h, v, s = float(layers), float(hidden), float(vocab), float(seq)
    encoder = l * (12.0 * h * h + 13.0 * h)
    embeddings = (v + s + tokentypes) * h
    heads = 2.0 * h + (h * h + h) + 2.0 * h + v + (h * h + h) + (2.0 * h + 2.0)
    return encoder + embeddings + heads


def model_flops(arch: str, batch: int, seq: int, layers: int, hidden: int, vocab: int,
                recompute_forward: bool = True) -> float:
    """Model FLOPs of one iteration for the family `arch` (a decoder: Eq. 4.2; BERT: with its
    own heads), for the dissertation's block; `iteration_flops` counts any block."""
    bert = model_family(arch).heads is Heads.BERT
    formula = bert_flops_per_iteration if bert else model_flops_per_iteration
    return formula(batch, seq, layers, hidden, vocab, recompute_forward)


def model_parameters(arch: str, layers: int, hidden: int, vocab: int, seq: int,
                     tokentypes: int = 2) -> float:
    """Parameters for the family `arch` (a decoder: Eq. 4.3; BERT: bert_parameter_count), for
    the dissertation's block; `parameter_total` counts any block."""
    if model_family(arch).heads is Heads.BERT:
        return bert_parameter_count(layers, hidden, vocab, seq, tokentypes)
    return parameter_count(layers, hidden, vocab, seq)


def iteration_flops(shape: ModelShape, batch: int, vocab: int | None = None,
                    recompute_forward: bool = True) -> float:
    """Model FLOPs of one iteration of `shape` (vocabulary `vocab`, default shape.vocab):
    Eq. 4.2 generalised to any block; BERT's formula for BERT.

    Eq. 4.2 counts a layer's GEMMs at 2 FLOPs per multiply-add. With T = B*s tokens, query
    width h_q = a*d (h unless model.head_dim sets d), key/value width h_kv = a_kv*d
    (grouped-query attention; h_q without it), MLP width f, and g = 1 for a gated activation
    (SwiGLU, GeGLU; 0 for GeLU), one layer's forward pass is

    * QKV: 2*T*h*(h_q + 2*h_kv); the output projection h_q -> h: 2*T*h_q*h;
    * attention scores Q K^T and their product with V: 4*B*s^2*h_q, unchanged by grouped-query
      attention (every query head still attends over its own s x s scores of width d);
    * MLP: h -> (1+g)*f (the gate and up in one GEMM), then f -> h: 2*T*h*f*(2+g);

    in all 4*T*h*(h_q + h_kv) + 2*T*h*f*(2+g) + 4*B*s^2*h_q, which for the dissertation's block
    (h_q = h_kv = h, f = 4h, g = 0) is Eq. 4.2's 24*B*s*h^2 + 4*B*s^2*h. It is computed as Eq.
    4.2's layer plus what the block changes, 4*T*h*(h_q - h) + 4*T*h*(h_kv - h) +
    4*B*s^2*(h_q - h) + 2*T*h*((2+g)*f - 8h), so the GPT block's result is Eq. 4.2's to the
    bit. Passes as in Eq. 4.2 (4 with the recomputed forward, else 3). The logit layer's
    6*B*s*h*V is the same whether the output layer is tied to the word table or not; biases,
    norms (QK-norm too), the activation and rotary positions are elementwise and, as in Eq.
    4.2, not counted.

    Sliding-window layers attend each query to min(window, s) keys: 4*B*s*h*(s - window) less
    per local layer (ModelShape.attention_flops_saved), 0 without a window.

    MoE layers (ptdp/planner/moe.py) count active experts only, as Megatron's MFU does: their
    MLP's 2*T*h*(2+g)*f is replaced by moe.moe_mlp_forward_flops (router, k routed experts,
    the shared expert), added as the difference so dense models keep their number bit for bit.
    Latent attention (DeepSeek's): its GEMMs, scores and products with V
    (latent.attention_forward_flops) replace the QKV, projection and attention terms.
    Multi-token prediction's D depths (ptdp/planner/mtp.py) are model FLOPs, as Megatron's:
    D more layers of the last one's kind, and eh_proj's and the logits' 3 passes each.
    """
    vocab = shape.vocab if vocab is None else vocab
    if shape.bert_heads:
        return bert_flops_per_iteration(batch, shape.seq, shape.layers, shape.hidden, vocab,
                                        recompute_forward)
    b, s, h, v = float(batch), float(shape.seq), float(shape.hidden), float(vocab)
    l = float(shape.layers + shape.mtp_layers)   # the MTP depths' layers are decoder layers
    passes = 4.0 if recompute_forward else 3.0
    if shape.latent:   # its attention (latent.py), then the MLP's 2*T*h*f*(2+g)
        per_layer_forward = (attention_forward_flops(shape, b)
                             + 2.0 * b * s * h * (2 + shape.gated) * shape.ffn)
    else:
        per_layer_forward = 24.0 * b * s * h * h + 4.0 * b * s * s * h
        per_layer_forward += (4.0 * b * s * h * (shape.kv_hidden - shape.hidden)
                              + 2.0 * b * s * h * ((2 + shape.gated) * shape.ffn - 8 * h))
        if shape.q_hidden != shape.hidden:   # an explicit head size: Q, scores, projection
            per_layer_forward += 4.0 * b * s * (h + s) * (shape.q_hidden - shape.hidden)
    layers = passes * l * per_layer_forward - passes * shape.attention_flops_saved(b)
    if shape.experts:
        tokens = b * s
        layers += passes * moe_layer_count(shape) * (moe_mlp_forward_flops(shape, tokens)
                                                     - dense_mlp_forward_flops(shape, tokens))
    return layers + 6.0 * b * s * h * v + 3.0 * mtp_forward_flops(shape, b * s, v)


def layer_parameter_split(shape: ModelShape) -> tuple[int, int]:
    """(split, replicated) parameters of one layer: those tensor parallelism splits by t
    (QKV weight and biases, projection weight, fc1 weight and biases, fc2 weight) and those
    every tensor rank holds whole (projection and fc2 biases, the two norms, the QK-norms).

    QKV h*(h_q + 2*h_kv) (+ h_q + 2*h_kv biases with qkv_bias), projection h_q*h (+ h), fc1
    h*(1+g)*f (+ (1+g)*f), fc2 f*h (+ h), two norms of n*h each (n = 2 for LayerNorm's weight
    and bias, 1 for RMSNorm's gain), and with QK-norm two norms of n*d (one shared by the query heads,
    one by the key heads). The dissertation's block: 12h^2 + 13h, Eq. 4.3's layer. Latent
    attention's (latent.attention_parameter_split) replace QKV, the projection and its bias."""
    h, f, g = shape.hidden, shape.ffn, shape.gated
    qkv = shape.q_hidden + 2 * shape.kv_hidden
    split, replicated = (attention_parameter_split(shape) if shape.latent else (
        h * qkv + (qkv if shape.qkv_bias else 0) + shape.q_hidden * h, h if shape.bias else 0))
    split += (h * (1 + g) * f + ((1 + g) * f if shape.bias else 0)) + f * h
    replicated += (h if shape.bias else 0) + 2 * shape.norm_parameters * h
    replicated += 2 * shape.norm_parameters * shape.head_dim if shape.qk_norm else 0
    return split, replicated


def decoder_parameters(shape: ModelShape, vocab: int | None = None) -> float:
    """Every parameter of a decoder of `shape` (GPT or Llama-style), vocabulary `vocab`
    (default shape.vocab): Eq. 4.3 generalised and made exact.

    l layers (layer_parameter_split), the word table V*h, a learned position table s*h (none
    with rotary positions, which have no parameters), the final norm n*h, and an output layer
    V*h of its own when it is not tied to the word table. For the dissertation's block that is
    12*l*h^2 + 13*l*h + (V + s)*h + 2h: Eq. 4.3 plus the final LayerNorm, which Eq. 4.3 leaves
    out. Llama-3 8B (32 layers, h = 4096, 32 heads, 8 K/V heads, f = 14336, V = 128256):
    8,030,261,248, Meta's count. MoE layers count all E experts (`active_parameters`: the k
    a token passes). The MTP depths (ptdp/planner/mtp.py): D layers of the last one's kind,
    each with mtp.depth_own_parameters; they share the word table and output layer."""
    return _decoder_parameters(shape, vocab, active=False)


def active_parameters(shape: ModelShape, vocab: int | None = None) -> float:
    """The parameters one token passes: `decoder_parameters` with each MoE layer's k routed
    experts instead of all E (the router and shared expert count whole). Mixtral-8x7B: 12.9 B
    of 46.7 B. A dense model: all of them."""
    if not shape.experts:
        return parameter_total(shape, vocab)
    return _decoder_parameters(shape, vocab, active=True)


def _decoder_parameters(shape: ModelShape, vocab: int | None, active: bool) -> float:
    vocab = shape.vocab if vocab is None else vocab
    h = shape.hidden
    layer = sum(layer_parameter_split(shape))
    tables = vocab * h * (1 if shape.tie_embeddings else 2)
    positions = 0 if shape.rope else shape.seq * h
    moe = moe_layer_count(shape) * moe_parameter_change(shape)[active] if shape.experts else 0
    depths = shape.mtp_layers * depth_own_parameters(shape)   # (their layers: in `layers`)
    layers = (shape.layers + shape.mtp_layers) * layer
    return float(layers + moe + depths + tables + positions + shape.norm_parameters * h)


def parameter_total(shape: ModelShape, vocab: int | None = None) -> float:
    """The parameter count reports print: Eq. 4.3 as the dissertation writes it for its GPT
    block (so every GPT number stays the paper's), BERT's own count for BERT, and the exact
    `decoder_parameters` for every other block."""
    vocab = shape.vocab if vocab is None else vocab
    if shape.bert_heads:
        return bert_parameter_count(shape.layers, shape.hidden, vocab, shape.seq,
                                    shape.tokentypes)
    if shape.dissertation_block:
        return parameter_count(shape.layers, shape.hidden, vocab, shape.seq)
    return decoder_parameters(shape, vocab)


def training_days(tokens: float, parameters: float, num_gpus: int,
                  tflops_per_gpu: float) -> float:
    """Eq. 4.4: end-to-end training time ~ 8*T*P / (n*X), in days. `tflops_per_gpu` is X
    in teraFLOP/s per GPU as measured with Eq. 4.2. Example from the source: 175e9
    parameters, 300e9 tokens, 1024 GPUs at 140 TFLOP/s -> ~34 days."""
    if num_gpus <= 0 or tflops_per_gpu <= 0:
        raise ValueError("num_gpus and tflops_per_gpu must be positive")
    seconds = 8.0 * tokens * parameters / (num_gpus * tflops_per_gpu * 1e12)
    return seconds / SECONDS_PER_DAY


def checkpoint_interval_s(save_stall_s: float, mtbf_s: float) -> float:
    """Young's (1974) and Daly's (2006) first-order optimum of the time between checkpoints:
    sqrt(2 * C * M) for a save that stalls training C seconds and failures M seconds apart on
    average. Shorter intervals stall more often; longer ones lose more work per failure (on
    average half an interval); this balances the two."""
    if save_stall_s < 0 or mtbf_s <= 0:
        raise ValueError("the save cost must be >= 0 and the time between failures positive")
    return (2.0 * save_stall_s * mtbf_s) ** 0.5


def iterations_for_tokens(tokens: float, global_batch: int, seq: int) -> float:
    """I = T / (B*s)."""
    return tokens / (global_batch * seq)


def bubble_fraction(pipeline: int, micro_batches: int, chunks: int = 1) -> float:
    """Pipeline bubble of flushing schedules as a fraction of ideal time: (p-1)/(v*m).
    GPipe and 1F1B: (p-1)/m; interleaved 1F1B with v chunks per device: (1/v)*(p-1)/m.
    PipeDream-2BW and async PipeDream have no flush, hence no bubble."""
    if micro_batches <= 0 or chunks <= 0:
        raise ValueError("micro_batches and chunks must be positive")
    return (pipeline - 1) / (chunks * micro_batches)


def tensor_parallel_elements_per_layer(batch: int, seq: int, hidden: int, tensor: int) -> float:
    """Elements each device moves per layer per micro-batch: 8*b*s*h*(t-1)/t. Two
    all-reduces of b*s*h forward and two backward, each a ring moving 2(t-1)/t of it."""
    return 8.0 * batch * seq * hidden * (tensor - 1) / tensor


def pipeline_elements_per_boundary(batch: int, seq: int, hidden: int, tensor: int = 1,
                                   scatter_gather: bool = False) -> float:
    """Elements sent between consecutive stages per micro-batch, one direction: b*s*h,
    or b*s*h/t with the scatter/gather optimization."""
    elements = float(batch * seq * hidden)
    return elements / tensor if scatter_gather else elements


def eq41_batch_time(global_per_replica: int, micro_batch: int, pipeline: int,
                    t_forward: float, t_backward: float) -> float:
    """Eq. 4.1: (b'/b + p - 1) * (t_f(b) + t_b(b)) with b' = B/d; ignores comm."""
    return (global_per_replica / micro_batch + pipeline - 1) * (t_forward + t_backward)


def optimal_checkpoints(layers: int, a_intermediate: float, a_input: float) -> float:
    """c = sqrt(l * A_intermediate / A_input) minimises c*A_input + (l/c)*A_intermediate."""
    return (layers * a_intermediate / a_input) ** 0.5


# Context parallelism (ptdp/parallel/ring_attention.py) -------------------------------------------

def context_shape(shape: ModelShape, context: int) -> ModelShape:
    """The shape a context rank's layers see outside attention: s/c tokens of each sequence."""
    if context == 1:
        return shape
    from dataclasses import replace
    return replace(shape, seq=shape.seq // context)


def ring_block_bytes(shape: ModelShape, batch: int, tensor: int, context: int,
                     element_bytes: float) -> float:
    """One K/V block a context rank passes on: K and V of its s/c tokens and its kv_heads/t
    heads, 2 * b * (s/c) * h_kv / t elements."""
    return 2.0 * batch * shape.seq / context * shape.kv_hidden / tensor * element_bytes


def ring_blocks_per_layer(context: int, recompute: str = "none") -> tuple[int, int, int]:
    """(forward K/V, backward K/V, backward dK/dV) blocks a context rank sends per layer and
    micro-batch: c-1 forward; backward the K/V go round again (c-1) with their gradients, which
    make one more hop home (c); recomputation (full or selective) repeats the forward ring.
    So per layer a rank sends (c-1)/c of the whole sequence's K/V forward and about twice that
    backward."""
    if context == 1:
        return 0, 0, 0
    again = context - 1 if recompute != "none" else 0
    return context - 1, context - 1 + again, context
