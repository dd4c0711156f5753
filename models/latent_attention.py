"""Multi-head latent attention (DeepSeek-V2 and V3; `model.mla_kv_lora_rank` > 0), in the [s, b,
h] layout, a drop-in for ParallelAttention (models/transformer.py).

Keys and values come from one compressed latent c_kv = Norm(x W_dkv) of `mla_kv_lora_rank`
values per token, the queries from c_q = Norm(x W_dq) of `mla_q_lora_rank` (or from x itself
when that is 0). Each head's query and key have a non-rotary part of `head_dim` values, from
the latent's up-projections, and a rotary part of `mla_rope_head_dim`: the query's per head,
the key's one vector per token computed from x beside the latent and shared by every head.
Values have `mla_v_head_dim` per head. Per head and token:

    q = [c_q W_uq (non-rotary), RoPE(c_q W_qr)]       k = [c_kv W_uk, RoPE(x W_kr)]
    v = c_kv W_uv                                     out = softmax(q k^T / sqrt(d_q)) v

with d_q = head_dim + mla_rope_head_dim (Hugging Face's DeepseekV3Attention); with YaRN and
`rope_yarn_mscale_all_dim` the softmax scale 1/sqrt(d_q) is multiplied by mscale(factor,
mscale_all_dim)^2, as its `yarn_apply_mscale` does (models/rotary.py). Parameters: `q_down`
[q_lora, h], `q_norm`, `q_up` [heads (head_dim + rope), q_lora] (or `q` [heads (head_dim +
rope), h]); `kv_down` [kv_lora + rope, h] (the latent's rows, then the rotary key's),
`kv_norm`, `kv_up` [heads (head_dim + v), kv_lora]; `proj` [h, heads v]. Up-projection rows
are head-major, each head's [non-rotary, rotary] or [key, value].

Tensor parallelism splits the heads: the up-projections are column-parallel (each rank its
whole heads), `proj` row-parallel. The down-projections and latent norms are replicated and
run where the hidden state is, on the rank's tokens (all of them, or 1/t with sequence
parallelism: their gradients are then partial and summed over the tensor group, as a norm's);
the latents enter the tensor region through the up-projections, the shared rotary key through
the same mapping (f, or the sequence all-gather), whose backward sums the heads' parts. So a
layer keeps the two all-reduces of the usual block, forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ptdp.models.attention import HeadAttention
from ptdp.models.norms import latent_norm
from ptdp.models.recompute import after_norm
from ptdp.models.rotary import RotaryEmbedding, rotary_tables, rotate, softmax_scale_multiplier
from ptdp.parallel.layers import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                  scaled_std)
from ptdp.parallel.sequence import enter_tensor_region


class LatentAttention(HeadAttention):
    def __init__(self, ctx, layer: int, causal: bool):
        super().__init__()
        cfg, tp = ctx.model, ctx.tp
        key, std, h = f"layers.{layer}.attention", cfg.init_std, cfg.hidden_size
        self.ctx, self.causal = ctx, causal
        self.local_heads = tp.shard(cfg.num_heads)
        self.nope, self.rope = cfg.head_dim, cfg.mla_rope_head_dim
        self.v_head_dim = cfg.mla_v_head_dim
        self.qk_head_dim = self.nope + self.rope
        self.q_latent = cfg.mla_q_lora_rank > 0
        q_rows, latent = cfg.num_heads * self.qk_head_dim, cfg.mla_kv_lora_rank

        def column(n_in, n_out, name):
            return ColumnParallelLinear(n_in, n_out, tp, seed=ctx.seed, key=f"{key}.{name}",
                                        std=std, bias=False)

        def replicated(n_in, n_out, name):
            return ReplicatedLinear(n_in, n_out, tp, seed=ctx.seed, key=f"{key}.{name}", std=std)

        if self.q_latent:
            self.q_down = replicated(h, cfg.mla_q_lora_rank, "q_down")
            self.q_norm = latent_norm(cfg, cfg.mla_q_lora_rank, tp)
            self.q_up = column(cfg.mla_q_lora_rank, q_rows, "q_up")
        else:
            self.q = column(h, q_rows, "q")
        self.kv_down = replicated(h, latent + self.rope, "kv_down")
        self.kv_norm = latent_norm(cfg, latent, tp)
        self.kv_up = column(latent, cfg.num_heads * (self.nope + self.v_head_dim), "kv_up")
        self.proj = RowParallelLinear(cfg.num_heads * self.v_head_dim, h, tp, seed=ctx.seed,
                                      key=f"{key}.proj", skip_bias_add=True, bias=cfg.bias,
                                      std=scaled_std(std, cfg.num_layers))
        self.rotary = RotaryEmbedding(cfg, self.rope)
        multiplier = softmax_scale_multiplier(cfg)   # (None below: SDPA's 1/sqrt(d_q))
        self.softmax_scale = None if multiplier == 1.0 else self.qk_head_dim ** -0.5 * multiplier
        self.window = cfg.attention_window(layer)

    def _from_normalised(self, x):
        """The normalised hidden state -> (the queries, the key/value latent's down-projection
        with the rotary key's rows): everything that reads it, so that recompute's layernorm
        module can rebuild it for their backward (models/recompute.py after_norm)."""
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_latent else self.q(x)
        return q, self.kv_down(x)

    def project(self, x, positions=None, norm=None):
        """x [s, b, h] (or this rank's tokens with sequence parallelism; normalised by `norm`
        first when given) -> q, k [b, heads, s, qk_head_dim], v [b, heads, s, v_head_dim] of my
        heads, the rotary parts rotated for `positions` ([s] or [b, s]; default 0 .. s-1)."""
        q, kv = after_norm(self.ctx, norm, self._from_normalised, x)
        latent, k_rot = kv.split([kv.shape[-1] - self.rope, self.rope], dim=-1)
        kv = self.kv_up(self.kv_norm(latent))
        k_rot = enter_tensor_region(k_rot, self.ctx.tp)         # [s, b, rope], every head's
        s, b = q.shape[:2]
        q_pass, q_rot = q.view(s, b, self.local_heads, -1).split([self.nope, self.rope], dim=-1)
        k_pass, v = kv.view(s, b, self.local_heads, -1).split([self.nope, self.v_head_dim], dim=-1)
        if positions is None:
            positions = self.default_positions(s, x.device)
        cos, sin = rotary_tables(self.rotary, positions)
        q_rot = rotate(q_rot.permute(1, 2, 0, 3), cos, sin)            # [b, heads, s, rope]
        k_rot = rotate(k_rot.permute(1, 0, 2).unsqueeze(1), cos, sin)  # [b, 1, s, rope]
        q = torch.cat([q_pass.permute(1, 2, 0, 3), q_rot], dim=-1)
        k = torch.cat([k_pass.permute(1, 2, 0, 3), k_rot.expand_as(q_rot)], dim=-1)
        return q, k, v.permute(1, 2, 0, 3)

    def core_attention(self, q, k, v, mask):
        """As every block's, but the context ring passes K and V around as one tensor and its
        kernels take one head size: there V is zero-padded to the query/key heads' size and the
        padding cut off the output (the zero columns add nothing to what the others hold)."""
        if self.ctx.cp.size == 1 or v.shape[-1] == q.shape[-1]:
            return super().core_attention(q, k, v, mask)
        assert v.shape[-1] < q.shape[-1], "the ring pads the values up to the keys' head size"
        padded = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        return super().core_attention(q, k, padded, mask)[..., :v.shape[-1]]
