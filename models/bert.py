"""BERT: pre-LN bidirectional encoder (as Megatron-BERT) with padding mask, a masked-LM head
tied to the word embedding, and a binary sentence-order (or next-sentence) head."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ptdp.models.chunk import ModelChunk
from ptdp.models.embedding import logits
from ptdp.models.norms import layer_norm
from ptdp.models.transformer import ModelContext
from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy
from ptdp.parallel.layers import normal_param, shard_param
from ptdp.parallel.roles import declare_role
from ptdp.parallel.sequence import gather_from_sequence_region
from ptdp.parallel.weight_grad import PLAIN


class Linear(nn.Module):
    """A small replicated linear layer initialised from its global name (layout-free)."""

    weight_ops = PLAIN

    def __init__(self, ctx: ModelContext, n_in: int, n_out: int, key: str):
        super().__init__()
        self.weight = normal_param((n_out, n_in), ctx.model.init_std, ctx.seed, f"{key}.weight",
                                   None, ctx.tp)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return self.weight_ops.linear(x, self.weight, self.bias)


class BertHeads(nn.Module):
    """Masked-LM head (dense, GeLU, LN, tied logits + vocab-parallel bias) on the masked
    positions, and the binary head on [CLS]."""

    weight_ops = PLAIN   # the tied logits

    def __init__(self, ctx: ModelContext):
        super().__init__()
        h = ctx.model.hidden_size
        self.ctx = ctx
        self.lm_dense = Linear(ctx, h, h, "heads.lm_dense")
        self.lm_ln = layer_norm(h, ctx.model.layernorm_eps)
        self.lm_bias = shard_param(torch.zeros(ctx.padded_vocab_size), 0, ctx.tp)
        declare_role(self.lm_bias, vocab_padded=True)
        self.pooler = Linear(ctx, h, h, "heads.pooler")
        self.binary = Linear(ctx, h, 2, "heads.binary")

    def forward(self, hidden, table, batch):
        # The masked-LM loss reads only the masked positions (about one token in seven): the
        # head's dense layer, norm, logits and loss run on those rows alone, not on all s * b.
        mask = batch["loss_mask"].t().reshape(-1)
        # listed on the host (ptdp/data/batching.py; rounded up with rows of weight 0), or here
        rows = batch.get("loss_rows")
        rows = mask.nonzero().squeeze(1) if rows is None else rows
        picked = hidden.flatten(0, 1).index_select(0, rows).unsqueeze(1)   # [n, 1, h]
        lm = self.lm_ln(F.gelu(self.lm_dense(picked)))
        labels = batch["labels"].t().reshape(-1).index_select(0, rows).unsqueeze(1)
        per_token = vocab_parallel_cross_entropy(logits(lm, table, self.ctx, self.lm_bias,
                                                        ops=self.weight_ops),
                                                 labels, self.ctx.model.vocab_size, self.ctx.tp,
                                                 fused=self.ctx.compile)
        weights = mask.index_select(0, rows).to(per_token.dtype).unsqueeze(1)
        lm_loss = (per_token * weights).sum() / mask.to(per_token.dtype).sum().clamp(min=1.0)
        pooled = torch.tanh(self.pooler(hidden[0]))  # the [CLS] position
        sop_loss = F.cross_entropy(self.binary(pooled).float(), batch["sop_label"].view(-1))
        return lm_loss + sop_loss, {"lm_loss": lm_loss.detach(), "sop_loss": sop_loss.detach()}


class BertChunk(ModelChunk):
    def __init__(self, ctx: ModelContext, stage: int, num_stages: int, layers: range):
        super().__init__(ctx, stage, num_stages, layers, causal=False,
                         num_tokentypes=ctx.model.num_tokentypes)
        if self.is_last:
            self.heads = BertHeads(ctx)

    def forward(self, hidden, batch):
        if self.is_first:
            hidden = self.embedding(batch["tokens"], batch["types"])
        padding = batch["padding_mask"]
        hidden = self.stack(hidden, self.attention_mask(padding.shape[1], padding.device,
                                                        padding=padding))
        if not self.is_last:
            return self.with_aux_losses(hidden)
        hidden = self.final_ln(hidden)
        if self.ctx.tp.sequence_parallel:  # the heads (and the [CLS] pooler) see every token;
            # they are replicated, so each rank's gradient of the gathered tensor is whole
            hidden = gather_from_sequence_region(hidden, self.ctx.tp, reduce_grad=False)
        return self.with_aux_losses(self.heads(hidden, self.output_table(), batch))
