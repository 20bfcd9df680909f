"""``dpsynth run`` and ``dpsynth generate``: the pretrain → train → generate → evaluate flow.

All input is validated (config, privacy target, datasets) before the run directory is created,
so bad input never leaves a half-written run behind. Once training starts, the directory is kept
whatever happens, because ``--resume`` continues it.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from dpsynth.checkpoint import CheckpointManager, CurveLog, atomic_write, atomic_write_json, atomic_write_text
from dpsynth.config import load_config, resolve_config
from dpsynth.errors import ConfigError, DPSynthError
from dpsynth.methods import RunContext, Samples, get_method


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}") from None


def seed_everything(seed: int) -> None:
    """Seed the non-private randomness (initialisation, sampling). DP noise never uses it."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_private_splits(config: dict[str, Any]) -> Any:
    """The private train/val/test splits exactly as the run with ``config`` loads them."""
    from dpsynth.data import load_private

    data_cfg = config["data"]
    return load_private(data_cfg["private"], image_size=data_cfg["image_size"], channels=data_cfg["channels"],
                        val_size=data_cfg["val_size"], split_seed=data_cfg["split_seed"],
                        max_train=data_cfg["max_train"])


def load_run_data(config: dict[str, Any]) -> tuple[Any, Any]:
    """Load the private splits and the public set named by ``config['data']``."""
    from dpsynth.data import load_public

    data_cfg = config["data"]
    splits = load_private_splits(config)
    public = None
    if data_cfg["public"]:
        image_size = data_cfg["image_size"] or splits.train.image_shape[1]
        channels = data_cfg["channels"] or splits.train.image_shape[0]
        public = load_public(data_cfg["public"], image_size=image_size, channels=channels,
                             max_size=data_cfg["max_public"])
    return splits, public


def make_ledger(config: dict[str, Any]) -> Any:
    from dpsynth.privacy import PrivacyLedger

    privacy = config["privacy"]
    method = get_method(config["method"])
    # A method's explicitly unsound opt-in (DPPM's paper mode) gets a ledger that claims no epsilon.
    hook = getattr(method, "ledger_guarantee", None)
    guarantee = hook(config[method.name]) if hook is not None else "dp"
    target = privacy["epsilon"] if guarantee == "dp" else None
    return PrivacyLedger(target, privacy["delta"], accountant=privacy["accountant"], guarantee=guarantee)


def _format_epsilon(ledger: Any) -> str:
    spent = ledger.epsilon()
    return "none claimed (no DP guarantee)" if spent is None else f"{spent:.4f}"


class RunLog:
    """Appends timestamped lines to ``log.txt`` and echoes them to stderr."""

    def __init__(self, path: Path, echo: bool = True) -> None:
        self.path, self.echo = path, echo

    def __call__(self, message: str) -> None:
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        with open(self.path, "a") as handle:
            handle.write(line + "\n")
        if self.echo:
            print(line, file=sys.stderr, flush=True)


def build_context(config: dict[str, Any], run_dir: Path, splits: Any, public: Any, ledger: Any,
                  echo: bool = True) -> RunContext:
    method = get_method(config["method"])
    return RunContext(
        config=config, section=config[method.name], run_dir=run_dir, data=splits, public=public,
        ledger=ledger, device=resolve_device(config["device"]), seed=int(config["seed"]),
        log=RunLog(run_dir / "log.txt", echo=echo),
        checkpoints=CheckpointManager(run_dir / "checkpoints", ledger), curves=CurveLog(run_dir / "curves.jsonl"),
    )


def run_config(config_path: str | Path, overrides: list[str] | None = None, out: str | Path | None = None,
               resume: bool = False, echo: bool = True) -> Path:
    """Run a config end to end and return its run directory."""
    config = load_config(config_path, overrides)
    run_dir = Path(out) if out else Path("runs") / config["name"]
    _check_run_dir(run_dir, config, resume)
    ledger = make_ledger(config)  # first: it validates the method's privacy mode before any private read
    splits, public = load_run_data(config)
    delta_warning = ledger.check_delta(len(splits.train))
    method = get_method(config["method"])()
    for text in method.privacy_notes:
        ledger.note(text)
    seed_everything(int(config["seed"]))

    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)  # validated: create the run now
    atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    ctx = build_context(config, run_dir, splits, public, ledger, echo=echo)
    if delta_warning:
        print(f"warning: {delta_warning}", file=sys.stderr)
        ctx.log(f"warning: {delta_warning}")
    if resume:
        ctx.checkpoints.restore_ledger()
        ctx.log(f"resuming; privacy spent so far eps={_format_epsilon(ledger)}")
    ctx.log(f"run {config['name']}: method {method.name}, private {config['data']['private']} "
            f"(train {len(splits.train)}), target eps={ledger.target_epsilon}, delta={ledger.delta}")
    started = time.time()
    method.fit(ctx)
    ledger.write(run_dir / "privacy.json")
    ctx.log(f"training finished in {time.time() - started:.1f}s; eps={_format_epsilon(ledger)}")
    if getattr(method, "releases_samples", True):
        samples = method.generate(ctx, int(config["generate"]["num"]))
        write_samples(run_dir / "samples.npz", samples, ctx.num_classes)
        evaluate_with_run_settings(ctx)
    else:  # a released model (the DP-SGD baseline): its own test metrics
        atomic_write_json(run_dir / "metrics.json", method.released_metrics(ctx))
    _write_report(run_dir, ctx)
    return run_dir


def _check_run_dir(run_dir: Path, config: dict[str, Any], resume: bool) -> None:
    if resume:
        stored = run_dir / "config.yaml"
        if not stored.is_file():
            raise ConfigError(f"--resume: {run_dir} holds no run (config.yaml missing)")
        previous = resolve_config(yaml.safe_load(stored.read_text()))
        if previous != config:
            changed = sorted(_diff_keys(previous, config))
            raise ConfigError(f"--resume: the config differs from the stored run at {', '.join(changed)}")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} exists; pass --resume to continue it or --out for a new one")


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in set(a) | set(b) for k in _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


def write_samples(path: Path, samples: Samples, num_classes: int) -> None:
    """Write ``samples.npz`` (contract) and ``samples.png`` (one row per class) beside it."""
    from dpsynth.report.grids import save_class_grid

    arrays = {"images": samples.images, "labels": samples.labels}
    if samples.soft_labels is not None:
        arrays["soft_labels"] = samples.soft_labels
    atomic_write(path, lambda f: np.savez_compressed(f, **arrays))
    if path.name == "samples.npz":
        save_class_grid(samples.images, samples.labels, path.with_suffix(".png"), num_classes)


def open_run(run_dir: str | Path, echo: bool = True) -> tuple[RunContext, Any]:
    """Rebuild the context of an existing run (for generate / evaluate), ledger restored."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise DPSynthError(f"{run_dir} is not a run directory (no config.yaml)")
    config = resolve_config(yaml.safe_load((run_dir / "config.yaml").read_text()))
    splits, public = load_run_data(config)
    ledger = make_ledger(config)
    ctx = build_context(config, run_dir, splits, public, ledger, echo=echo)
    ctx.checkpoints.restore_ledger()
    return ctx, get_method(config["method"])()


def generate_samples(run_dir: str | Path, num: int, out: str | Path | None = None) -> Path:
    """``dpsynth generate``: draw ``num`` samples from a trained run; costs no privacy."""
    if num < 1:
        raise DPSynthError(f"--num must be positive, got {num}")
    ctx, method = open_run(run_dir)
    seed_everything(ctx.seed + 7)
    samples = method.generate(ctx, num)
    path = Path(out) if out else ctx.run_dir / "samples.npz"
    write_samples(path, samples, ctx.num_classes)
    return path


def evaluate_with_run_settings(ctx: RunContext, target: Path | None = None,
                               metrics: list[str] | None = None) -> None:
    """Evaluate ``target`` (default: the run itself) with the run's ``evaluate`` section: its models,
    seeds, epochs and KD temperature; ``metrics`` defaults to the section's (plus the audit if set)."""
    from dpsynth.eval.evaluate import evaluate
    from dpsynth.eval.utility import TrainConfig

    settings = ctx.config["evaluate"]
    if metrics is None:
        metrics = list(settings["metrics"]) + (["audit"] if settings["audit"] and "audit" not in settings["metrics"] else [])
    if metrics:
        models = settings["models"]
        train = TrainConfig(epochs=int(settings["epochs"]), kd_temperature=float(settings["kd_temperature"]))
        evaluate(target or ctx.run_dir, metrics, splits=ctx.data, seeds=int(settings["seeds"]),
                 device=str(ctx.device), models=list(models) if models else None, train=train)


def _write_report(run_dir: Path, ctx: RunContext) -> None:
    from dpsynth.report.html import write_report

    ctx.log(f"report: {write_report(run_dir)}")
