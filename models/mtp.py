"""Multi-token prediction (DeepSeek-V3's MTP, Megatron's --mtp-num-layers): `model.mtp_layers`
= D depths on the last pipeline stage, after the main head's final norm.

Depth k (1 .. D) combines, at position i, the previous depth's normalised hidden state
h^{k-1}_i (h^0: the decoder's, after its final norm) with the embedding of token i + k, and
runs one transformer layer:

    h'_i = W_k [enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)]        (W_k: 2h -> h, no bias)
    h^k  = norm_k(TransformerLayer_k(h'))

h^k goes through the model's output layer to predict token i + k + 1, and feeds depth k + 1.
The embedding and output layer are the model's own (with p > 1 the last stage's copy of the
word table, its gradient summed with the first stage's); each depth has its own norms,
projection and layer, of the last decoder layer's kind (dense or MoE, its window).

Depth k's loss L_k is the mean over the positions whose target exists and counts (the batch's
`mtp_tokens`, `mtp_labels`, `mtp_loss_mask`, ptdp/data/batching.py `future_targets`). The objective adds
λ/D · L_k for each depth (λ: model.mtp_loss_scale), handed on as the side output `mtp_k`
(ptdp/parallel/stage_output.py) and reported as that term, as the MoE losses are; the logged
`lm_loss` stays the main head's. This is Megatron's MTP (megatron-core's
multi_token_prediction.py: embedding first in the concatenation, the previous depth's output
after its final norm, λ / D).

W_k is replicated over the tensor group and applied to the rank's tokens, as latent attention's
down-projections (ptdp/parallel/layers.py `ReplicatedLinear`): with sequence parallelism on 1/t
of them, its gradient summed over the group like a norm's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ptdp.models.norms import norm
from ptdp.models.transformer import ModelContext, TransformerStack
from ptdp.parallel.layers import ReplicatedLinear

# A depth's side output: `mtp_1`, `mtp_2`, ... (each the λ/D-weighted loss it adds)
AUX_PREFIX = "mtp_"


def mtp_aux_loss_names(model) -> tuple[str, ...]:
    """The side outputs the last stage returns with multi-token prediction (declared up front by
    ptdp/training/pipeline.py, the same on every rank)."""
    return tuple(f"{AUX_PREFIX}{k}" for k in range(1, model.mtp_layers + 1))


class PredictionDepth(nn.Module):
    """Depth k's norms, projection, transformer layer (global index num_layers + k - 1) and
    final norm."""

    def __init__(self, ctx: ModelContext, depth: int):
        super().__init__()
        cfg, tp = ctx.model, ctx.tp
        self.enorm, self.hnorm = norm(cfg, tp), norm(cfg, tp)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, tp, seed=ctx.seed,
                                        key=f"mtp.{depth}.eh_proj", std=cfg.init_std)
        self.stack = TransformerStack(ctx, cfg.num_layers + depth - 1, 1, causal=True)
        self.final_ln = norm(cfg, tp)

    def forward(self, hidden, embedded, mask=None, positions=None):
        """hidden: h^{k-1} [s, b, h] (this rank's tokens); embedded: the embeddings of the
        tokens k ahead, laid out alike -> h^k, normalised."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_ln(self.stack(x, mask, positions))


class MultiTokenPrediction(nn.ModuleList):
    """The D depths (parameters `mtp.{k-1}.*`), run one after the other on the main head's
    normalised hidden state."""

    def __init__(self, ctx: ModelContext):
        super().__init__(PredictionDepth(ctx, k) for k in range(1, ctx.model.mtp_layers + 1))
        self.scale = ctx.model.mtp_loss_scale / ctx.model.mtp_layers

    def forward(self, hidden, batch, embed, loss_of, mask=None, positions=None) -> dict:
        """hidden: the decoder's output after its final norm; `embed(tokens [b, s])` the model's
        embedding; `loss_of(hidden, labels, loss_mask, count)` the main head's mean loss.
        -> {mtp_k: λ/D · L_k}."""
        tokens, labels = batch["mtp_tokens"], batch["mtp_labels"]
        masks, counts = batch["mtp_loss_mask"], batch["mtp_loss_count"]
        losses = {}
        for k, depth in enumerate(self):
            hidden = depth(hidden, embed(tokens[..., k]), mask, positions)
            losses[f"{AUX_PREFIX}{k + 1}"] = self.scale * loss_of(hidden, labels[..., k],
                                                                  masks[..., k], counts[k])
        return losses

    def aux_losses(self) -> dict:
        """The depths' MoE layers' aux losses of the latest forward, summed per name."""
        total: dict = {}
        for depth in self:
            for name, value in depth.stack.aux_losses().items():
                total[name] = total[name] + value if name in total else value
        return total
