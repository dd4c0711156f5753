"""What every model chunk (virtual pipeline stage) has, whatever the architecture.

The first chunk embeds tokens, every chunk runs its share of transformer layers, and the last
one applies the final norm and owns the output word table: the embedding itself, its own tied
copy when the embedding lives on another stage, or an untied output layer. With multi-token
prediction (models/mtp.py) the last chunk also runs the prediction depths, which embed tokens:
there its copy of the word table is a whole embedding (`word_table_copy`), used for the tied
logits too.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ptdp.models.attention import AttentionMask, attention_mask
from ptdp.models.embedding import (Embedding, OutputEmbedding, OutputLayer, mark_shared,
                                   word_table_copy)
from ptdp.models.mtp import MultiTokenPrediction
from ptdp.models.norms import norm
from ptdp.models.transformer import ModelContext, TransformerStack
from ptdp.parallel.stage_output import StageOutput
from ptdp.parallel.weight_grad import PLAIN


class ModelChunk(nn.Module):
    weight_ops = PLAIN   # the last stage's logits (ptdp/parallel/weight_grad.py)

    def __init__(self, ctx: ModelContext, stage: int, num_stages: int, layers: range, *,
                 causal: bool, num_tokentypes: int = 0):
        """`layers`: the global indices of this stage's transformer layers (may be empty on
        the first and the last stage)."""
        super().__init__()
        cfg = ctx.model
        self.ctx, self.causal = ctx, causal
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        predicts = self.is_last and cfg.mtp_layers > 0      # the multi-token-prediction depths
        # the mask's windows: this stage's layers' and the depths' (global indices num_layers ...)
        masked = list(layers) + (list(range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers))
                                 if predicts else [])
        self.windows = tuple(dict.fromkeys(cfg.attention_window(i) for i in masked)) or (None,)
        self.embedding = (Embedding(ctx, num_tokentypes) if self.is_first
                          else word_table_copy(ctx) if predicts else None)
        tied = cfg.tie_embeddings
        if self.is_first and not self.is_last and cfg.word_table_on_last_stage:
            mark_shared(self.embedding.word.weight)
        self.stack = TransformerStack(ctx, layers.start, len(layers), causal=causal)
        self.mtp = MultiTokenPrediction(ctx) if predicts else None
        if self.is_last:
            self.final_ln = norm(cfg, ctx.tp)
            self.output = (None if self.is_first or not tied or predicts
                           else OutputEmbedding(ctx))
            self.output_layer = None if tied else OutputLayer(ctx)

    def attention_mask(self, seq: int, device, *, documents=None,
                       padding=None) -> AttentionMask | None:
        """The micro-batch's attention mask for this chunk's layers (models/attention.py), built
        once before them: `documents` [b, s] (the whole sequence's, also with context
        parallelism), `padding` [b, s]; None when nothing limits attention beyond causality."""
        return attention_mask(self.causal, seq, device, documents=documents, padding=padding,
                              windows=self.windows, dropout=self.ctx.model.attention_dropout_rate,
                              cp=self.ctx.cp)

    def with_aux_losses(self, output, extra: dict | None = None):
        """`output` wrapped with the MoE layers' aux losses and `extra` ones (the prediction
        depths', ptdp/parallel/stage_output.py), or as it is when there are none."""
        aux = self.stack.aux_losses()
        for more in (self.mtp.aux_losses() if self.mtp is not None else {}, extra or {}):
            for name, value in more.items():
                aux[name] = aux[name] + value if name in aux else value
        return StageOutput(output, aux) if aux else output

    def output_table(self) -> torch.Tensor:
        """The table the logits use: the untied output layer, the embedding itself, or this
        stage's tied copy of it."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word.weight if self.output is None else self.output.weight
