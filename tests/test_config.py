"""Config loading, overrides and every validation error (before any process group exists)."""

import pytest

from ptdp.config import ConfigError, load_config, padded_vocab_size


def load(*overrides, world=1):
    return load_config(None, list(overrides), world_size=world)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.tensor=2", "parallel.pipeline=2", "parallel.data=1"], 8,
     "parallel.pipeline * parallel.tensor * parallel.data = 2 * 2 * 1 = 4 but the world size is 8"),
    (["parallel.tensor=3"], 6, "model.num_heads (4) must be divisible by parallel.tensor (3)"),
    (["model.num_heads=8", "model.hidden_size=36", "parallel.tensor=8"], 8,
     "model.hidden_size (36) must be divisible by model.num_heads (8)"),
    (["model.num_heads=6", "model.hidden_size=60", "parallel.tensor=3",
      "model.ffn_hidden_size=100"], 3, "model.ffn_hidden_size (100) must be divisible by parallel.tensor (3)"),
    (["model.num_layers=6", "parallel.pipeline=2", "parallel.chunks=2",
      "schedule.name=interleaved"], 2, "model.num_layers (6) must be divisible by parallel.pipeline * parallel.chunks = 2 * 2 = 4"),
    (["train.global_batch_size=10", "train.micro_batch_size=2", "parallel.data=2"], 2,
     "train.global_batch_size (10) must be divisible by train.micro_batch_size * parallel.data = 2 * 2 = 4"),
    (["parallel.tensr=2"], 1, "unknown key 'parallel.tensr' (did you mean 'tensor'?)"),
    (["modle.arch=gpt"], 1, "unknown section 'modle'"),
    (["train.iters=ten"], 1, "train.iters: expected an integer, got 'ten'"),
    (["train.lr=fast"], 1, "train.lr: expected a number, got 'fast'"),
    (["parallel.scatter_gather=maybe"], 1, "parallel.scatter_gather: expected true or false"),
    (["schedule.name=1f1f"], 1, "schedule.name: '1f1f' is not one of"),
    (["schedule.name=2bw", "parallel.pipeline=2", "train.global_batch_size=2"], 2,
     "schedule.name=2bw needs at least 2 micro-batches per pipeline with parallel.pipeline=2"),
    (["schedule.name=2bw", "parallel.pipeline=4", "parallel.chunks=2", "model.num_layers=8",
      "train.global_batch_size=8", "train.micro_batch_size=2"], 4,
     "schedule.name=2bw needs at least 8 micro-batches per pipeline with parallel.pipeline=4, "
     "parallel.chunks=2 (m >= p and m*v >= rank 0's interleaved warm-up"),
    (["schedule.name=pipedream", "parallel.pipeline=2"], 2, "needs train.clip_grad=0 (got 1.0)"),
    (["schedule.name=2bw", "parallel.pipeline=2", "train.distributed_optimizer=true"], 4,
     "train.distributed_optimizer=true does not work with schedule.name=2bw: its weight versions "
     "keep one storage per tensor"),
    (["schedule.name=pipedream", "train.clip_grad=0", "train.distributed_optimizer=true"], 2,
     "train.distributed_optimizer=true does not work with schedule.name=pipedream"),
    (["train.distributed_optimizer=yes please"], 1,
     "train.distributed_optimizer: expected true or false"),
    (["schedule.name=pipedream", "train.clip_grad=0", "parallel.chunks=2", "model.num_layers=4"],
     1, "parallel.chunks=2 needs schedule.name=interleaved or 2bw (got pipedream)"),
    (["parallel.sequence_parallel=true"], 1,
     "parallel.sequence_parallel=true needs parallel.tensor > 1"),
    (["parallel.sequence_parallel=true", "parallel.tensor=2", "model.seq_length=15"], 2,
     "parallel.sequence_parallel=true needs model.seq_length (15) divisible by parallel.tensor (2)"),
    (["parallel.sequence_parallel=true", "parallel.tensor=2", "parallel.pipeline=2",
      "parallel.scatter_gather=true"], 4,
     "parallel.scatter_gather=true is implied by parallel.sequence_parallel=true"),
    (["parallel.sequence_parallel=true", "parallel.tensor=2", "schedule.name=2bw"], 2,
     "parallel.sequence_parallel=true is not supported with schedule.name=2bw"),
    (["schedule.vertical_sync=true"], 1,
     "schedule.vertical_sync=true only applies to schedule.name=pipedream (got 1f1b)"),
    (["parallel.pipeline=2", "parallel.chunks=2", "schedule.name=1f1b", "model.num_layers=4"], 2,
     "parallel.chunks=2 needs schedule.name=interleaved"),
    (["parallel.pipeline=4", "parallel.chunks=2", "schedule.name=interleaved", "model.num_layers=8",
      "train.global_batch_size=12", "train.micro_batch_size=2"], 4,
     "to be a multiple of parallel.pipeline (4)"),
    (["train.precision=fp8"], 1, "train.precision: 'fp8' is not one of fp32, bf16, fp16"),
    (["train.iters"], 1, "must look like section.key=value"),
    (["data.source=indexed"], 1, "data.source=indexed needs data.paths"),
])
def test_validation_names_the_offending_key(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        load(*overrides, world=world)
    assert message in str(err.value)


def test_data_parallel_size_is_derived_from_the_world():
    cfg = load("parallel.tensor=2", "parallel.pipeline=2", world=8)
    assert cfg.parallel.data == 2
    assert cfg.num_micro_batches == cfg.train.global_batch_size // (cfg.train.micro_batch_size * 2)


def test_world_not_divisible_by_model_parallel_size():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by"):
        load("parallel.tensor=4", world=6)


@pytest.mark.parametrize("vocab,t,padded", [(50257, 1, 50304), (50257, 2, 50432), (50257, 8, 51200),
                                            (256, 1, 256), (100, 4, 512)])
def test_vocab_is_padded_to_a_multiple_of_128_t(vocab, t, padded):
    assert padded_vocab_size(vocab, t) == padded


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hidden_size: 32\n  num_heads: 2\ntrain:\n  iters: 3\n")
    cfg = load_config(path, ["train.iters=7", "model.dropout=0.1"], world_size=1)
    assert (cfg.model.hidden_size, cfg.train.iters, cfg.model.dropout) == (32, 7, 0.1)
    assert cfg.model.ffn_hidden_size == 128  # default 4 * hidden, from the YAML's hidden


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml", world_size=1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, world_size=1)


def test_shipped_tiny_configs_load():
    for name in ("gpt_tiny", "bert_tiny"):
        cfg = load_config(f"configs/{name}.yaml", ["parallel.tensor=2", "parallel.pipeline=2"], world_size=8)
        assert cfg.parallel.data == 2


def test_every_problem_is_reported_one_line_each():
    with pytest.raises(ConfigError) as err:
        load("train.lr=-1", "train.adam_beta1=1.5", "train.clip_grad=-1", "parallel.tensor=3", world=3)
    assert len(err.value.errors) == 6 and str(err.value) == "\n".join(err.value.errors)
    for key in ("train.lr", "train.adam_beta1", "train.clip_grad", "model.num_heads",
                "model.hidden_size", "model.ffn_hidden_size"):
        assert sum(line.startswith(key) for line in err.value.errors) == 1, key


def test_a_yaml_list_is_not_a_config(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- train\n")
    with pytest.raises(ConfigError, match="top level must be a mapping of sections") as err:
        load_config(path, world_size=1)
    assert len(err.value.errors) == 1


# ------------------------------------------------------------------ Llama-style block options

def test_llama_preset_fills_only_the_options_left_unset(tmp_path):
    cfg = load("model.preset=llama", "model.hidden_size=4096", "model.num_heads=32")
    m = cfg.model
    assert (m.position_embedding, m.normalization, m.activation) == ("rope", "rmsnorm", "swiglu")
    assert (m.bias, m.qkv_bias, m.tie_embeddings, m.num_kv_heads) == (False, False, False, 32)
    assert m.ffn_hidden_size == 11008              # Llama's rule: 256 * ceil(8h/3 / 256)
    mixed = tmp_path / "qwen2.yaml"
    mixed.write_text("model: {preset: llama, qkv_bias: true, tie_embeddings: true}\n")
    m = load_config(mixed, world_size=1).model
    assert (m.bias, m.qkv_bias, m.tie_embeddings) == (False, True, True)
    m = load("model.position_embedding=rope").model   # a GPT with rotary positions only
    assert (m.position_embedding, m.normalization, m.bias, m.ffn_hidden_size) == (
        "rope", "layernorm", True, 4 * m.hidden_size)


@pytest.mark.parametrize("overrides,world,message", [
    (["model.preset=llama", "model.num_kv_heads=2", "parallel.tensor=4"], 4,
     "model.num_kv_heads (2) must be divisible by parallel.tensor (4)"),
    (["model.num_kv_heads=3"], 1,
     "model.num_heads (4) must be divisible by model.num_kv_heads (3)"),
    (["model.preset=lama"], 1, "model.preset: 'lama' is not one of gpt, llama (did you mean 'llama'?)"),
    (["model.arch=bert", "model.preset=llama"], 1, "model.arch=bert uses the GPT-2 block"),
    (["model.activation=relu"], 1, "model.activation: 'relu' is not one of gelu, gelu_tanh, swiglu, geglu"),
    (["model.position_embedding=rope", "model.hidden_size=36", "model.num_heads=4"], 1,
     "model.position_embedding=rope needs an even head size"),
    (["model.preset=llama", "model.rope_scaling_factor=0.5"], 1,
     "model.rope_scaling_factor must be >= 1"),
    (["model.arch=bert", "model.num_kv_heads=2"], 1,
     "model.num_kv_heads apply to model.arch=gpt only"),
    (["model.arch=bert", "model.qkv_bias=false"], 1, "model.qkv_bias apply to model.arch=gpt only"),
    (["model.rope_theta=500000", "model.rope_scaling_factor=8"], 1,
     "model.rope_theta, model.rope_scaling_factor apply to model.position_embedding=rope only"),
])
def test_bad_block_options_get_one_line_naming_the_key(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        load(*overrides, world=world)
    assert len(err.value.errors) == 1 and message in err.value.errors[0], err.value.errors
