"""Run configuration: YAML files, dotted ``--set`` overrides, defaults and validation.

The resolved configuration (every default filled in) is what a run directory stores as
``config.yaml``, so a run can be reproduced from its directory alone.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml

from dpsynth.errors import ConfigError, PrivacyError

COMMON_DEFAULTS: dict[str, Any] = {
    "method": None,
    "name": None,  # run directory name; defaults to the config file's stem
    "seed": 0,
    "device": "auto",  # auto | cpu | cuda | cuda:N
    "data": {
        "private": "mnist10k",  # registered name or path (.npz, image folder, ...)
        "public": None,  # registered name, path, or null
        "image_size": None,  # resize/centre-crop to this size; null keeps the native size
        "channels": None,  # 1 or 3; null keeps the native channels
        "val_size": None,  # null: the dataset's documented split
        "split_seed": 0,
        "max_train": None,  # train records kept (a count for registered datasets, else a fraction; smoke runs)
        "max_public": None,
        "num_classes": None,  # class count when the private source declares none (never labels.max() + 1)
        "pixel_range": None,  # [low, high] of float .npz pixels, e.g. [0, 1]; integer formats are 0..255
        "allow_overlap": False,  # true: proceed when private images also appear in the public set
    },
    "privacy": {
        "epsilon": 10.0,
        "delta": 1e-5,
        "accountant": "prv",  # prv | rdp
        "secure_rng": False,  # True: noise from os.urandom bytes (cryptographic, slower)
    },
    "generate": {"num": 1000, "batch_size": 250},
    "evaluate": {  # computed right after the run (dpsynth evaluate does the same later)
        "metrics": [],  # e.g. [accuracy, fid]; see dpsynth.eval.evaluate.METRICS
        "seeds": 1,
        "models": None,  # downstream classifiers; null: logreg, mlp, cnn (seed-paper protocol)
        "epochs": 10,  # downstream training epochs
        "kd_temperature": 1.0,  # distillation T when samples carry soft labels (dp-imgsyn Eq. 7; MNIST: 100)
        "audit": False,  # membership-inference audit of the samples (not private: custodian only)
    },
}

ACCOUNTANTS = ("prv", "rdp")


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values are parsed as YAML scalars."""
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part!r} is set twice as a value and a section")
        try:
            node[leaf] = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({exc.__class__.__name__})") from None
    return result


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a config must be a mapping of keys, got {type(loaded).__name__}")
    return loaded


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def resolve_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Fill in defaults for the common keys and the chosen method's section, then validate."""
    from dpsynth.methods import get_method

    method_name = raw.get("method")
    if not method_name:
        raise ConfigError("the config must name a method (key 'method')")
    method = get_method(str(method_name))
    defaults = dict(COMMON_DEFAULTS, **{method.name: method.defaults})
    _check_known_keys(raw, defaults, prefix="")
    config = deep_merge(defaults, raw)
    _check_types(config, defaults, prefix="")
    validate_privacy(config["privacy"]["epsilon"], config["privacy"]["delta"], config["privacy"]["accountant"])
    return config


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read a YAML config, apply ``--set`` overrides and resolve it."""
    raw = deep_merge(read_yaml(path), parse_overrides(overrides or []))
    config = resolve_config(raw)
    if config["name"] is None:
        config["name"] = Path(path).stem
    return config


def validate_privacy(epsilon: Any, delta: Any, accountant: Any = "prv") -> None:
    """Reject a privacy target that no mechanism can meet or that means nothing."""
    if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or not math.isfinite(epsilon) or epsilon <= 0:
        raise PrivacyError(f"privacy.epsilon must be a positive finite number, got {epsilon!r}")
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not 0 < delta < 1:
        raise PrivacyError(f"privacy.delta must lie in (0, 1), got {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")


def _check_known_keys(raw: dict[str, Any], defaults: dict[str, Any], prefix: str) -> None:
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in defaults:
            known = ", ".join(sorted(str(k) for k in defaults))
            raise ConfigError(f"unknown config key {dotted!r} (known here: {known})")
        if isinstance(defaults[key], dict) and defaults[key]:
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted!r} must be a section (a mapping)")
            _check_known_keys(value, defaults[key], prefix=f"{dotted}.")


def _check_types(config: dict[str, Any], defaults: dict[str, Any], prefix: str) -> None:
    """A value must have its default's type (ints may stand for floats); None defaults take anything."""
    for key, default in defaults.items():
        value, dotted = config[key], f"{prefix}{key}"
        if default is None or value is None:
            continue
        if isinstance(default, dict):
            if default:
                _check_types(value, default, prefix=f"{dotted}.")
            continue
        if isinstance(default, float) and isinstance(value, str):
            value = config[key] = _yaml_float(value, dotted)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, type(default))
        if not ok:
            raise ConfigError(f"config key {dotted!r} expects {type(default).__name__}, got {value!r}")


def _yaml_float(text: str, dotted: str) -> float:
    # PyYAML follows YAML 1.1, which reads "1e-5" (no dot) as a string.
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"config key {dotted!r} expects a number, got {text!r}") from None
