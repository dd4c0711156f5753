"""Typed configuration: dataclasses loaded from YAML, dotted `key=value` overrides, validation.

Everything here is plain Python (no torch), so the planner and the CLI can use it cheaply and
validation runs before any process group exists. Every error names the offending key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the key and says how to fix it."""


VOCAB_PAD_MULTIPLE = 128  # vocab is padded to a multiple of 128 * t (GEMM-friendly shards)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw", "pipedream")
FLUSHING_SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass
class ModelConfig:
    arch: str = "gpt"                    # gpt | bert
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: int | None = None   # default 4 * hidden_size
    seq_length: int = 32
    vocab_size: int = 256                # the tokenizer's real size; padded internally
    dropout: float = 0.0                 # hidden and attention dropout
    layernorm_eps: float = 1e-5
    init_std: float = 0.02
    num_tokentypes: int = 2              # BERT segment embeddings

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class ParallelConfig:
    tensor: int = 1                      # t
    pipeline: int = 1                    # p
    data: int | None = None              # d; None = world_size / (p * t)
    chunks: int = 1                      # v, model chunks per pipeline rank (interleaving)
    scatter_gather: bool = False         # send 1/t of each boundary tensor, all-gather after


@dataclass
class ScheduleConfig:
    name: str = "1f1b"                   # gpipe | 1f1b | interleaved | 2bw | pipedream


@dataclass
class TrainConfig:
    micro_batch_size: int = 2            # b
    global_batch_size: int = 8           # B
    iters: int = 10
    seed: int = 1234
    precision: str = "fp32"              # fp32 | bf16 | fp16
    recompute: str = "none"              # none | full | selective
    recompute_num_layers: int = 1        # layers per checkpointed group with recompute=full
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"       # cosine | linear | constant
    lr_decay_iters: int | None = None    # default: iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0               # 0 disables clipping
    grad_bucket_mb: float = 25.0         # data-parallel all-reduce bucket size
    initial_loss_scale: float = 2.0 ** 16
    fp16_max_skips: int = 10             # stop after this many overflows in a row at scale 1
    eval_interval: int = 0               # 0 disables validation
    eval_iters: int = 2
    device: str = "auto"                 # auto | cpu | cuda
    timeout_s: float = 600.0             # every collective gives up after this long


@dataclass
class DataConfig:
    source: str = "synthetic"            # synthetic | indexed
    paths: list = field(default_factory=list)  # [path] or [weight, path, weight, path, ...]
    tokenizer: str | None = None         # sentencepiece .model file
    split: str = "98,1,1"                # train,valid,test ratios
    num_workers: int = 0
    mask_prob: float = 0.15              # BERT masking


@dataclass
class LogConfig:
    interval: int = 1
    metrics_file: str | None = None
    trace_file: str | None = None
    tensorboard_dir: str | None = None
    progress: bool = True                # tqdm bar on rank 0 (only when stderr is a terminal)
    hardware: str | None = None          # profile name/path for MFU; auto-detected on known GPUs


@dataclass
class CheckpointConfig:
    dir: str | None = None
    save_interval: int = 0               # 0 = only at the end when dir is set
    load: str | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # Derived quantities used everywhere -------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        """m: micro-batches per data-parallel rank per iteration."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data)

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.model.vocab_size, self.parallel.tensor)


def padded_vocab_size(vocab_size: int, tensor: int) -> int:
    multiple = VOCAB_PAD_MULTIPLE * tensor
    return int(math.ceil(vocab_size / multiple) * multiple)


# --------------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------------

def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise naming the key."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if hint is list or origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def _apply_section(section_obj: Any, values: dict, section: str) -> None:
    hints = typing.get_type_hints(type(section_obj))
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key '{section}.{key}'{_suggest(key, list(hints))}")
        setattr(section_obj, key, _coerce(value, hints[key], f"{section}.{key}"))


def config_from_dict(raw: dict, source: str = "config") -> Config:
    cfg = Config()
    cfg.model.ffn_hidden_size = None  # re-derived below from the loaded hidden_size
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    sections = typing.get_type_hints(Config)
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(f"unknown section '{section}' in {source}{_suggest(section, list(sections))}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a mapping of keys, got {values!r}")
        _apply_section(getattr(cfg, section), values, section)
    cfg.model.__post_init__()
    return cfg


def parse_overrides(overrides: list[str]) -> dict:
    """['train.iters=5', 'parallel.tensor=2'] -> nested dict (values parsed as YAML scalars)."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"override '{item}': the key must be section.key, e.g. train.iters=5")
        value = yaml.safe_load(text) if text.strip() else ""
        nested.setdefault(parts[0], {})[parts[1]] = value
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in (base or {}).items()}
    for section, values in extra.items():
        if isinstance(out.get(section), dict) and isinstance(values, dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


def read_yaml(path: str | os.PathLike) -> dict:
    """The YAML file's contents ({} if empty); ConfigError naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err


def load_config(path: str | os.PathLike | None, overrides: list[str] = (),
                world_size: int | None = None) -> Config:
    """Load YAML, apply overrides and validate. `world_size` defaults to $WORLD_SIZE or 1."""
    raw = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "overrides"
    raw = _merge(raw, parse_overrides(list(overrides)))
    cfg = config_from_dict(raw, source)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)
    return cfg


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _choice(value: str, options: tuple, key: str) -> None:
    if value not in options:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(options)}"
                          f"{_suggest(value, list(options))}")


def validate_model(m: ModelConfig) -> None:
    _choice(m.arch, ("gpt", "bert"), "model.arch")
    for key in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_hidden_size"):
        _require(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    _require(m.hidden_size % m.num_heads == 0,
             f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})")
    _require(0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}")


def validate(cfg: Config, world_size: int) -> None:
    """Check the whole config against the world size; fills parallel.data when it is None."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    validate_model(m)
    for key in ("tensor", "pipeline", "chunks"):
        _require(getattr(par, key) >= 1, f"parallel.{key} must be >= 1, got {getattr(par, key)}")
    t, p, v = par.tensor, par.pipeline, par.chunks
    if par.data is None:
        _require(world_size % (p * t) == 0,
                 f"world size {world_size} is not divisible by parallel.pipeline * parallel.tensor "
                 f"= {p} * {t}; launch a multiple of {p * t} ranks")
        par.data = world_size // (p * t)
    d = par.data
    _require(d >= 1, f"parallel.data must be >= 1, got {d}")
    _require(p * t * d == world_size,
             f"parallel.pipeline * parallel.tensor * parallel.data = {p} * {t} * {d} = {p * t * d} "
             f"but the world size is {world_size}; set parallel.data={world_size // (p * t) if world_size % (p * t) == 0 else '?'} "
             f"or launch {p * t * d} ranks")
    _require(m.num_heads % t == 0,
             f"model.num_heads ({m.num_heads}) must be divisible by parallel.tensor ({t})")
    _require(m.hidden_size % t == 0,
             f"model.hidden_size ({m.hidden_size}) must be divisible by parallel.tensor ({t})")
    _require(m.ffn_hidden_size % t == 0,
             f"model.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by parallel.tensor ({t})")
    _require(m.num_layers % (p * v) == 0,
             f"model.num_layers ({m.num_layers}) must be divisible by parallel.pipeline * "
             f"parallel.chunks = {p} * {v} = {p * v}")
    _choice(cfg.schedule.name, SCHEDULES, "schedule.name")
    _require(cfg.schedule.name in FLUSHING_SCHEDULES,
             f"schedule.name={cfg.schedule.name} is not runnable by the trainer yet (the planner "
             f"models it); use one of {', '.join(FLUSHING_SCHEDULES)}")
    if v > 1:
        _require(cfg.schedule.name == "interleaved",
                 f"parallel.chunks={v} needs schedule.name=interleaved (got {cfg.schedule.name})")
    if cfg.schedule.name == "interleaved":
        _require(p > 1, "schedule.name=interleaved needs parallel.pipeline > 1")
    _require(tr.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {tr.micro_batch_size}")
    _require(tr.global_batch_size % (tr.micro_batch_size * d) == 0,
             f"train.global_batch_size ({tr.global_batch_size}) must be divisible by "
             f"train.micro_batch_size * parallel.data = {tr.micro_batch_size} * {d} = "
             f"{tr.micro_batch_size * d}")
    mb = cfg.num_micro_batches
    if cfg.schedule.name == "interleaved":
        _require(mb % p == 0,
                 f"schedule.name=interleaved needs the number of micro-batches per pipeline "
                 f"(train.global_batch_size / (train.micro_batch_size * parallel.data) = {mb}) "
                 f"to be a multiple of parallel.pipeline ({p})")
    _choice(tr.precision, ("fp32", "bf16", "fp16"), "train.precision")
    _choice(tr.recompute, ("none", "full", "selective"), "train.recompute")
    _choice(tr.lr_decay_style, ("cosine", "linear", "constant"), "train.lr_decay_style")
    _choice(tr.device, ("auto", "cpu", "cuda"), "train.device")
    _require(tr.recompute_num_layers >= 1,
             f"train.recompute_num_layers must be >= 1, got {tr.recompute_num_layers}")
    _require(tr.iters >= 0, f"train.iters must be >= 0, got {tr.iters}")
    _require(tr.timeout_s > 0, f"train.timeout_s must be positive, got {tr.timeout_s}")
    _require(tr.fp16_max_skips >= 1, f"train.fp16_max_skips must be >= 1, got {tr.fp16_max_skips}")
    if par.scatter_gather:
        _require(p > 1, "parallel.scatter_gather=true only applies with parallel.pipeline > 1")
    _choice(cfg.data.source, ("synthetic", "indexed"), "data.source")
    if cfg.data.source == "indexed":
        _require(len(cfg.data.paths) > 0, "data.source=indexed needs data.paths (a list of dataset prefixes)")
    _require(cfg.log.interval >= 1, f"log.interval must be >= 1, got {cfg.log.interval}")
