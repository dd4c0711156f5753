"""ptdp generate: the KV cache gives what recomputing every position gives, sampling is
seeded and its cuts do what they say, and the command reads a checkpoint of another layout.
A tiny random GPT in one process: no ranks to spawn."""

from __future__ import annotations

import pytest
import torch

from ptdp.config import ModelConfig, load_config
from ptdp.inference.generate import KVCache, Sampling, forward_cached, generate, next_token
from ptdp.inference.local_model import LocalModel, initial_state

CFG = ModelConfig(arch="gpt", num_layers=3, hidden_size=32, num_heads=4, seq_length=24,
                  vocab_size=600, init_std=0.3)


@pytest.fixture(scope="module")
def model():
    return LocalModel(CFG, initial_state(CFG, seed=3))


def test_cached_logits_equal_the_full_forward(model):
    tokens = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    full = model.logits(tokens)
    cache = KVCache(CFG.num_layers)
    parts = [forward_cached(model, tokens[:, :7], cache)]                   # a prompt
    parts += [forward_cached(model, tokens[:, i:i + 1], cache) for i in range(7, 12)]  # steps
    parts.append(forward_cached(model, tokens[:, 12:], cache))             # several at once
    assert cache.length == 20
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_the_cache_holds_latent_attentions_keys_and_values():
    """With latent attention (DeepSeek's) the cache keeps every head's keys and values, which
    the latent expands to; cached logits equal the full forward's."""
    cfg = ModelConfig(arch="gpt", preset="llama", num_layers=2, hidden_size=32, num_heads=4,
                      head_dim=8, mla_kv_lora_rank=12, mla_q_lora_rank=16, mla_rope_head_dim=4,
                      mla_v_head_dim=6, seq_length=24, vocab_size=600, init_std=0.3)
    latent = LocalModel(cfg, initial_state(cfg, seed=3))
    tokens = torch.randint(0, 600, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg.num_layers)
    parts = [forward_cached(latent, tokens[:, :7], cache)]
    parts += [forward_cached(latent, tokens[:, i:i + 1], cache) for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), latent.logits(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.9, 20, 0.9, seed=5)])
def test_generation_with_cache_equals_generation_without(model, sampling):
    prompt = [5, 77, 301, 9]
    cached = generate(model, prompt, 15, sampling)
    plain = generate(model, prompt, 15, sampling, use_cache=False)
    assert cached == plain and len(cached) == 15


def test_seed_fixes_the_sample_and_changes_it(model):
    prompt = [5, 77, 301]
    one = generate(model, prompt, 12, Sampling(1.0, seed=1))
    assert one == generate(model, prompt, 12, Sampling(1.0, seed=1))
    assert one != generate(model, prompt, 12, Sampling(1.0, seed=2))


def test_top_k_and_top_p_cuts():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, Sampling(0.0), gen) == 1
    assert {next_token(logits, Sampling(5.0, top_k=1), gen) for _ in range(20)} == {1}
    drawn = {next_token(logits, Sampling(50.0, top_k=2), gen) for _ in range(200)}
    assert drawn == {1, 2}
    # probabilities ~ [.02, .36, .33, .01, .29]: p=0.5 keeps the two likeliest, p=0.3 one
    assert {next_token(logits, Sampling(1.0, top_p=0.5), gen) for _ in range(200)} == {1, 2}
    assert {next_token(logits, Sampling(1.0, top_p=0.3), gen) for _ in range(50)} == {1}


def test_stops_at_the_stop_token_and_the_context_length(model):
    prompt = [5, 77]
    first = generate(model, prompt, 5, Sampling())
    assert generate(model, prompt, 5, Sampling(), stop_ids=[first[1]]) == first[:2]
    assert len(generate(model, prompt, 100, Sampling())) == CFG.seq_length - len(prompt)
    with pytest.raises(ValueError, match="seq_length=24"):
        generate(model, list(range(24)), 1, Sampling())


def test_generate_command_reads_a_two_by_two_checkpoint(model, tmp_path, capsys):
    """A (p, t) = (2, 2) checkpoint (written by save_full_state) with a tokenizer: the command
    prints each prompt and the greedy continuation the in-process model gives."""
    from ptdp.checkpoint.save import save_full_state
    from ptdp.cli import main
    from ptdp.data.tokenizer import Tokenizer, train_tokenizer
    from tests.data.conftest import load_make_corpus
    corpus = tmp_path / "corpus.jsonl"
    assert load_make_corpus().main(["--output", str(corpus), "--max-docs", "300"]) == 0
    tok = train_tokenizer(corpus, tmp_path / "tok", CFG.vocab_size, "bpe")
    cfg = load_config(None, [f"model.{k}={v}" for k, v in vars(CFG).items()]
                      + ["parallel.pipeline=3", "parallel.tensor=2"], world_size=6)
    cfg.data.tokenizer = str(tok.path)
    save_full_state(model.full_state(), cfg, tmp_path / "ckpt")
    capsys.readouterr()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Return the value\n\nThe file\n")
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt-file", str(prompts),
                 "--max-new-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "--- prompt 1" and out[2] == "--- prompt 2"
    for line, text in ((out[1], "Return the value"), (out[3], "The file")):
        ids = Tokenizer(tok.path).encode(text)
        new = generate(model, ids, 6, Sampling())
        assert line == Tokenizer(tok.path).decode(ids + new), line
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # the suite hides the GPUs (tests/conftest.py): --device cuda is one line, exit 2
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "x", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ptdp generate: ptdp generate --device cuda, but no CUDA device is visible (use cpu)"]
