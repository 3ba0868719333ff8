"""Loading an experiment: run its `get_config()`, apply `--config.a.b=value` overrides, validate.

Overrides follow the absl / `ml_collections.config_flags` convention (`--config.train.steps=10`
or `--config.train.steps 10`); each value is parsed as the type the key already has. Every
mistake — a missing file, an unknown key, a value of the wrong type — becomes a `ZayaError`
whose message names the key and what would be accepted.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
from typing import Any, Iterable

import ml_collections

from zaya_jax import trees
from zaya_jax.errors import ZayaError
from zaya_jax.experiment.schema import NULLABLE, base_config
from zaya_jax.experiment.validate import Experiment, validate

OVERRIDE_PREFIX = "--config."


def load_experiment(path: str, overrides: Iterable[str] = ()) -> Experiment:
    """The validated experiment from a config file plus command-line overrides."""
    values, source = load_values(path, overrides)
    return validate(unflatten(values), source=source)


def load_values(path: str, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], str]:
    """Every key's value (flat, type-checked, not yet validated) and where they came from: what a
    command needs before JAX starts (the distributed runtime's timeouts), since validation does."""
    values = flatten(config_from_file(path).to_dict())
    schema = flatten(base_config().to_dict())
    _check_keys(values, schema, path)
    parsed = parse_override_args(list(overrides))
    for key, text in parsed:
        _check_override_key(key, schema)
        values[key] = parse_value(key, text, schema[key])
    for key, value in values.items():
        check_type(key, value, schema[key], where=path)
    return values, f"{path} with overrides" if parsed else path


def config_from_file(path: str) -> ml_collections.ConfigDict:
    """The ConfigDict an experiment file's get_config() returns (not yet checked or validated).

    Experiment files call it too, to start from another experiment and change a few values.
    """
    if not path:
        raise ZayaError("--config is required: pass an experiment file, e.g. --config=experiments/tiny_cpu.py")
    if not os.path.isfile(path):
        raise ZayaError(f"experiment config {path} does not exist; see experiments/ for the shipped ones")
    if not path.endswith(".py"):
        raise ZayaError(f"experiment config {path} must be a Python file defining get_config()")
    spec = importlib.util.spec_from_file_location(f"zaya_experiment_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        get_config = getattr(module, "get_config", None)
        if get_config is None:
            raise ZayaError(f"{path} defines no get_config(); an experiment file returns its ConfigDict from it")
        config = get_config()
    except ZayaError:
        raise
    except Exception as e:  # a user's file: report its own error on one line
        raise ZayaError(f"{path} failed while building its config: {type(e).__name__}: {e}") from None
    if isinstance(config, dict):
        config = ml_collections.ConfigDict(config)
    if not isinstance(config, ml_collections.ConfigDict):
        raise ZayaError(f"{path}: get_config() returned {type(config).__name__}, not an ml_collections.ConfigDict")
    return config


def _suggest(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _check_keys(values: dict, schema: dict, path: str) -> None:
    unknown = sorted(set(values) - set(schema))
    if unknown:
        raise ZayaError(f"{path}: unknown config key {unknown[0]}{_suggest(unknown[0], schema)}; "
                        "experiments may only set the keys of zaya_jax.experiment.base_config()")
    missing = sorted(set(schema) - set(values))
    if missing:
        raise ZayaError(f"{path}: config key {missing[0]} is missing; build the config from "
                        "zaya_jax.experiment.base_config() so every key is present")


def _check_override_key(key: str, schema: dict) -> None:
    if key not in schema:
        groups = sorted({k.split(".")[0] for k in schema})
        raise ZayaError(f"--config.{key}: unknown config key{_suggest(key, schema)}; keys live under {groups}")


def parse_override_args(args: list[str]) -> list[tuple[str, str]]:
    """['--config.a.b=1', '--config.c', '2'] → [('a.b', '1'), ('c', '2')]."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith(OVERRIDE_PREFIX):
            raise ZayaError(f"unrecognized argument {arg!r}; config overrides look like --config.train.steps=100")
        body = arg[len(OVERRIDE_PREFIX):]
        if "=" in body:
            key, text = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, text = body, args[i + 1]
            i += 1
        else:
            raise ZayaError(f"{arg} has no value; write --config.{body}=VALUE")
        out.append((key, text))
        i += 1
    return out


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def parse_value(key: str, text: str, default: Any) -> Any:
    """Parse override text as the type of the key's default value."""
    kind = type(default)
    if key in NULLABLE:
        return _parse_nullable(key, text)
    try:
        if kind is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
        value = ast.literal_eval(text)
        return list(value) if isinstance(value, tuple) and kind is list else value
    except (ValueError, SyntaxError):
        raise ZayaError(f"--config.{key}={text}: {key} takes {_type_words((kind,))}, got {text!r}") from None


def _parse_nullable(key: str, text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if isinstance(value, bool) or not isinstance(value, NULLABLE[key]):
        raise ZayaError(f"--config.{key}={text}: {key} takes {_type_words(NULLABLE[key])} or None")
    return value


def _type_words(kinds: tuple) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             list: "a list like [1, 2]", tuple: "a list like [1, 2]"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def check_type(key: str, value: Any, default: Any, where: str) -> None:
    allowed = NULLABLE.get(key, (type(default),))
    if value is None and key in NULLABLE:
        return
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return
    if bool not in allowed and isinstance(value, bool):
        raise ZayaError(f"{where}: {key} must be {_type_words(allowed)}, got {value!r}")
    if not isinstance(value, allowed):
        raise ZayaError(f"{where}: {key} must be {_type_words(allowed)}, got {value!r} ({type(value).__name__})")


def flatten(tree: dict) -> dict[str, Any]:
    """{'train': {'steps': 1}} → {'train.steps': 1}."""
    return trees.flatten(tree, sep=".")


def unflatten(flat: dict[str, Any]) -> dict:
    return trees.nest(flat, sep=".")
