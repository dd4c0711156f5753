"""tools/bench_pipeline.py's other side: the same GPT as ptdp.models.gpt written as plain
nn.Modules, trained by torch.distributed.pipelining (PipelineStage + ScheduleGPipe /
Schedule1F1B / ScheduleInterleaved1F1B) with our initial weights, on the same data, p, v, m,
loss, tied-embedding gradient sum, clipping and AdamW.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Parameter(torch.zeros(seq, hidden))

    def forward(self, tokens):  # [b, s] -> [s, b, h]
        tokens = tokens.t()
        return self.word(tokens) + self.position[: tokens.shape[0]].unsqueeze(1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)   # rows ordered [head, (q, k, v), head_dim]
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        s, b, _ = x.shape
        qkv = self.qkv(x).view(s, b, self.heads, 3, -1)
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.ln1, self.attention = nn.LayerNorm(hidden, eps=eps), _Attention(hidden, heads)
        self.ln2, self.mlp = nn.LayerNorm(hidden, eps=eps), _MLP(hidden, ffn)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Stack(nn.Module):
    def __init__(self, count: int, *shape):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(*shape) for _ in range(count))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _OutputTable(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab, hidden))


class PlainGPTStage(nn.Module):
    """Virtual stage ``stage`` of ``num_stages`` of the same GPT as ptdp.models.gpt, in plain torch.

    Parameter names equal GPTChunk's, so ``load_state_dict(chunk.state_dict())`` copies ours
    (and checks every shape). The last stage returns logits [s, b, V]; the loss is outside.
    """

    def __init__(self, model, vocab: int, stage: int, num_stages: int):
        super().__init__()
        h = model.hidden_size
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.embedding = _Embedding(vocab, model.seq_length, h) if self.is_first else None
        self.stack = _Stack(model.num_layers // num_stages, h, model.num_heads,
                            model.ffn_hidden_size, model.layernorm_eps)
        if self.is_last:
            self.final_ln = nn.LayerNorm(h, eps=model.layernorm_eps)
            self.output = None if self.is_first else _OutputTable(vocab, h)

    def forward(self, x):
        if self.is_first:
            x = self.embedding(x)
        x = self.stack(x)
        if not self.is_last:
            return x
        table = self.embedding.word.weight if self.output is None else self.output.weight
        return F.linear(self.final_ln(x), table)


def lm_loss(logits, target):
    """Mean token cross-entropy; logits [s, b, V], target [b, s] (as ptdp.models.gpt, all-ones mask)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.t().reshape(-1))


class TorchSide:
    """torch.distributed.pipelining running the same GPT, weights copied from `trainer`."""

    def __init__(self, s: dict, name: str, trainer, embedding_group):
        import torch.distributed as dist
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        from ptdp.optim.optimizer import build_optimizer

        self.s, self.trainer, self.cfg = s, trainer, trainer.cfg
        p, v = s["p"], trainer.cfg.parallel.chunks
        self.rank, self.num_stages = dist.get_rank(), p * v
        self.modules, stages = {}, []
        for stage in list(trainer.state.chunks):
            mod = PlainGPTStage(trainer.cfg.model, trainer.cfg.padded_vocab_size, stage,
                                self.num_stages)
            mod.load_state_dict(trainer.state.chunks[stage].state_dict())
            mod.train()
            self.modules[stage] = mod
            stages.append(PipelineStage(mod, stage, self.num_stages, torch.device("cpu")))
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
               "interleaved": ScheduleInterleaved1F1B}[name]
        self.schedule = cls(stages if name == "interleaved" else stages[0], n_microbatches=s["m"],
                            loss_fn=lm_loss)
        self.params = [q for mod in self.modules.values() for q in mod.parameters()]
        self.shared = [mod.embedding.word.weight for st, mod in self.modules.items()
                       if st == 0 and self.num_stages > 1]
        self.shared += [mod.output.weight for st, mod in self.modules.items()
                        if st == self.num_stages - 1 and mod.output is not None]
        self.duplicate = {id(mod.output.weight) for mod in self.modules.values()
                          if mod.is_last and mod.output is not None}
        self.embedding_group = embedding_group
        self.optimizer = build_optimizer(self.params, trainer.cfg.train)
        self.holds_first = 0 in self.modules
        self.holds_last = self.num_stages - 1 in self.modules

    def batch(self, iteration: int) -> dict:
        mbs = [self.trainer.batches["train"].get(iteration, mb) for mb in range(self.s["m"])]
        return {k: torch.cat([mb[k] for mb in mbs]) for k in ("tokens", "labels")}

    def step(self, iteration: int, batch: dict) -> float:
        import torch.distributed as dist

        from ptdp.optim.grads import clip_gradients
        from ptdp.training.updates import set_learning_rate
        for q in self.params:
            q.grad = None
        args = (batch["tokens"],) if self.holds_first else ()
        losses = [] if self.holds_last else None
        kwargs = {"target": batch["labels"], "losses": losses} if self.holds_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if self.shared:  # the tied word table: first- and last-stage copies sum gradients
            for q in self.shared:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                dist.all_reduce(q.grad, group=self.embedding_group)
        total = torch.zeros((), dtype=torch.float64)
        for q in self.params:
            if q.grad is not None and id(q) not in self.duplicate:
                total += q.grad.double().pow(2).sum()
        dist.all_reduce(total)
        norm = math.sqrt(total.item())
        clip_gradients(self.params, self.cfg.train.clip_grad, norm)
        set_learning_rate(self.optimizer, iteration, self.cfg.train)
        self.optimizer.step()
        if losses:
            return float(torch.stack([x.detach() for x in losses]).mean())
        return float("nan")
