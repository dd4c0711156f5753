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
    """One or more configuration problems; each names the key and says how to fix it.

    `errors` holds one line per problem; str() joins them with newlines.
    """

    def __init__(self, errors: str | list[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


VOCAB_PAD_MULTIPLE = 128  # vocab is padded to a multiple of 128 * t (GEMM-friendly shards)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "2bw", "pipedream")
FLUSHING_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
# What `ptdp train` runs (all of them; the one place a schedule would be refused).
TRAINER_SCHEDULES = SCHEDULES


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
    sequence_parallel: bool = False      # LayerNorm/dropout regions split along the sequence


@dataclass
class ScheduleConfig:
    name: str = "1f1b"                   # gpipe | 1f1b | interleaved | zb-h1 | 2bw | pipedream
    vertical_sync: bool = False          # pipedream: every stage uses the input stage's version


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
    distributed_optimizer: bool = False  # shard fp32 masters + Adam state over the data group
    initial_loss_scale: float = 2.0 ** 16
    fp16_max_skips: int = 10             # stop after this many overflows in a row at scale 1
    eval_interval: int = 0               # 0 disables validation
    eval_iters: int = 2
    device: str = "auto"                 # auto | cpu | cuda
    compile: bool | None = None          # torch.compile each layer; null = on for CUDA only
    timeout_s: float = 180.0             # every collective gives up after this long


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
    verbose: bool = False                # print the full resolved config at start-up (--verbose)


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


def _apply_section(section_obj: Any, values: dict, section: str, errors: list[str]) -> None:
    hints = typing.get_type_hints(type(section_obj))
    for key, value in values.items():
        if key not in hints:
            errors.append(f"unknown key '{section}.{key}'{_suggest(key, list(hints))}")
            continue
        try:
            setattr(section_obj, key, _coerce(value, hints[key], f"{section}.{key}"))
        except ConfigError as err:
            errors.extend(err.errors)


def config_from_dict(raw: dict, source: str = "config") -> Config:
    """Build a Config from nested dicts; every unknown key and mistyped value is reported."""
    cfg = Config()
    cfg.model.ffn_hidden_size = None  # re-derived below from the loaded hidden_size
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(_not_a_mapping(source, raw))
    sections = typing.get_type_hints(Config)
    errors: list[str] = []
    for section, values in raw.items():
        if section not in sections:
            errors.append(f"unknown section '{section}' in {source}{_suggest(str(section), list(sections))}")
        elif values is None:
            continue
        elif not isinstance(values, dict):
            errors.append(f"{section}: expected a mapping of keys, got {values!r}")
        else:
            _apply_section(getattr(cfg, section), values, section, errors)
    if errors:
        raise ConfigError(errors)
    cfg.model.__post_init__()
    return cfg


def _not_a_mapping(source: str, raw: Any) -> str:
    return (f"{source}: the top level must be a mapping of sections (model:, parallel:, "
            f"train:, ...), got a {type(raw).__name__}")


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
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override '{item}': the value is not valid YAML "
                              f"({_yaml_problem(err)}); quote it") from None
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


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: 'line L, column C: problem' (PyYAML's text spans lines)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def read_yaml(path: str | os.PathLike) -> dict:
    """The YAML file's contents as a mapping ({} if empty); ConfigError naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(err)}") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file: {err}") from err
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(_not_a_mapping(str(path), raw))
    return raw


def parse_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Load YAML and apply overrides: known keys, right types; no range checks yet."""
    raw = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "overrides"
    return config_from_dict(_merge(raw, parse_overrides(list(overrides))), source)


def load_config(path: str | os.PathLike | None, overrides: list[str] = (),
                world_size: int | None = None) -> Config:
    """Load YAML, apply overrides and validate. `world_size` defaults to $WORLD_SIZE or 1."""
    cfg = parse_config(path, overrides)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world_size)
    return cfg


# --------------------------------------------------------------------------------------------
# Structured values
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Validation: pure range and consistency checks, collecting every problem
# --------------------------------------------------------------------------------------------

class _Problems:
    """Collects one line per problem, so a user sees every mistake in one go."""

    def __init__(self):
        self.lines: list[str] = []

    def require(self, cond: bool, message: str) -> bool:
        if not cond:
            self.lines.append(message)
        return bool(cond)

    def choice(self, value: str, options: tuple, key: str) -> bool:
        return self.require(value in options, f"{key}: '{value}' is not one of {', '.join(options)}"
                                              f"{_suggest(str(value), list(options))}")

    def positive(self, value, key: str, strict: bool = True, hint: str = "") -> bool:
        ok = value > 0 if strict else value >= 0
        bound = "positive" if strict else ">= 0"
        return self.require(ok, f"{key} must be {bound}, got {value}{hint}")

    def parse(self, fn, *args):
        """fn(*args), recording its ConfigError; None when it failed."""
        try:
            return fn(*args)
        except ConfigError as err:
            self.lines.extend(err.errors)
            return None


def validate_model(m: ModelConfig) -> None:
    problems = _Problems()
    _check_model(m, problems)
    if problems.lines:
        raise ConfigError(problems.lines)


def validate(cfg: Config, world_size: int) -> None:
    """Check the whole config against the world size; fills parallel.data when it is None.

    Raises one ConfigError listing every problem found (`err.errors`, one line each).
    """
    problems = _Problems()
    model_ok = _check_model(cfg.model, problems)
    train_ok = _check_train(cfg.train, problems)
    _check_data(cfg.data, problems)
    _check_log_and_checkpoint(cfg, problems)
    # The layout divides model and batch sizes: only meaningful once those are sane.
    if _check_parallel_sizes(cfg.parallel, problems) and model_ok and train_ok:
        _check_layout(cfg, world_size, problems)
    if problems.lines:
        raise ConfigError(problems.lines)


def _check_model(m: ModelConfig, out: _Problems) -> bool:
    before = len(out.lines)
    out.choice(m.arch, ("gpt", "bert"), "model.arch")
    sizes_ok = all([out.positive(getattr(m, key), f"model.{key}") for key in
                    ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size",
                     "ffn_hidden_size")])
    if sizes_ok:
        out.require(m.hidden_size % m.num_heads == 0,
                    f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads "
                    f"({m.num_heads})")
    out.require(0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}")
    out.positive(m.layernorm_eps, "model.layernorm_eps")
    out.positive(m.init_std, "model.init_std")
    out.positive(m.num_tokentypes, "model.num_tokentypes")
    if m.arch == "bert":
        out.require(m.seq_length >= 5, f"model.seq_length={m.seq_length} is too short for BERT "
                                       f"([CLS] A [SEP] B [SEP] needs at least 5)")
    return len(out.lines) == before


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
    _check_learning_rate(tr, out)
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
    out.require(tr.fp16_max_skips >= 1, f"train.fp16_max_skips must be >= 1, got {tr.fp16_max_skips}")
    return batches_ok


def _check_learning_rate(tr: TrainConfig, out: _Problems) -> None:
    out.positive(tr.lr, "train.lr", strict=False)
    out.positive(tr.min_lr, "train.min_lr", strict=False)
    if tr.lr >= 0 and tr.min_lr >= 0:
        out.require(tr.min_lr <= tr.lr,
                    f"train.min_lr ({tr.min_lr}) must not exceed train.lr ({tr.lr})")
    out.positive(tr.lr_warmup_iters, "train.lr_warmup_iters", strict=False)
    out.choice(tr.lr_decay_style, ("cosine", "linear", "constant"), "train.lr_decay_style")
    if tr.lr_decay_iters is not None:
        out.positive(tr.lr_decay_iters, "train.lr_decay_iters",
                     hint=" (null means train.iters)")


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


def _check_log_and_checkpoint(cfg: Config, out: _Problems) -> None:
    out.require(cfg.log.interval >= 1, f"log.interval must be >= 1, got {cfg.log.interval}")
    out.positive(cfg.checkpoint.save_interval, "checkpoint.save_interval", strict=False,
                 hint=" (0 saves only at the end)")


def _check_parallel_sizes(par: ParallelConfig, out: _Problems) -> bool:
    ok = all([out.require(getattr(par, key) >= 1, f"parallel.{key} must be >= 1, got "
                                                  f"{getattr(par, key)}")
              for key in ("tensor", "pipeline", "chunks")])
    if par.data is not None:
        ok = out.require(par.data >= 1, f"parallel.data must be >= 1, got {par.data}") and ok
    return ok


def _check_layout(cfg: Config, world_size: int, out: _Problems) -> None:
    """(p, t, d, v) against the world size, the model's sizes, the schedule and the batch."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    t, p, v = par.tensor, par.pipeline, par.chunks
    if par.data is None:
        if not out.require(world_size % (p * t) == 0,
                           f"world size {world_size} is not divisible by parallel.pipeline * "
                           f"parallel.tensor = {p} * {t}; launch a multiple of {p * t} ranks"):
            return
        par.data = world_size // (p * t)
    d = par.data
    suggestion = world_size // (p * t) if world_size % (p * t) == 0 else "?"
    out.require(p * t * d == world_size,
                f"parallel.pipeline * parallel.tensor * parallel.data = {p} * {t} * {d} = "
                f"{p * t * d} but the world size is {world_size}; set parallel.data={suggestion} "
                f"or launch {p * t * d} ranks")
    for key in ("num_heads", "hidden_size", "ffn_hidden_size"):
        out.require(getattr(m, key) % t == 0, f"model.{key} ({getattr(m, key)}) must be "
                                              f"divisible by parallel.tensor ({t})")
    out.require(m.num_layers % (p * v) == 0,
                f"model.num_layers ({m.num_layers}) must be divisible by parallel.pipeline * "
                f"parallel.chunks = {p} * {v} = {p * v}")
    if par.scatter_gather:
        out.require(p > 1, "parallel.scatter_gather=true only applies with parallel.pipeline > 1")
    if par.sequence_parallel:
        _check_sequence_parallel(cfg, out)
    if out.require(tr.global_batch_size % (tr.micro_batch_size * d) == 0,
                   f"train.global_batch_size ({tr.global_batch_size}) must be divisible by "
                   f"train.micro_batch_size * parallel.data = {tr.micro_batch_size} * {d} = "
                   f"{tr.micro_batch_size * d}"):
        _check_schedule(cfg, out)
    else:
        out.choice(cfg.schedule.name, SCHEDULES, "schedule.name")


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
    out.require(cfg.schedule.name not in ("2bw", "pipedream"),
                f"parallel.sequence_parallel=true is not supported with schedule.name="
                f"{cfg.schedule.name}; use a flushing schedule (gpipe, 1f1b, interleaved, zb-h1)")


def _check_schedule(cfg: Config, out: _Problems) -> None:
    name, p, v = cfg.schedule.name, cfg.parallel.pipeline, cfg.parallel.chunks
    if not out.choice(name, SCHEDULES, "schedule.name"):
        return
    # The one place that refuses schedules the planner models but the trainer cannot run.
    if not out.require(name in TRAINER_SCHEDULES,
                       f"schedule.name={name} is not runnable by the trainer yet (the planner "
                       f"models it); use one of {', '.join(TRAINER_SCHEDULES)}"):
        return
    out.require(not cfg.schedule.vertical_sync or name == "pipedream",
                f"schedule.vertical_sync=true only applies to schedule.name=pipedream (got {name})")
    out.require(not cfg.train.distributed_optimizer or name not in ("2bw", "pipedream"),
                f"train.distributed_optimizer=true does not work with schedule.name={name}: its "
                f"weight versions keep one storage per tensor, not the flat buffers the "
                f"distributed optimizer shards; use gpipe, 1f1b or interleaved, or "
                f"train.distributed_optimizer=false")
    if name == "2bw":
        _check_two_bw(cfg, out)
        return
    if name == "pipedream":
        _check_pipedream(cfg, out)
    if name != "interleaved":
        out.require(v == 1, f"parallel.chunks={v} needs schedule.name=interleaved or 2bw "
                            f"(got {name})")
        return
    out.require(p > 1, "schedule.name=interleaved needs parallel.pipeline > 1; use "
                       "schedule.name=1f1b for a single stage")
    out.require(v > 1, "schedule.name=interleaved needs parallel.chunks > 1 (v model chunks per "
                       "pipeline rank); set parallel.chunks=2 or more, or use schedule.name=1f1b")
    _require_multiple_of_p(cfg, out)


def _require_multiple_of_p(cfg: Config, out: _Problems) -> None:
    mb, p, name = cfg.num_micro_batches, cfg.parallel.pipeline, cfg.schedule.name
    out.require(mb % p == 0,
                f"schedule.name={name} needs the number of micro-batches per pipeline "
                f"(train.global_batch_size / (train.micro_batch_size * parallel.data) = {mb}) "
                f"to be a multiple of parallel.pipeline ({p})")


def _check_two_bw(cfg: Config, out: _Problems) -> None:
    """PipeDream-2BW: m >= p micro-batches per batch, more when interleaved."""
    from ptdp.pipeline.schedules import two_bw_min_micro_batches  # torch-free
    p, v, mb = cfg.parallel.pipeline, cfg.parallel.chunks, cfg.num_micro_batches
    if v > 1:
        out.require(p > 1, "schedule.name=2bw with parallel.chunks > 1 needs parallel.pipeline > 1")
        _require_multiple_of_p(cfg, out)
    least = two_bw_min_micro_batches(p, v)
    why = "m >= p" if v == 1 else "m >= p and m*v >= rank 0's interleaved warm-up 2(p-1)+(v-1)p"
    out.require(mb >= least,
                f"schedule.name=2bw needs at least {least} micro-batches per pipeline with "
                f"parallel.pipeline={p}, parallel.chunks={v} ({why}: the weights made from batch "
                f"t are first used by batch t+2), got train.global_batch_size / "
                f"(train.micro_batch_size * parallel.data) = {mb}")


def _check_pipedream(cfg: Config, out: _Problems) -> None:
    """PipeDream async updates each stage after every input: no global norm, no common skip."""
    tr = cfg.train
    out.require(tr.clip_grad == 0,
                f"schedule.name=pipedream needs train.clip_grad=0 (got {tr.clip_grad}): each "
                f"stage updates as soon as its backward of an input ends, so there is no "
                f"gradient norm of the whole model to clip by")
    out.require(tr.precision != "fp16",
                "schedule.name=pipedream does not support train.precision=fp16: a dynamic loss "
                "scale would need every stage to agree on skipping each input's update; use bf16")
