"""tools/bench_gpu.py's reference: the same shape as ptdp's model written as plain PyTorch,
nanoGPT style, and its training step (fp32 parameters under bf16/fp16 autocast, fused AdamW on
CUDA, `clip_grad_norm_`, whole-model `torch.compile` when asked).

GPT is pre-LN with learned positions, tied embeddings, causal SDPA and a GeLU MLP. BERT is
Hugging Face's `BertForPreTraining` (SDPA attention) when `transformers` is importable, else a
plain pre-LN BERT with the same heads as ptdp's (models/bert.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Block(nn.Module):
    """Pre-LN transformer block on [b, s, h]: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, hidden: int, heads: int, causal: bool, recompute: bool):
        super().__init__()
        self.heads, self.causal, self.recompute = heads, causal, recompute
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def attention(self, x, mask):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def layer(self, x, mask):
        x = x + self.attention(self.ln1(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x, mask=None):
        if self.recompute and self.training:
            return torch.utils.checkpoint.checkpoint(self.layer, x, mask, use_reentrant=False)
        return self.layer(x, mask)


class Encoder(nn.Module):
    """Word + position (+ token type) embeddings, blocks, final LayerNorm."""

    def __init__(self, s: dict, causal: bool, recompute: bool, tokentypes: int = 0):
        super().__init__()
        h = s["hidden"]
        self.wte, self.wpe = nn.Embedding(s["vocab"], h), nn.Embedding(s["seq"], h)
        self.wtt = nn.Embedding(tokentypes, h) if tokentypes else None
        self.blocks = nn.ModuleList(Block(h, s["heads"], causal, recompute)
                                    for _ in range(s["layers"]))
        self.ln_f = nn.LayerNorm(h)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, types=None, mask=None):
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        if self.wtt is not None:
            x = x + self.wtt(types)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x)


class PlainGPT(nn.Module):
    """nanoGPT's GPT: the logits are x @ wte^T (tied), the loss torch's cross-entropy."""

    def __init__(self, s: dict, recompute: bool):
        super().__init__()
        self.encoder = Encoder(s, causal=True, recompute=recompute)

    def forward(self, batch):
        x = self.encoder(batch["tokens"])
        logits = F.linear(x, self.encoder.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), batch["labels"].view(-1))


class PlainBert(nn.Module):
    """ptdp's BERT (models/bert.py) in plain PyTorch: masked-LM head (dense, GeLU, LN, tied
    logits + bias) on the masked positions and a sentence-order head on [CLS]."""

    def __init__(self, s: dict, recompute: bool):
        super().__init__()
        h = s["hidden"]
        self.encoder = Encoder(s, causal=False, recompute=recompute, tokentypes=2)
        self.lm_dense, self.lm_ln = nn.Linear(h, h), nn.LayerNorm(h)
        self.lm_bias = nn.Parameter(torch.zeros(s["vocab"]))
        self.pooler, self.binary = nn.Linear(h, h), nn.Linear(h, 2)

    def forward(self, batch):
        keep = batch["attention_mask"].bool()[:, None, None, :]
        x = self.encoder(batch["tokens"], batch["types"], keep)
        lm = self.lm_ln(F.gelu(self.lm_dense(x)))
        logits = F.linear(lm, self.encoder.wte.weight, self.lm_bias)
        lm_loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(),
                                  batch["mlm_labels"].view(-1), ignore_index=-100)
        sop = self.binary(torch.tanh(self.pooler(x[:, 0])))
        return lm_loss + F.cross_entropy(sop.float(), batch["sop_label"])


class HFBert(nn.Module):
    """transformers.BertForPreTraining (post-LN, as published), SDPA attention, dropout
    s["dropout"] (hidden and attention; 0 unless bench_gpu.py's --dropout)."""

    def __init__(self, s: dict, recompute: bool):
        super().__init__()
        from transformers import BertConfig, BertForPreTraining
        config = BertConfig(vocab_size=s["vocab"], hidden_size=s["hidden"],
                            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                            intermediate_size=4 * s["hidden"], max_position_embeddings=s["seq"],
                            hidden_dropout_prob=s.get("dropout", 0.0),
                            attention_probs_dropout_prob=s.get("dropout", 0.0),
                            attn_implementation="sdpa")
        self.model = BertForPreTraining(config)
        if recompute:
            self.model.gradient_checkpointing_enable()

    def forward(self, batch):
        return self.model(input_ids=batch["tokens"], token_type_ids=batch["types"],
                          attention_mask=batch["attention_mask"], labels=batch["mlm_labels"],
                          next_sentence_label=batch["sop_label"]).loss


def plain_batch(arch: str, s: dict, b: int, device, generator) -> dict:
    """One random micro-batch; BERT masks 15% of positions and pads the last eighth of half
    the sequences (so the padding mask is real)."""
    shape = (b, s["seq"])
    tokens = torch.randint(0, s["vocab"], shape, generator=generator)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}
    if arch == "bert":
        masked = torch.rand(shape, generator=generator) < 0.15
        batch["mlm_labels"] = torch.where(masked, tokens, torch.full_like(tokens, -100))
        batch["types"] = (torch.arange(s["seq"]) >= s["seq"] // 2).long().expand(shape).clone()
        attention = torch.ones(shape, dtype=torch.long)
        attention[::2, -max(1, s["seq"] // 8):] = 0
        batch["attention_mask"] = attention
        batch["sop_label"] = torch.randint(0, 2, (b,), generator=generator)
    return {k: v.to(device) for k, v in batch.items()}


class PlainRunner:
    """A plain training step: m micro-batches under autocast, clip, fused AdamW."""

    def __init__(self, args, s: dict, device):
        self.device, self.m = device, args.micro_batches
        recompute = args.recompute != "none"
        if args.arch == "gpt":
            model, self.name = PlainGPT(s, recompute), "reference (plain GPT)"
        elif args.reference == "hf" or (args.reference == "auto" and has_transformers()):
            model, self.name = HFBert(s, recompute), "reference (HF BertForPreTraining)"
        else:
            model, self.name = PlainBert(s, recompute), "reference (plain BERT)"
        self.model = model.to(device).train()
        self.parameters = sum(p.numel() for p in self.model.parameters())
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95),
                                           fused=device.type == "cuda" or None)
        self.forward = torch.compile(self.model) if args.compile else self.model
        self.dtype = DTYPES[args.precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
        generator = torch.Generator().manual_seed(1234)
        cpu = torch.device("cpu")
        # host batches, copied to the device every micro-batch as ptdp's are (like with like)
        self.batches = [plain_batch(args.arch, s, args.micro_batch, cpu, generator)
                        for _ in range(self.m)]
        if device.type == "cuda":
            self.batches = [{k: v.pin_memory() for k, v in b.items()} for b in self.batches]

    def step(self, iteration: int) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for host in self.batches:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
            with torch.autocast(self.device.type, dtype=self.dtype,
                                enabled=self.dtype != torch.float32):
                loss = self.forward(batch) / self.m
            self.scaler.scale(loss).backward()
            total += loss.detach()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return total.item()  # one host sync per step, as ptdp's loss logging


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False
