"""Validation: pure range and consistency checks that collect every problem, one line each,
naming the key and how to fix it. Runs before any process group exists."""

from __future__ import annotations

import dataclasses
import math
import os

from ptdp.config.catalogue import Chunks, DEFAULT, NAMES, SCHEDULES, ScheduleSpec, names_where
from ptdp.config.compilation import check_compile_layers, check_cuda_graphs
from ptdp.config.experts import check_moe_layout, check_moe_model
from ptdp.config.latent import check_latent_attention, check_latent_layout
from ptdp.config.mtp import check_mtp_layout, check_mtp_model
from ptdp.config.models import (ACTIVATIONS, DEFAULT_PRESET, EXTRA_BLOCK_OPTIONS, FAMILY_NAMES,
                                MODEL_FAMILIES, PRESETS, Samples, family_names)
from ptdp.config.problems import Problems as _Problems
from ptdp.config.recompute import check_recompute_modules
from ptdp.config.rope import check_rope
from ptdp.config.run_length import check_rampup_layout, check_run_length_and_schedule
from ptdp.config.stages import stage_layers_problem
from ptdp.config.windows import check_window, window_notes
from ptdp.config.schema import (AUTO_LOAD, Config, ConfigError, DataConfig, ModelConfig,
                                ParallelConfig, TrainConfig)


def parse_split(split: str) -> list[float]:
    """'98,1,1' -> [98.0, 1.0, 1.0] (train, valid, test; missing ratios are 0)."""
    try:
        ratios = [float(x) for x in str(split).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"data.split must be comma-separated numbers like 98,1,1, "
                          f"got {split!r}") from None
    if not 1 <= len(ratios) <= 3 or min(ratios) < 0 or sum(ratios) <= 0 \
            or not all(math.isfinite(r) for r in ratios):
        raise ConfigError(f"data.split must be up to three non-negative ratios (train,valid,test) "
                          f"with a positive sum, like 98,1,1; got {split!r}")
    return ratios + [0.0] * (3 - len(ratios))


def parse_paths(paths: list) -> list[tuple[float, str]]:
    """`[prefix]` or `[weight, prefix, weight, prefix, ...]` -> [(weight, prefix), ...]."""
    if len(paths) == 1:
        return [(1.0, str(paths[0]))]
    if len(paths) == 0 or len(paths) % 2:
        raise ConfigError(f"data.paths must be [prefix] or [weight, prefix, weight, prefix, ...], "
                          f"got {paths}")
    pairs = []
    for weight, prefix in zip(paths[::2], paths[1::2]):
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise ConfigError(f"data.paths: expected a weight before '{prefix}', got {weight!r}") from None
        if w < 0:
            raise ConfigError(f"data.paths: weight of '{prefix}' is negative ({w})")
        pairs.append((w, str(prefix)))
    if sum(w for w, _ in pairs) <= 0:
        raise ConfigError(f"data.paths: the weights must not all be zero, got {paths}")
    return pairs


def validate_model(m: ModelConfig) -> None:
    problems = _Problems()
    _check_model(m, problems)
    if problems.lines:
        raise ConfigError(problems.lines)


def validate(cfg: Config, world_size: int) -> list[str]:
    """Check the whole config against the world size; fills parallel.data when it is None.

    Raises one ConfigError listing every problem found (`err.errors`, one line each); returns
    notes (accepted settings worth a line in `ptdp check`).
    """
    problems = _Problems()
    model_ok = _check_model(cfg.model, problems)
    train_ok = _check_train(cfg.train, problems)
    _check_data(cfg.data, problems)
    _check_document_options(cfg, problems)
    _check_log_and_checkpoint(cfg, problems)
    check_recompute_modules(cfg, problems)
    # The layout divides model and batch sizes: only meaningful once those are sane.
    if _check_parallel_sizes(cfg.parallel, problems) and model_ok and train_ok:
        _check_layout(cfg, world_size, problems)
    if problems.lines:
        raise ConfigError(problems.lines)
    return window_notes(cfg.model)


def _check_model(m: ModelConfig, out: _Problems) -> bool:
    before = len(out.lines)
    out.choice(m.arch, FAMILY_NAMES, "model.arch")
    family = MODEL_FAMILIES.get(m.arch)   # None when unknown: the line above says so
    sizes_ok = all([out.positive(getattr(m, key), f"model.{key}") for key in
                    ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size",
                     "ffn_hidden_size")])
    if sizes_ok and m.head_dim is None:   # (derived from these when they divide)
        sizes_ok = out.require(False, f"model.hidden_size ({m.hidden_size}) must be divisible "
                                      f"by model.num_heads ({m.num_heads}), or set model.head_dim")
    elif sizes_ok:
        sizes_ok = out.positive(m.head_dim, "model.head_dim", hint=" (null = hidden_size / "
                                                                   "num_heads)")
    out.require(0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}")
    out.require(m.attention_dropout is None or 0.0 <= m.attention_dropout < 1.0,
                f"model.attention_dropout must be in [0, 1) or null (= model.dropout), got "
                f"{m.attention_dropout}")
    out.positive(m.layernorm_eps, "model.layernorm_eps")
    out.positive(m.init_std, "model.init_std")
    out.positive(m.num_tokentypes, "model.num_tokentypes")
    if family and family.samples is Samples.SENTENCE_PAIRS:
        out.require(m.seq_length >= 5, f"model.seq_length={m.seq_length} is too short for BERT "
                                       f"([CLS] A [SEP] B [SEP] needs at least 5)")
    _check_block(m, out, sizes_ok)
    check_moe_model(m, out)
    check_latent_attention(m, out)
    check_mtp_model(m, out)
    check_window(m, out)
    return len(out.lines) == before


def _check_block(m: ModelConfig, out: _Problems, sizes_ok: bool) -> None:
    """The block options (preset, positions, norm, activation, grouped-query attention)."""
    family = MODEL_FAMILIES.get(m.arch)
    out.choice(m.preset, tuple(PRESETS), "model.preset")
    out.choice(m.position_embedding, ("learned", "rope"), "model.position_embedding")
    out.choice(m.normalization, ("layernorm", "rmsnorm"), "model.normalization")
    out.choice(m.activation, ACTIVATIONS, "model.activation")
    if family and not family.block_options:
        block = PRESETS[DEFAULT_PRESET]
        changed = [k for k, v in block.items() if getattr(m, k) != v]
        changed += ["qkv_bias"] if m.qkv_bias != m.bias else []
        changed += ["num_kv_heads"] if m.num_kv_heads != m.num_heads else []
        changed += [k for k, off in EXTRA_BLOCK_OPTIONS.items() if getattr(m, k) != off]
        changed += ["head_dim"] if m.head_dim != m.hidden_size // max(m.num_heads, 1) else []
        out.require(not changed, f"model.arch={m.arch} uses the GPT-2 block (Megatron-BERT); "
                                 f"{', '.join('model.' + k for k in changed)} apply to "
                                 f"model.arch={family_names(lambda f: f.block_options)} only")
    if m.position_embedding == "rope":
        check_rope(m, out, sizes_ok)
    else:   # rotary keys would do nothing: say so rather than ignore them
        unused = [f.name for f in dataclasses.fields(ModelConfig)
                  if f.name.startswith("rope_") and getattr(m, f.name) != f.default]
        out.require(not unused, f"{', '.join('model.' + k for k in unused)} apply to "
                                f"model.position_embedding=rope only (this model has "
                                f"{m.position_embedding} positions)")
    _check_max_positions(m, out)
    # (checked once the sizes are: a bad num_heads is then reported once, not twice)
    if sizes_ok and out.positive(m.num_kv_heads, "model.num_kv_heads",
                                 hint=" (null = model.num_heads)"):
        out.require(m.num_heads % m.num_kv_heads == 0,
                    f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads "
                    f"({m.num_kv_heads}): each K/V head serves a group of query heads")


def _check_max_positions(m: ModelConfig, out: _Problems) -> None:
    limit = m.max_position_embeddings
    if limit is None:
        return
    if m.position_embedding != "rope":
        out.require(limit == m.seq_length, f"model.max_position_embeddings={limit} applies to "
                                           f"rotary positions only: learned positions have a "
                                           f"table of model.seq_length ({m.seq_length}) rows")
    else:
        out.require(limit >= m.seq_length, f"model.seq_length={m.seq_length} is past the "
                                           f"{limit} positions the model supports "
                                           f"(model.max_position_embeddings)")


def _check_train(tr: TrainConfig, out: _Problems) -> bool:
    """Ranges of the training keys; False if the batch sizes cannot be used in the layout."""
    batches_ok = all([out.require(tr.micro_batch_size >= 1, f"train.micro_batch_size must be "
                                                            f">= 1, got {tr.micro_batch_size}"),
                      out.require(tr.global_batch_size >= 1, f"train.global_batch_size must be "
                                                             f">= 1, got {tr.global_batch_size}")])
    out.require(tr.iters >= 0, f"train.iters must be >= 0, got {tr.iters}")
    out.require(tr.seed >= 0, f"train.seed must be >= 0, got {tr.seed}")
    out.choice(tr.precision, ("fp32", "bf16", "fp16"), "train.precision")
    out.choice(tr.recompute, ("none", "full", "selective"), "train.recompute")
    out.require(tr.recompute_num_layers >= 1,
                f"train.recompute_num_layers must be >= 1, got {tr.recompute_num_layers}")
    ramp_ok = check_run_length_and_schedule(tr, out)
    _check_optimizer(tr, out)
    out.positive(tr.grad_bucket_mb, "train.grad_bucket_mb")
    out.positive(tr.initial_loss_scale, "train.initial_loss_scale",
                 hint=" (the fp16 loss scale starts here; 65536 is usual)")
    out.positive(tr.eval_interval, "train.eval_interval", strict=False, hint=" (0 disables validation)")
    if tr.eval_interval > 0:
        out.require(tr.eval_iters >= 1,
                    f"train.eval_iters must be >= 1 when train.eval_interval > 0, got "
                    f"{tr.eval_iters}; set train.eval_iters or train.eval_interval=0")
    out.choice(tr.device, ("auto", "cpu", "cuda"), "train.device")
    out.positive(tr.timeout_s, "train.timeout_s")
    out.positive(tr.startup_timeout_s, "train.startup_timeout_s")
    out.require(tr.fp16_max_skips >= 1, f"train.fp16_max_skips must be >= 1, got {tr.fp16_max_skips}")
    if tr.grad_reduce_dtype is not None:   # (null: fp32, as older configs spelled it)
        out.choice(tr.grad_reduce_dtype, ("fp32", "bf16"), "train.grad_reduce_dtype")
    return batches_ok and ramp_ok


def _check_optimizer(tr: TrainConfig, out: _Problems) -> None:
    out.positive(tr.weight_decay, "train.weight_decay", strict=False, hint=" (0 disables it)")
    for key in ("adam_beta1", "adam_beta2"):
        value = getattr(tr, key)
        out.require(0.0 <= value < 1.0, f"train.{key} must be in [0, 1), got {value}")
    out.positive(tr.adam_eps, "train.adam_eps")
    out.positive(tr.clip_grad, "train.clip_grad", strict=False, hint=" (0 disables clipping)")


def _check_data(data: DataConfig, out: _Problems) -> None:
    out.choice(data.source, ("synthetic", "indexed"), "data.source")
    ratios = out.parse(parse_split, data.split)
    if data.source == "indexed":
        if out.require(len(data.paths) > 0,
                       "data.source=indexed needs data.paths (a list of dataset prefixes)"):
            out.parse(parse_paths, data.paths)
        if ratios is not None:
            out.require(ratios[0] > 0, f"data.split={data.split!r} leaves nothing to train on: "
                                       f"the first (train) ratio must be positive")
    out.positive(data.num_workers, "data.num_workers", strict=False)
    out.require(0.0 < data.mask_prob < 1.0, f"data.mask_prob must be in (0, 1), got {data.mask_prob}")
    out.choice(data.sampling, ("ptdp", "megatron"), "data.sampling")


EOD_OPTIONS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def _check_document_options(cfg: Config, out: _Problems) -> None:
    """Megatron's sample order and the end-of-document options exist for documents (GPT) on
    indexed data."""
    data, arch = cfg.data, cfg.model.arch
    family = MODEL_FAMILIES.get(arch)   # None when unknown (_check_model says so)
    documents = family is not None and family.samples is Samples.DOCUMENTS
    which = family_names(lambda f: f.samples is Samples.DOCUMENTS)
    used = [f"data.{key}=true" for key in EOD_OPTIONS if getattr(data, key)]
    if data.sampling == "megatron":
        out.require(data.source == "indexed" and documents,
                    f"data.sampling=megatron needs data.source=indexed and model.arch={which} "
                    f"(got {data.source}, {arch}): it is Megatron's GPTDataset order")
    if used:
        out.require(data.source == "indexed" and documents,
                    f"{', '.join(used)} needs data.source=indexed and model.arch={which} (got "
                    f"{data.source}, {arch}): the options act on the <eod> tokens of real documents")


def _check_log_and_checkpoint(cfg: Config, out: _Problems) -> None:
    ck = cfg.checkpoint
    out.require(cfg.log.interval >= 1, f"log.interval must be >= 1, got {cfg.log.interval}")
    out.positive(ck.save_interval, "checkpoint.save_interval", strict=False,
                 hint=" (0 saves only at the end)")
    out.require(ck.load != AUTO_LOAD or bool(ck.dir),
                "checkpoint.load=auto resumes from the newest checkpoint in checkpoint.dir: set "
                "checkpoint.dir")
    if ck.mtbf_hours is not None:
        out.positive(ck.mtbf_hours, "checkpoint.mtbf_hours", hint=" (null: no suggestion)")
    out.positive(ck.keep_last, "checkpoint.keep_last", strict=False, hint=" (0 keeps every one)")
    out.positive(ck.keep_every, "checkpoint.keep_every", strict=False, hint=" (0: none kept)")
    out.require(ck.keep_every <= 0 or ck.keep_last > 0,
                "checkpoint.keep_every keeps some of the checkpoints checkpoint.keep_last would "
                "delete: set checkpoint.keep_last too")
    _check_load_options(cfg, out)


def _check_load_options(cfg: Config, out: _Problems) -> None:
    """checkpoint.load_optimizer/load_rng/finetune act on the checkpoint checkpoint.load names
    (a job's own checkpoints always resume whole: ptdp/checkpoint/load.py)."""
    ck, log = cfg.checkpoint, cfg.log
    used = [key for key, on in (("load_optimizer=false", not ck.load_optimizer),
                                ("load_rng=false", not ck.load_rng),
                                ("finetune=true", ck.finetune)) if on]
    if used and ck.load in (None, AUTO_LOAD):
        out.require(False, f"checkpoint.{used[0]} acts on the checkpoint checkpoint.load names: "
                           f"set checkpoint.load to its path (got {ck.load})")
    elif ck.finetune and ck.dir and _inside(ck.load, ck.dir):
        out.require(False, f"checkpoint.finetune=true: checkpoint.load ({ck.load}) lies in "
                           f"checkpoint.dir ({ck.dir}), whose newest checkpoint a restart resumes: "
                           f"save the fine-tuning run to another checkpoint.dir")
    out.require(log.wandb_name is None or bool(log.wandb_project),
                "log.wandb_name names a run of log.wandb_project: set log.wandb_project")


def _inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or directly in it (a checkpoint root or one of its iter_N)."""
    p, f = os.path.abspath(path), os.path.abspath(folder)
    return p == f or os.path.dirname(p) == f


def _check_parallel_sizes(par: ParallelConfig, out: _Problems) -> bool:
    ok = all([out.require(getattr(par, key) >= 1, f"parallel.{key} must be >= 1, got "
                                                  f"{getattr(par, key)}")
              for key in ("tensor", "pipeline", "chunks", "context", "expert")])
    if par.data is not None:
        ok = out.require(par.data >= 1, f"parallel.data must be >= 1, got {par.data}") and ok
    return ok


def _check_layout(cfg: Config, world_size: int, out: _Problems) -> None:
    """(p, t, c, d, e, v) against the world size, the model's sizes, the schedule and the batch."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    t, p, c = par.tensor, par.pipeline, par.context
    model_ranks = p * t * c
    names = "parallel.pipeline * parallel.tensor" + (" * parallel.context" if c > 1 else "")
    sizes = f"{p} * {t}" + (f" * {c}" if c > 1 else "")
    if par.data is None:
        if not out.require(world_size % model_ranks == 0,
                           f"world size {world_size} is not divisible by {names} = {sizes}; "
                           f"launch a multiple of {model_ranks} ranks"):
            return
        par.data = world_size // model_ranks
    d = par.data
    suggestion = world_size // model_ranks if world_size % model_ranks == 0 else "?"
    out.require(model_ranks * d == world_size,
                f"{names} * parallel.data = {sizes} * {d} = {model_ranks * d} but the world size "
                f"is {world_size}; set parallel.data={suggestion} or launch {model_ranks * d} ranks")
    grouped = ("num_kv_heads",) if m.num_kv_heads != m.num_heads else ()
    for key in ("num_heads", *grouped, "hidden_size", "ffn_hidden_size"):
        out.require(getattr(m, key) % t == 0, f"model.{key} ({getattr(m, key)}) must be "
                                              f"divisible by parallel.tensor ({t})")
    _check_stage_layers(cfg, out)
    if par.scatter_gather:
        out.require(p > 1, "parallel.scatter_gather=true only applies with parallel.pipeline > 1")
    if par.sequence_parallel:
        _check_sequence_parallel(cfg, out)
    if c > 1:
        _check_context(cfg, out)
    check_moe_layout(cfg, out)
    check_latent_layout(cfg, out)
    check_mtp_layout(cfg, out)
    check_compile_layers(cfg, out)
    check_cuda_graphs(cfg, out)
    if out.require(tr.global_batch_size % (tr.micro_batch_size * d) == 0,
                   f"train.global_batch_size ({tr.global_batch_size}) must be divisible by "
                   f"train.micro_batch_size * parallel.data = {tr.micro_batch_size} * {d} = "
                   f"{tr.micro_batch_size * d}"):
        _check_schedule(cfg, out)
    else:
        out.choice(cfg.schedule.name, NAMES, "schedule.name")


def _check_stage_layers(cfg: Config, out: _Problems) -> None:
    """Even stages need p*v to divide the layers; uneven ones are checked by the one rule of
    ptdp/config/stages.py."""
    m, p, v = cfg.model, cfg.parallel.pipeline, cfg.parallel.chunks
    if cfg.parallel.stage_layers is None:
        out.require(m.num_layers % (p * v) == 0,
                    f"model.num_layers ({m.num_layers}) must be divisible by parallel.pipeline * "
                    f"parallel.chunks = {p} * {v} = {p * v} (or set parallel.stage_layers)")
        return
    problem = stage_layers_problem(list(cfg.parallel.stage_layers), m.num_layers, p * v)
    out.require(problem is None, problem or "")


def _check_sequence_parallel(cfg: Config, out: _Problems) -> None:
    par, s = cfg.parallel, cfg.model.seq_length
    if not out.require(par.tensor > 1, "parallel.sequence_parallel=true needs parallel.tensor > 1 "
                                       "(it splits the sequence across the tensor group)"):
        return
    out.require(s % par.tensor == 0, f"parallel.sequence_parallel=true needs model.seq_length "
                                     f"({s}) divisible by parallel.tensor ({par.tensor})")
    out.require(not par.scatter_gather,
                "parallel.scatter_gather=true is implied by parallel.sequence_parallel=true (stage "
                "boundary tensors are already 1/t of the sequence); set it false")
    spec = SCHEDULES.get(cfg.schedule.name)
    out.require(spec is None or spec.allows_sequence_parallel,
                f"parallel.sequence_parallel=true is not supported with schedule.name="
                f"{cfg.schedule.name}; use a flushing schedule "
                f"({', '.join(names_where(lambda s: s.allows_sequence_parallel))})")


def _check_context(cfg: Config, out: _Problems) -> None:
    """Context parallelism: 2c chunks of the sequence (times t with sequence parallelism), a
    causal decoder, no dropout (the ring applies none). Packed documents and sliding windows
    are exact through the ring (ptdp/parallel/ring_attention.py)."""
    m, par = cfg.model, cfg.parallel
    c, s = par.context, m.seq_length
    sp = par.sequence_parallel and par.tensor > 1
    cuts = 2 * c * (par.tensor if sp else 1)
    how = (f"2 * parallel.context * parallel.tensor = 2 * {c} * {par.tensor} = {cuts} (2c chunks, "
           f"each split over the tensor ranks by sequence parallelism)" if sp
           else f"2 * parallel.context = {cuts} (2c chunks: rank i holds chunks i and 2c-1-i)")
    out.require(s % cuts == 0, f"parallel.context={c} needs model.seq_length ({s}) divisible by "
                               f"{how}")
    out.require(m.family.causal, f"parallel.context={c} supports model.arch="
                                 f"{family_names(lambda f: f.causal)} only (causal "
                                 f"decoders): BERT's padding mask and [CLS] heads are not split "
                                 f"over a context group; set parallel.context=1")
    out.require(m.attention_dropout_rate == 0.0,
                f"parallel.context={c} needs model.attention_dropout=0 (got "
                f"{m.attention_dropout_rate}; null follows model.dropout): the ring attention "
                f"applies no attention dropout")
    out.require(m.dropout == 0.0, f"parallel.context={c} needs model.dropout=0 (got {m.dropout}): "
                                  f"context parallelism is built and tested without hidden dropout")


def _check_schedule(cfg: Config, out: _Problems) -> None:
    name, p, v = cfg.schedule.name, cfg.parallel.pipeline, cfg.parallel.chunks
    if not out.choice(name, NAMES, "schedule.name"):
        return
    spec = SCHEDULES[name]
    out.require(not cfg.schedule.vertical_sync or spec.allows_vertical_sync,
                f"schedule.vertical_sync=true only applies to schedule.name="
                f"{' or '.join(names_where(lambda s: s.allows_vertical_sync))} (got {name})")
    out.require(not cfg.train.distributed_optimizer or spec.allows_distributed_optimizer,
                f"train.distributed_optimizer=true does not work with schedule.name={name}: its "
                f"weight versions keep one storage per tensor, not the flat buffers the "
                f"distributed optimizer shards; use "
                f"{_either(names_where(lambda s: s.allows_distributed_optimizer))}, or "
                f"train.distributed_optimizer=false")
    _check_update_rule(cfg, spec, out)
    _check_chunks(cfg, spec, out)
    if cfg.train.rampup_batch_size:
        check_rampup_layout(cfg, spec, out)
    least = spec.min_micro_batches(p, v)
    if least > 1:
        _check_min_micro_batches(cfg, least, out)


def _either(names: tuple) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _check_chunks(cfg: Config, spec: ScheduleSpec, out: _Problems) -> None:
    """v model chunks per rank: only schedules that interleave take v > 1."""
    name, p, v = spec.name, cfg.parallel.pipeline, cfg.parallel.chunks
    if spec.chunks is Chunks.ONE:
        out.require(v == 1, f"parallel.chunks={v} needs schedule.name="
                            f"{' or '.join(names_where(lambda s: s.chunks is not Chunks.ONE))} "
                            f"(got {name})")
        return
    if spec.chunks is Chunks.REQUIRED:
        out.require(p > 1, f"schedule.name={name} needs parallel.pipeline > 1; use "
                           f"schedule.name={DEFAULT.name} for a single stage")
        out.require(v > 1, f"schedule.name={name} needs parallel.chunks > 1 (v model chunks per "
                           f"pipeline rank); set parallel.chunks=2 or more, or use "
                           f"schedule.name={DEFAULT.name}")
    elif v > 1:
        out.require(p > 1, f"schedule.name={name} with parallel.chunks > 1 needs "
                           f"parallel.pipeline > 1")
    if spec.interleaves(v):   # micro-batches go through the chunks in groups of p
        _require_multiple_of_p(cfg, out)


def _require_multiple_of_p(cfg: Config, out: _Problems) -> None:
    mb, p, name = cfg.num_micro_batches, cfg.parallel.pipeline, cfg.schedule.name
    out.require(mb % p == 0,
                f"schedule.name={name} needs the number of micro-batches per pipeline "
                f"(train.global_batch_size / (train.micro_batch_size * parallel.data) = {mb}) "
                f"to be a multiple of parallel.pipeline ({p})")


def _check_min_micro_batches(cfg: Config, least: int, out: _Problems) -> None:
    """PipeDream-2BW: m >= p micro-batches per batch, more when interleaved."""
    name, p, v, mb = cfg.schedule.name, cfg.parallel.pipeline, cfg.parallel.chunks, \
        cfg.num_micro_batches
    why = "m >= p" if v == 1 else "m >= p and m*v >= rank 0's interleaved warm-up 2(p-1)+(v-1)p"
    out.require(mb >= least,
                f"schedule.name={name} needs at least {least} micro-batches per pipeline with "
                f"parallel.pipeline={p}, parallel.chunks={v} ({why}: the weights made from batch "
                f"t are first used by batch t+2), got train.global_batch_size / "
                f"(train.micro_batch_size * parallel.data) = {mb}")


def _check_update_rule(cfg: Config, spec: ScheduleSpec, out: _Problems) -> None:
    """PipeDream async updates each stage after every input: no global norm, no common skip."""
    tr = cfg.train
    if not spec.allows_clipping:
        out.require(tr.clip_grad == 0,
                    f"schedule.name={spec.name} needs train.clip_grad=0 (got {tr.clip_grad}): each "
                    f"stage updates as soon as its backward of an input ends, so there is no "
                    f"gradient norm of the whole model to clip by")
    if not spec.allows_fp16:
        out.require(tr.precision != "fp16",
                    f"schedule.name={spec.name} does not support train.precision=fp16: a dynamic "
                    f"loss scale would need every stage to agree on skipping each input's "
                    f"update; use bf16")
