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

from tests.optional import needs
transformers = needs("transformers")

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


CHAT = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
TEXTS = ["the quick brown fox jumps over the lazy dog", "a test of the tokenizer and its BOS",
         "user: hello\nassistant: hi there"] * 20


def test_the_command_tokenises_stops_and_chats_as_transformers(tmp_path, capsys):
    """A converted (2, 2) Llama whose tokenizer adds BOS (as Llama 3's does), with a chat
    template and a generation_config.json listing two end ids: ptdp's prompt ids are
    `tokenizer(prompt)`'s, it stops where `generate(**tokenizer(prompt), do_sample=False)`
    stops, --chat gives `apply_chat_template`'s ids, and --to hf writes both end ids back."""
    import json

    from ptdp.cli import main
    from ptdp.data.tokenizer import load_tokenizer
    from ptdp.hf.convert import to_hf
    from ptdp.inference.prompts import Prompts
    from tests.hf.hf_models import hf_tokenizer
    hf_dir, prompt = tmp_path / "hf", "the quick brown"
    hf_tokenizer(TEXTS, hf_dir, 300, add_bos=True, chat_template=CHAT)
    hf = _hf_model(transformers.LlamaConfig(**{**DECODER, "vocab_size": 300},
                                            num_key_value_heads=2), hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    inputs = tok(prompt, return_tensors="pt")
    assert inputs["input_ids"][0, 0] == tok.bos_token_id
    free = hf.generate(**inputs, do_sample=False, max_new_tokens=NEW)[0, inputs["input_ids"].shape[1]:]
    stop = int(free[6])   # an end id transformers' own run reaches (at its first occurrence)
    hf.generation_config.eos_token_id = [tok.eos_token_id, stop]
    hf.generation_config.save_pretrained(str(hf_dir))
    final, _ = from_hf(hf_dir, tmp_path / "ckpt", ["parallel.pipeline=2", "parallel.tensor=2"])
    ours, made = LocalModel.from_checkpoint(final), Prompts(final / "tokenizer.json",
                                                            load_tokenizer(final / "tokenizer.json"))
    assert made.end_ids() == [tok.eos_token_id, stop]
    for chat in (False, True):
        ids = (tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       add_generation_prompt=True, tokenize=True)["input_ids"]
               if chat else inputs["input_ids"][0].tolist())
        assert made.encode(prompt, chat=chat) == ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), do_sample=False, max_new_tokens=NEW)
        theirs = theirs[0, len(ids):].tolist()
        assert generate(ours, ids, NEW, Sampling(), made.end_ids()) == theirs
        if not chat:
            assert theirs[-1] == stop and len(theirs) < NEW
        capsys.readouterr()
        assert main(["generate", str(final), "--prompt", prompt, "--max-new-tokens", str(NEW),
                     "--device", "cpu"] + (["--chat"] if chat else [])) == 0
        reply = tok.decode(ids + theirs, skip_special_tokens=True)[
            len(tok.decode(ids, skip_special_tokens=True)):]
        assert capsys.readouterr().out == (reply.lstrip() if chat else prompt + reply) + "\n"
    to_hf(final, tmp_path / "back")
    for name in ("generation_config.json", "config.json"):
        written = json.loads((tmp_path / "back" / name).read_text())
        assert written["eos_token_id"] == [tok.eos_token_id, stop], name
