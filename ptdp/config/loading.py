"""Loading a config: YAML files, dotted `key=value` overrides, and type coercion that names
the offending key. Range and consistency checks are ptdp/config/validation.py's."""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ptdp.config.models import BLOCK_OPTIONS
from ptdp.config.hints import suggest
from ptdp.config.schema import Config, ConfigError
from ptdp.config.validation import validate, validate_model


# Model keys whose default depends on others (the preset, the hidden size, the activation).
DERIVED_MODEL_KEYS = (*BLOCK_OPTIONS, "qkv_bias", "num_kv_heads", "head_dim", "ffn_hidden_size",
                      "moe_ffn_hidden_size", "mla_v_head_dim")


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
        return [_coerce(v, args[0], key) for v in value] if args else value
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
            errors.append(f"unknown key '{section}.{key}'{suggest(key, list(hints))}")
            continue
        try:
            setattr(section_obj, key, _coerce(value, hints[key], f"{section}.{key}"))
        except ConfigError as err:
            errors.extend(err.errors)


def config_from_dict(raw: dict, source: str = "config") -> Config:
    """Build a Config from nested dicts; every unknown key and mistyped value is reported."""
    cfg = Config()
    for key in DERIVED_MODEL_KEYS:  # re-derived below from the loaded preset and sizes
        setattr(cfg.model, key, None)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(_not_a_mapping(source, raw))
    sections = typing.get_type_hints(Config)
    errors: list[str] = []
    for section, values in raw.items():
        if section not in sections:
            errors.append(f"unknown section '{section}' in {source}{suggest(str(section), list(sections))}")
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


def load_model_yaml(path: str) -> tuple[dict, object]:
    """(raw YAML dict, Config) for a file that may hold only a model: section."""
    raw = read_yaml(path)
    cfg = config_from_dict(raw, str(path))
    validate_model(cfg.model)
    # Written configs state the derived default (4h) so they read the same everywhere.
    raw = {**raw, "model": {**(raw.get("model") or {}), "ffn_hidden_size": cfg.model.ffn_hidden_size}}
    return raw, cfg
