"""Opening a run: its resolved config, its private data, its verified ledger and its :class:`RunContext`.

Shared by the runner (``run``, ``--resume``, ``generate``) and by the evaluation runs
(:mod:`dpsynth.eval`: evaluate, audit, run canary), which sit below the runner and never import it.
The files themselves (names, ``config.yaml``, ``ledger.json``, ``privacy.json``, the log) are
:mod:`dpsynth.rundir`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpsynth.checkpoint import CheckpointManager, CurveLog
from dpsynth.contract import RELEASED_PHASE
from dpsynth.errors import ConfigError, DPSynthError, PrivacyError
from dpsynth.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    CURVES_FILE,
    LEDGER_FILE,
    DiscardedCurves,
    LedgerStore,
    ReadOnlyCheckpoints,
    RunLog,
    check_privacy_json,
    read_config_file,
    read_ledger,
)
from dpsynth.sections import RunConfig

# ------------------------------------------------------------------ config, data, ledger


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved ``config.yaml`` of a run directory."""
    from dpsynth.config import resolve_config

    return resolve_config(read_config_file(run_dir))


def load_private_splits(config: RunConfig) -> Any:
    """The private train/val/test splits exactly as the run with ``config`` loads them."""
    from dpsynth.data import load_private
    from dpsynth.data.loading import private_options

    return load_private(config.data.private, **private_options(config.data))


def load_run_data(config: RunConfig, source: Any = None) -> tuple[Any, Any]:
    """The private splits and the public set of a run with ``config``: ``source`` (a
    :class:`~dpsynth.data.source.DatasetSource`; None: the datasets ``config.data`` names) read by the one
    loader, :func:`dpsynth.data.source.load_source`. Public images that also appear in the private splits
    are refused unless ``data.allow_overlap``."""
    from dpsynth.data.source import load_source

    splits, public, _ = load_source(config.data, source)
    return splits, public


def make_ledger(config: RunConfig) -> Any:
    """A fresh, empty ledger with the budget of ``config.privacy`` and the method's privacy notes; a method's
    explicitly unsound opt-in (``Method.ledger_guarantee``, e.g. DPPM's randomized response) gets one that
    claims no ε."""
    from dpsynth.methods import get_method
    from dpsynth.privacy import PrivacyLedger

    privacy = config.privacy
    method = get_method(config.method)
    guarantee = method.ledger_guarantee(config.section)
    target = privacy.epsilon if guarantee == "dp" else None
    ledger = PrivacyLedger(target, privacy.delta, accountant=privacy.accountant, guarantee=guarantee)
    for text in method.privacy_notes:
        ledger.note(text)
    return ledger


def restore_ledger(run_dir: str | Path, config: RunConfig, allow_lagging_privacy: bool = False) -> Any:
    """The run's ledger, restored from ``ledger.json`` and checked against ``privacy.json`` and the config.

    Refuses (``PrivacyError``, one line) when the state is missing or unreadable, when its budget is not
    the config's, or when it does not match ``privacy.json``: continuing from a wrong state could
    rewrite ``privacy.json`` with a smaller ε. ``allow_lagging_privacy`` (``--resume`` only) accepts a
    ``privacy.json`` that is missing or records a prefix of the state: a crash between the two writes.
    """
    run_dir = Path(run_dir)
    ledger = read_ledger(run_dir)
    _check_budget(ledger, make_ledger(config), run_dir / LEDGER_FILE)
    check_privacy_json(run_dir, ledger, allow_lagging=allow_lagging_privacy)
    return ledger


def _check_budget(ledger: Any, configured: Any, path: Path) -> None:
    # A state that claims no guarantee can never over-state privacy, whatever the config's budget says.
    fields = ("delta", "accountant") + (("guarantee", "target_epsilon") if ledger.guarantee == "dp" else ())
    for field in fields:
        if getattr(ledger, field) != getattr(configured, field):
            raise PrivacyError(
                f"{path} has {field}={getattr(ledger, field)!r} but {CONFIG_FILE} has "
                f"{getattr(configured, field)!r}; the ledger state belongs to another run"
            )


# ------------------------------------------------------------------ the run context


def resolve_device(name: str) -> Any:
    """The run's device; under torchrun a bare ``cuda`` (or ``auto``) is this process's ``cuda:LOCAL_RANK``."""
    import torch

    from dpsynth.dpsgd.distributed import local_device

    if name == "auto":
        return local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if name == "cuda":
        name = str(local_device(torch.device("cuda")))
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but no CUDA device is available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}") from None


def build_context(
    config: RunConfig,
    run_dir: Path,
    splits: Any,
    public: Any,
    ledger: Any,
    echo: bool = True,
    store: LedgerStore | None = None,
    plan: Any = None,
    scratch: Path | None = None,
) -> Any:
    """The :class:`RunContext` of a run; ``store`` (default: a new one) orders its writes after the ledger's.

    A store with ``writer=False`` (a torchrun rank other than 0) gives a context that writes nothing
    under ``run_dir``: no log, curve or checkpoint files, and ``ctx.run_dir`` is the rank's own
    ``scratch`` directory, so a method writing a figure there cannot touch the run either.
    """
    from dpsynth.methods import RunContext

    store = store or LedgerStore(run_dir, ledger)
    writer = store.writer
    if not writer and scratch is None:
        raise ConfigError("a context that does not write the run needs a scratch directory")
    return RunContext(
        config=config,
        section=config.section,
        run_dir=run_dir if writer else scratch,
        data=splits,
        public=public,
        ledger=ledger,
        device=resolve_device(config.device),
        seed=config.seed,
        log=RunLog(run_dir, echo=echo and writer, store=store),
        checkpoints=(CheckpointManager if writer else ReadOnlyCheckpoints)(run_dir / CHECKPOINTS_DIR, ledger, store),
        curves=(CurveLog if writer else DiscardedCurves)(run_dir / CURVES_FILE, store=store),
        plan=plan,
    )


def open_run(
    run_dir: str | Path, echo: bool = True, private: Any = None, require_released: bool = True
) -> tuple[Any, Any]:
    """Rebuild the context of a finished run (generate, evaluate, audit): its data and its verified ledger.

    Refuses when ``ledger.json`` is missing or does not match ``privacy.json`` (:func:`restore_ledger`).
    ``private``: a :class:`~dpsynth.data.source.DatasetSource` read instead of the config's private data (a run
    fitted on in-memory arrays). The method comes back with its released state restored
    (:meth:`~dpsynth.contract.Method.load_state_dict`); a run directory without one (training unfinished, or
    samples made elsewhere) is refused unless ``require_released`` is False (the audit, which may score samples
    alone).
    """
    from dpsynth.methods import get_method

    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    ledger = restore_ledger(run_dir, config)
    splits, public = load_run_data(config, private)
    store = LedgerStore(run_dir, ledger)
    store.assume_stored()  # restore_ledger verified it equal to the files on disk
    ctx = build_context(config, run_dir, splits, public, ledger, echo=echo, store=store)
    method = get_method(config.method)()
    state = ctx.checkpoints.load(phase=RELEASED_PHASE)
    if state is not None:
        method.load_state_dict(state, ctx)
    elif require_released:
        raise ConfigError(
            f"{run_dir} holds no released state (checkpoints/{RELEASED_PHASE}.pt): its training did not finish "
            "(continue it with --resume), or an earlier dpsynth made it (those runs cannot be reopened)"
        )
    return ctx, method


# ------------------------------------------------------------------ training


def plan_training(config: RunConfig, num_examples: int) -> tuple[Any, Any]:
    """``(method, plan)``: a fresh instance of the config's method and the privacy plan it will spend on
    ``num_examples`` private examples (reads no data; a bad plan fails here, before anything is written).

    A plan that fails because a private batch is larger than the train set (a sample rate B/N above 1,
    e.g. an ``mnist10k`` preset on a few hundred images) is refused with the key, its value, N and the fix.
    """
    from dpsynth.methods import get_method

    method = get_method(config.method)()
    try:
        return method, method.plan(config, int(num_examples))
    except DPSynthError:
        oversized = oversized_batches(config.section, int(num_examples), config.method)
        if not oversized:
            raise
        raise ConfigError(batch_size_problem(oversized, int(num_examples))) from None


def oversized_batches(section: Any, num_examples: int, prefix: str) -> list[tuple[str, int]]:
    """``(dotted key, B)`` of every DP-SGD batch size in ``section`` (nested sections included) above N.

    Every :class:`~dpsynth.dpsgd.section.DPSGDSection` is private training at sample rate q = B/N,
    so B > N cannot be planned; the keys are found in the typed section, not listed by hand.
    """
    import pydantic

    from dpsynth.dpsgd.section import DPSGDSection

    found = []
    if isinstance(section, DPSGDSection) and section.batch_size > num_examples:
        found.append((f"{prefix}.batch_size", section.batch_size))
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, pydantic.BaseModel):
            found += oversized_batches(value, num_examples, f"{prefix}.{name}")
    return found


def batch_size_problem(oversized: list[tuple[str, int]], num_examples: int) -> str:
    """One line: each key and value, the train size N (public, docs/privacy.md) and what to set instead."""
    keys = ", ".join(f"{key}={value}" for key, value in oversized)
    key, value = oversized[0]
    suggestion = max(1, num_examples // 10)  # a sample rate of 0.1
    return (
        f"{keys}: a private batch larger than the {num_examples} training records (sample rate "
        f"{value}/{num_examples} = {value / num_examples:.3g} > 1); set it to at most {num_examples}, e.g. "
        f"--set {key}={suggestion} (sample rate 0.1), or train on more records"
    )


def train_run(method: Any, ctx: Any, store: LedgerStore) -> None:
    """The one training function of a run: fit ``ctx.plan`` exactly, then persist the ledger.

    The runner (``dpsynth run``, ``Synthesizer.fit``) and the canary audit's retraining
    (:mod:`dpsynth.eval.run_canary`) both train through it, so a config spends the same mechanisms
    whichever path runs it. The non-private randomness is seeded from the run seed first; DP noise
    never comes from it.
    """
    from dpsynth.dpsgd.distributed import from_main
    from dpsynth.seeding import seed_everything

    seed_everything(ctx.seed)
    released = from_main(lambda: ctx.checkpoints.load(phase=RELEASED_PHASE))  # every rank: the same state
    if released is None:
        method.fit(ctx)
        ctx.checkpoints.save(method.state_dict(), phase=RELEASED_PHASE)
    else:
        method.load_state_dict(released, ctx)
        ctx.log(f"{method.name}: training had finished; released state restored, nothing spent")
    ctx.plan.check_spent(ctx.ledger)
    store.persist()
