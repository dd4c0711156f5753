"""Greedy generation from a converted model gives the tokens `transformers` gives.

A random Hugging Face model (Llama with grouped-query attention and Llama 3's rotary scaling,
GPT-2, Qwen2 with its Q/K/V biases) is converted by `ptdp convert`'s own path into a ptdp
checkpoint of layout (p, t) = (2, 2); `ptdp.inference.generate` then decodes 30 tokens with its
key/value cache (and, as a check of the cache, without it) and must equal
`generate(do_sample=False)`. Weights come from transformers' own initialisation with a wide
standard deviation, so the continuation does not collapse into one repeated token.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ptdp.hf.convert import from_hf  # noqa: E402
from ptdp.inference.generate import Sampling, generate  # noqa: E402
from ptdp.inference.local_model import LocalModel  # noqa: E402

VOCAB, SEQ, NEW = 256, 48, 30
DECODER = dict(vocab_size=VOCAB, initializer_range=0.3, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=SEQ, bos_token_id=None,
               eos_token_id=None, pad_token_id=None)
MODELS = {
    "llama": lambda: transformers.LlamaConfig(
        **DECODER, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "qwen2": lambda: transformers.Qwen2Config(**DECODER, num_key_value_heads=1,
                                              tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, initializer_range=0.3, n_embd=32,
                                            n_layer=2, n_head=4,
                                            n_positions=SEQ, activation_function="gelu",
                                            bos_token_id=None, eos_token_id=None),
}
PROMPT = [11, 200, 37, 5, 99, 140]


def _hf_model(config, out_dir):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(str(out_dir))
    return model


@pytest.mark.parametrize("family", list(MODELS))
def test_greedy_generation_equals_transformers(family, tmp_path):
    hf = _hf_model(MODELS[family](), tmp_path / "hf")
    layout = ["parallel.pipeline=2", "parallel.tensor=2" if family != "qwen2" else "parallel.data=2"]
    final, cfg = from_hf(tmp_path / "hf", tmp_path / "ckpt", layout)
    ours = LocalModel.from_checkpoint(final)
    cached = generate(ours, PROMPT, NEW, Sampling(temperature=0.0))
    uncached = generate(ours, PROMPT, NEW, Sampling(temperature=0.0), use_cache=False)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                             attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    theirs = theirs[0, len(PROMPT):].tolist()
    assert len(cached) == NEW
    assert cached == theirs, f"{family}: ptdp {cached} != transformers {theirs}"
    assert uncached == cached
    assert len(set(cached)) > 3, "a degenerate sequence would not test the cache"
