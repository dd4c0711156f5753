"""The pre-norm transformer layer shared by GPT, Llama-style decoders and BERT, in the [s, b, h]
layout.

Attention: Q, K, V come from one column-parallel GEMM (each tensor rank owns num_kv_heads/t
whole groups of query heads with their shared key and value head), the output projection is
row-parallel. With rotary positions (models/rotary.py) Q and K are rotated after the GEMM.
MLP: column-parallel h -> f (GeLU) or h -> 2f (SwiGLU's or GeGLU's gate and up projections), then
row-parallel f -> h. So a layer does two all-reduces forward and two backward. The norms are
LayerNorm or RMSNorm (models/norms.py); with `model.qk_norm` each query and key head is
normalised over its head_dim values before the rotation (Qwen3, Gemma 3).

The output projections hand their bias back (`skip_bias_add`) so that bias + GeLU and bias +
dropout + residual add are one elementwise chain each (ptdp/kernels/fused.py), fused into one
kernel when the layer is compiled (`ModelContext.compile`, from `train.compile`).

Core attention (which kernel, with which mask) is models/attention.py: the chunk builds one
`AttentionMask` per micro-batch (packed documents, BERT's padding, the layers' sliding windows,
`ModelConfig.attention_window`) and every layer hands it on with its own window. With
`data.reset_position_ids` the positions ([b, s], from the batch) restart in every document
for the rotary angles as for the learned table (models/embedding.py). With context
parallelism (c > 1) each rank holds two chunks of the sequence and attention is a ring over
the context group (ptdp/parallel/ring_attention.py); rotary angles follow the chunks.

With `train.recompute: selective` a layer recomputes the modules of `train.recompute_modules`
in backward (models/recompute.py): the core attention, the pre-norms (applied inside
ParallelAttention and ParallelMLP, so that the linear after each can drop the norm's output),
the activation, or the whole MLP.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ptdp.config import ModelConfig
from ptdp.config.recompute import selective_modules
from ptdp.kernels import ACTIVATIONS, bias_dropout_add
from ptdp.models.attention import HeadAttention
from ptdp.models.moe import MoEMLP
from ptdp.models.norms import head_norm, norm
from ptdp.models.latent_attention import LatentAttention
from ptdp.models.recompute import after_norm, checkpointed, recompute, without_output
from ptdp.models.rotary import RotaryEmbedding, rotary_tables, rotate
from ptdp.parallel.context import ContextParallel
from ptdp.parallel.experts import ExpertParallel
from ptdp.parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_std
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.parallel.sequence import sequence_parallel_dropout


@dataclass
class ModelContext:
    """What every layer needs besides its shape: the tensor group, the seed, dropout RNG."""

    model: ModelConfig
    tp: TensorParallel
    seed: int
    rng: TensorParallelRNG
    padded_vocab_size: int
    recompute: str = "none"          # none | full | selective
    recompute_num_layers: int = 1
    recompute_modules: tuple | None = None   # selective's (train.recompute_modules; None: default)
    compile: bool = False            # torch.compile the layers (train.compile)...
    compile_layers: int = 1          # ...in regions of this many (train.compile_layers)...
    cuda_graphs: bool = False        # ...each replayed as a CUDA graph (train.cuda_graphs)
    cp: ContextParallel = field(default_factory=ContextParallel)   # the context ring (c)
    ep: ExpertParallel = field(default_factory=ExpertParallel)      # the expert group (e)

    def recomputes(self, module: str) -> bool:
        """recompute=selective recomputes this module (ptdp/config/recompute.py)."""
        return self.recompute == "selective" and module in selective_modules(
            self.recompute_modules, self.tp.sequence_parallel)


def hidden_dropout_add(x, bias, residual, p: float, training: bool, tp: TensorParallel):
    """residual + Dropout(x + bias) on the hidden state (the fused chain, ptdp/kernels), or
    with sequence parallelism on my slice of it, with my rows of the full tensor's mask."""
    if tp.sequence_parallel and training and p > 0:
        return residual + _sequence_parallel_dropout(x if bias is None else x + bias, p, tp)
    return bias_dropout_add(x, bias, residual, p, training)


def residual_mlp_on_rows(mlp, x, p: float, training: bool, tp: TensorParallel):
    """x + Dropout(MLP(x)), the MLP run on the tokens as one [s·b, h] matrix: `mlp(rows)` ->
    (its output without the last bias, that bias).

    Rows are s-major, so the sequence-parallel gather and scatter along dimension 0 are
    unchanged. Compiled, fc1's bias gradient is then a sum over one dimension of the stored
    gradient; over [s, b], inductor fused it into a slow reduction that recomputes the GeLU
    backward (tools/bench_mlp_chain.py times both, docs/performance.md). The last bias goes
    into the MLP's fresh output before the view back, as the fused chain would add it (an
    in-place add on a view costs a copy in backward), and the residual add makes the result a
    tensor of its own, not a view: a pipeline stage frees what it sent
    (ptdp/pipeline/executor.py), which a view would defeat."""
    y, bias = mlp(x.reshape(-1, x.shape[-1]))
    y = (y if bias is None else y.add_(bias)).view(x.shape)
    return hidden_dropout_add(y, None, x, p, training, tp)


@torch.compiler.disable  # eager: the mask must be the default generator's, not inductor's
def _sequence_parallel_dropout(x, p: float, tp: TensorParallel):
    return sequence_parallel_dropout(x, p, tp)


class ParallelAttention(HeadAttention):
    def __init__(self, ctx: ModelContext, layer: int, causal: bool):
        super().__init__()
        cfg, tp = ctx.model, ctx.tp
        key = f"layers.{layer}.attention"
        self.ctx, self.causal = ctx, causal
        self.local_groups = tp.shard(cfg.num_kv_heads)
        self.group_size = cfg.num_heads // cfg.num_kv_heads
        self.local_heads = self.local_groups * self.group_size
        self.qk_head_dim = self.v_head_dim = cfg.head_dim   # (latent attention's differ)
        # The QKV weight's rows are ordered [group, (q_1 .. q_r, k, v), head_dim]: a group is one
        # key/value head and the r = num_heads / num_kv_heads query heads that share it (r = 1
        # without grouped-query attention: [head, (q, k, v), head_dim]). Group-major rows make a
        # contiguous row slice hold whole groups, so column-parallel splitting gives each rank
        # complete heads with their own keys and values (Megatron's layout).
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, width, tp, seed=ctx.seed,
                                        key=f"{key}.qkv", std=cfg.init_std, bias=cfg.qkv_bias)
        # heads * head_dim -> h (h -> h unless model.head_dim sets another head size)
        self.proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp,
                                      seed=ctx.seed, key=f"{key}.proj", skip_bias_add=True,
                                      bias=cfg.bias, std=scaled_std(cfg.init_std, cfg.num_layers))
        self.rotary = RotaryEmbedding(cfg) if cfg.position_embedding == "rope" else None
        if cfg.qk_norm:
            self.q_norm, self.k_norm = head_norm(cfg, tp), head_norm(cfg, tp)
        self.window = cfg.attention_window(layer)   # a sliding window, or None

    def project(self, x, positions=None, norm=None):
        """x [s, b, h] (normalised by `norm` first when given) -> q [b, heads, s, d], k and v
        [b, groups, s, d] of my heads (q and k normalised with model.qk_norm), rotated for
        `positions` [s], or [b, s] per sample (default 0 .. s-1, or this context rank's chunks'
        positions) with rotary embeddings."""
        # the whole sequence (all-gathered first with sequence parallelism)
        qkv = after_norm(self.ctx, norm, self.qkv, x)
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.local_groups, self.group_size + 2, -1)
        # split, not indexing: its backward writes the three gradients into one tensor, where
        # slices and selects would each zero a full-size gradient and autograd would sum them
        q, k, v = qkv.split([self.group_size, 1, 1], dim=3)
        q = q.reshape(s, b, self.local_heads, -1).permute(1, 2, 0, 3)
        k, v = (t.squeeze(3).permute(1, 2, 0, 3) for t in (k, v))
        if self.ctx.model.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            if positions is None:
                positions = self.default_positions(s, x.device)
            cos, sin = rotary_tables(self.rotary, positions)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q, k, v


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's fc1 as ptdp stores it, from separate gate and up rows: the rows alternate."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:]).contiguous()


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up rows of ptdp's SwiGLU fc1 (the inverse of fuse_gate_up)."""
    pairs = fc1.reshape(fc1.shape[0] // 2, 2, *fc1.shape[1:])
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


class ParallelMLP(nn.Module):
    """h -> f, GeLU (exact or tanh), f -> h; or gated, SwiGLU or GeGLU: h -> 2f whose rows
    alternate gate and up (so a contiguous row slice holds matching pairs on every tensor rank),
    SiLU(gate) * up or GeLU_tanh(gate) * up, f -> h."""

    def __init__(self, ctx: ModelContext, layer: int, hidden: int | None = None,
                 key: str | None = None):
        super().__init__()
        cfg, tp = ctx.model, ctx.tp
        key = key or f"layers.{layer}.mlp"
        hidden = hidden or cfg.ffn_hidden_size     # (an MoE layer's shared experts: their own)
        self.ctx = ctx
        width = 2 * hidden if cfg.gated else hidden
        self.activation = ACTIVATIONS[cfg.activation]
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, width, tp, seed=ctx.seed,
                                        key=f"{key}.fc1", std=cfg.init_std, skip_bias_add=True,
                                        bias=cfg.bias)
        self.fc2 = RowParallelLinear(hidden, cfg.hidden_size, tp, seed=ctx.seed,
                                     key=f"{key}.fc2", std=scaled_std(cfg.init_std, cfg.num_layers),
                                     skip_bias_add=True, bias=cfg.bias)

    def forward(self, x, norm=None):
        """-> (output without fc2's bias, that bias); `norm`: the pre-norm, applied here.
        Recomputed (selective), the whole MLP keeps only its input (`mlp`), or fc2's input is
        rebuilt from the activation's input (`activation`, the bias added first as the fused
        chain adds it, ptdp/kernels/fused.py)."""
        if self.ctx.recomputes("mlp"):
            run = lambda y: checkpointed(None, self._output, y)   # noqa: E731
            return after_norm(self.ctx, norm, run, x), self.fc2.bias
        h, bias = after_norm(self.ctx, norm, self.fc1, x)
        if not self.ctx.recomputes("activation"):
            return self.fc2(self.activation(h, bias))
        return without_output(self._activate, self.fc2, h if bias is None else h.add_(bias))

    def _activate(self, h):
        return self.activation(h, None)

    def _output(self, x):
        return self.fc2(self.activation(*self.fc1(x)))[0]


class TransformerLayer(nn.Module):
    """x + Dropout(Attn(Norm(x))), then x + Dropout(MLP(Norm(x))); the MLP is a mixture of
    experts in the layers `ModelConfig.is_moe_layer` names (models/moe.py)."""

    def __init__(self, ctx: ModelContext, layer: int, causal: bool):
        super().__init__()
        cfg = ctx.model
        self.tp, self.ctx = ctx.tp, ctx
        self.ln1 = norm(cfg, ctx.tp)
        self.attention = (LatentAttention if cfg.latent_attention else ParallelAttention)(
            ctx, layer, causal)
        self.ln2 = norm(cfg, ctx.tp)
        self.mlp = (MoEMLP(ctx, layer, ParallelMLP) if cfg.is_moe_layer(layer)
                    else ParallelMLP(ctx, layer))
        self.dropout = cfg.dropout

    def forward(self, x, mask=None, positions=None):
        """x: [s, b, h], or [s/t, b, h] with sequence parallelism; `mask` and `positions` as
        ParallelAttention takes them."""
        x = hidden_dropout_add(*self.attention(x, mask, positions, norm=self.ln1), x,
                               self.dropout, self.training, self.tp)
        if not isinstance(self.mlp, ParallelMLP):   # a mixture of experts routes [s, b, h]
            return hidden_dropout_add(*after_norm(self.ctx, self.ln2, self.mlp, x), x,
                                      self.dropout, self.training, self.tp)
        return residual_mlp_on_rows(lambda rows: self.mlp(rows, norm=self.ln2), x,
                                    self.dropout, self.training, self.tp)


def run_layers(layers: nn.ModuleList, x, mask, positions):
    """The layers one after the other: what one compiled region traces."""
    for layer in layers:
        x = layer(x, mask, positions)
    return x


# Graphs `run_layers` may keep: one per variant of a region in a job. The variants multiply:
# region lengths (uneven stages, recomputed groups), grad mode (a fully recomputed forward
# runs without), train or eval mode, bound to the weight-gradient queue or not
# (ptdp/parallel/weight_grad.py). Past dynamo's default of 8 the next variant would run eagerly,
# with one warning and no error.
REGION_GRAPHS = 64


@functools.cache
def compiled_run_layers(cuda_graphs: bool = False):
    """`run_layers` compiled once for every stack: regions of equal length and structure
    (their weights are the graph's inputs) share one graph. With `cuda_graphs`, torch's CUDA
    graph trees replay each region's kernels as one graph (ptdp/config/compilation.py)."""
    mode = "reduce-overhead" if cuda_graphs else None
    try:
        return torch.compile(run_layers, mode=mode, recompile_limit=REGION_GRAPHS)
    except TypeError:   # a torch whose limit is only global (recompile_limit, or cache_size_limit)
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), REGION_GRAPHS))
        return torch.compile(run_layers, mode=mode)


class TransformerStack(nn.Module):
    """Layers [first, first + count) of the model, with optional full recomputation.

    With `recompute=full` the stack is cut into groups of `recompute_num_layers` layers and
    only each group's input is kept; the group is re-run during backward.

    With `ctx.compile` the layers run in compiled regions of `ctx.compile_layers` consecutive
    layers (ptdp/config/compilation.py: each compiled call costs host time, whatever its
    length); a region never spans two recomputed groups.
    """

    def __init__(self, ctx: ModelContext, first: int, count: int, causal: bool):
        super().__init__()
        self.ctx, self.first = ctx, first
        self.layers = nn.ModuleList(TransformerLayer(ctx, first + i, causal) for i in range(count))
        self.moe = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEMLP)]

    def aux_losses(self) -> dict:
        """The MoE layers' aux losses of the latest forward, summed per name. (Read right after
        the forward: a recomputation during backward overwrites them with equal values.)"""
        total: dict = {}
        for mlp in self.moe:
            for name, value in mlp.aux_losses.items():
                total[name] = total[name] + value if name in total else value
        return total

    def _run(self, start: int, end: int, x, mask, positions):
        if not self.ctx.compile:
            return run_layers(self.layers[start:end], x, mask, positions)
        compiled, k = compiled_run_layers(self.ctx.cuda_graphs), self.ctx.compile_layers
        for first in range(start, end, k):
            x = compiled(self.layers[first:min(first + k, end)], x, mask, positions)
        return x

    def forward(self, x, mask=None, positions=None):
        if self.ctx.recompute != "full" or not self.training:
            return self._run(0, len(self.layers), x, mask, positions)
        step = self.ctx.recompute_num_layers
        for start in range(0, len(self.layers), step):
            x = recompute(self.ctx.rng, self._run, start, start + step, x, mask, positions)
        return x
