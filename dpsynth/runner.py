"""``dpsynth run``: the pretrain → train → generate → evaluate flow of one run (``dpsynth generate`` is
:meth:`dpsynth.api.Synthesizer.generate`).

All input is validated (config, privacy target, datasets) before the run directory is created,
so bad input never leaves a half-written run behind. Once training starts, the directory is kept
whatever happens, because ``--resume`` continues it.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.checkpoint import atomic_write, atomic_write_json
from dpsynth.config import config_for_source, describe_scaling, load_config
from dpsynth.context import (
    build_context,
    load_run_data,
    make_ledger,
    plan_training,
    read_run_config,
    restore_ledger,
    train_run,
)
from dpsynth.data.source import DatasetSource
from dpsynth.dpsgd.estimate import check_networks_build
from dpsynth.errors import ConfigError
from dpsynth.eval.held_out import write_dataset_record
from dpsynth.methods import Method, RunContext, Samples, get_method
from dpsynth.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    SAMPLES_FILE,
    LedgerStore,
    diagnostics_dir,
    is_run_dir,
    write_config_file,
)
from dpsynth.sections import RunConfig


def run_config(
    config_path: str | Path,
    overrides: list[str] | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    echo: bool = True,
) -> Path:
    """Run a config end to end and return its run directory."""
    config = load_config(config_path, overrides)
    return run(config, Path(out) if out else default_run_dir(config), resume=resume, echo=echo)


def default_run_dir(config: RunConfig) -> Path:
    return Path("runs") / str(config.name or config.method)


def plan_run(config: RunConfig, num_examples: int) -> Any:
    """The privacy plan of ``config`` on ``num_examples`` private examples (reads no data)."""
    if int(num_examples) < 1:
        raise ConfigError(f"the private train size must be positive, got {num_examples}")
    return plan_training(config, num_examples)[1]


def plan_source(config: RunConfig, source: DatasetSource) -> Any:
    """The privacy plan a run of ``config`` on ``source`` will spend: the config as :func:`execute` states it
    for the source (an ``auto`` preset sized for it), on the train size N of the source (the keyed split of
    arrays, or the named dataset's metadata; N is public by the stated assumption, docs/privacy.md)."""
    config = config_for_source(config, source)
    return plan_run(config, source.train_size(config.data))


def run(
    config: RunConfig, run_dir: Path, resume: bool = False, echo: bool = True, source: DatasetSource | None = None
) -> Path:
    """Run a resolved config into ``run_dir`` (see :func:`execute`) and return the directory."""
    execute(config, run_dir, resume=resume, echo=echo, source=source)
    return run_dir


def check_evaluation_installed(config: RunConfig) -> None:
    """ConfigError, before anything is trained, when the run's ``evaluate.metrics`` name a fidelity metric
    and the TF-Inception weights are not installed (the ``fid`` extra): one line with the command."""
    from dpsynth.metrics.inception import FID_INSTALL, weights_installed
    from dpsynth.metrics.protocol import FIDELITY_METRICS

    wanted = [name for name in config.evaluate.metrics if name in FIDELITY_METRICS]
    if wanted and not weights_installed():
        raise ConfigError(
            f"config key 'evaluate.metrics' = [{', '.join(config.evaluate.metrics)}]: {', '.join(wanted)} "
            f"{'needs' if len(wanted) == 1 else 'need'} the TF-Inception weights, which are not installed: "
            f"{FID_INSTALL} (or leave {'it' if len(wanted) == 1 else 'them'} out of the list)"
        )


def execute(
    config: RunConfig,
    run_dir: Path,
    resume: bool = False,
    echo: bool = True,
    source: DatasetSource | None = None,
) -> tuple[RunContext, Method]:
    """Run a resolved config into ``run_dir``: fit the planned mechanisms, release, evaluate, report.

    ``source`` is the run's data (:class:`~dpsynth.data.source.DatasetSource`: a name, a path or the Python
    API's arrays; None: the datasets ``config.data`` names). The config is first stated for it
    (:func:`dpsynth.config.config_for_source`: ``data.private``, an ``auto`` preset's sizing) and the data
    read by the one loader (:func:`dpsynth.context.load_run_data`). Returns the context, whose ``config`` is
    the run's stored one, and the fitted method, ready to generate more samples.

    Under ``torchrun --nproc_per_node N -m dpsynth run CONFIG`` every process runs this; it joins the
    process group (:func:`dpsynth.dpsgd.distributed.init_from_env`), rank 0 alone checks and writes the
    run directory, the ledger and the release, and every rank trains its shard of each DP-SGD step,
    generates its share of the samples and extracts its share of the FID features.
    """
    from dpsynth.dpsgd import distributed

    config = config_for_source(config, source)
    check_evaluation_installed(config)
    created_group = distributed.init_from_env(config.device)
    try:
        if distributed.is_main():
            return _execute(config, run_dir, resume, echo, source)
        with tempfile.TemporaryDirectory(prefix=f"dpsynth-rank{distributed.rank()}-") as scratch:
            return _execute(config, run_dir, resume, echo, source, scratch=Path(scratch))
    finally:
        if created_group:
            distributed.shutdown()


def _execute(
    config: RunConfig,
    run_dir: Path,
    resume: bool,
    echo: bool,
    source: DatasetSource | None,
    scratch: Path | None = None,
) -> tuple[RunContext, Method]:
    """One process of a run; ``scratch`` set: a torchrun rank other than 0, which writes nothing in ``run_dir``."""
    from dpsynth.dpsgd.distributed import from_main

    writer = scratch is None

    def checked_ledger_state() -> dict[str, Any]:
        _check_run_dir(run_dir, config, resume)
        # building the ledger validates the method's privacy mode before any private read; --resume
        # continues the stored ledger (refusing when it is missing or disagrees with privacy.json)
        ledger = restore_ledger(run_dir, config, allow_lagging_privacy=True) if resume else make_ledger(config)
        return ledger.state_dict()

    # rank 0 reads the run directory; the other ranks get the same ledger state (or the same error)
    ledger = make_ledger(config)
    ledger.load_state_dict(from_main(checked_ledger_state))
    check_networks_build(get_method(config.method)(), config)  # before any read or public pre-training
    splits, public = load_run_data(config, source)
    delta_warning = ledger.check_delta(len(splits.train))
    method, plan = plan_training(config, len(splits.train))  # before the run directory: a bad plan leaves nothing

    store = LedgerStore(run_dir, ledger, writer=writer)
    if writer:
        (run_dir / CHECKPOINTS_DIR).mkdir(parents=True, exist_ok=True)  # validated: create the run now
        write_config_file(run_dir, config.to_dict())
        store.persist()  # ledger.json and privacy.json exist before anything else quotes the run
    ctx = build_context(config, run_dir, splits, public, ledger, echo=echo, store=store, plan=plan, scratch=scratch)
    if delta_warning and writer:
        print(f"warning: {delta_warning}", file=sys.stderr)
        ctx.log(f"warning: {delta_warning}")
    if resume:
        ctx.log(f"resuming; privacy spent so far eps={_format_epsilon(ledger.epsilon())}")
    ctx.log(
        f"run {config.name}: method {method.name}, private {config.data.private} "
        f"(train {len(splits.train)}), target eps={ledger.target_epsilon}, delta={ledger.delta}; "
        f"plan: {describe_plan(plan)}"
    )
    for line in describe_scaling(config):  # the keys an auto preset's rule set, and why (public inputs only)
        ctx.log(line)
    empty = empty_classes(splits.train.labels, ctx.num_classes)
    if empty:  # a per-class count of private records: diagnostics/log.txt only, never log.txt or the console
        ctx.log(f"private diagnostic: the train split holds no record of declared class(es) {empty}", private=True)
    started = time.time()
    train_run(method, ctx, store)
    ctx.log(f"training finished in {time.time() - started:.1f}s; eps={_format_epsilon(ledger.epsilon())}")
    samples = generate_across_ranks(method, ctx, config.generate.num) if method.releases == "samples" else None
    if writer and samples is not None:
        write_samples(run_dir / SAMPLES_FILE, samples, ctx.num_classes)
        check_label_balance(ctx, samples.labels)
    if method.releases == "samples":  # every rank: FID features are extracted across the ranks
        evaluate_with_run_settings(ctx)
    if not writer:  # rank 0 releases, evaluates and reports
        return ctx, method
    if samples is None:  # a released model (the DP-SGD baseline): its test metrics are a private diagnostic
        atomic_write_json(diagnostics_dir(run_dir) / METRICS_FILE, released_metrics(method, ctx))
    store.persist()
    _write_report(run_dir, ctx)
    if source is not None and source.private_arrays:  # the arrays themselves are not kept: their public shape
        write_dataset_record(run_dir, splits.train)
    return ctx, method


def empty_classes(labels: np.ndarray, num_classes: int) -> list[int]:
    """The declared classes without a record in ``labels``. A run trains on them like any other (the
    generator still gets their public label): whether a run exists must not depend on a per-class count
    (docs/privacy.md, "Refusals that depend on the data"); only the custodian's diagnostics say so."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes)
    return [int(c) for c in np.flatnonzero(counts[:num_classes] == 0)]


def released_metrics(method: Method, ctx: RunContext) -> dict[str, Any]:
    """The released model's metrics, its accuracy with the test size, interval and baselines beside it
    (:func:`dpsynth.metrics.usefulness.annotate_accuracy`, as ``dpsynth evaluate`` does for samples)."""
    from dpsynth.metrics.usefulness import annotate_accuracy

    metrics = dict(method.released_metrics(ctx))
    if isinstance(metrics.get("accuracy"), dict) and len(ctx.data.test):
        metrics["accuracy"], metrics["accuracy_baselines"] = annotate_accuracy(
            metrics["accuracy"], ctx.data.test.labels, ctx.num_classes
        )
    return metrics


def check_label_balance(ctx: RunContext, labels: np.ndarray) -> dict[str, Any]:
    """Compare the released labels with the requested (balanced) distribution, whatever the method
    (:func:`dpsynth.report.balance.label_balance`); record it in ``metrics.json`` and say plainly in the
    log and on the console when a class is missing or the balance is far off. The labels are public
    output, so none of this is a private diagnostic."""
    from dpsynth.eval.evaluate import record_metrics
    from dpsynth.report.balance import label_balance

    balance = label_balance(labels, ctx.num_classes)
    record_metrics(ctx.run_dir, {"label_balance": balance})
    if balance["warning"]:
        ctx.log(f"warning: {balance['warning']}")
    return balance


#: separates the ranks' run seeds when they generate their shares (rank 0 keeps the run's seed)
RANK_SEED_STRIDE = 1_000_003


def generate_across_ranks(method: Method, ctx: RunContext, num: int) -> Samples | None:
    """``num`` samples from the released model, split across the torchrun ranks and gathered on rank 0.

    Rank r draws ``num // W`` samples (one more for the first ``num % W`` ranks) with its own
    sampling streams (run seed + r · :data:`RANK_SEED_STRIDE`), so 50k samples take 1/W of the time.
    Generation reads only the released model and public data, so splitting it costs no privacy.
    Returns the samples on rank 0 (all of them with one process) and None on the others.
    """
    import dataclasses

    import torch.distributed as dist

    from dpsynth.dpsgd import distributed

    world, rank = distributed.world_size(), distributed.rank()
    if world == 1:
        return method.generate(ctx, num)
    start, stop = distributed.rank_slice(num, rank, world)
    share = stop - start
    local = dataclasses.replace(ctx, seed=ctx.seed + rank * RANK_SEED_STRIDE)
    mine = method.generate(local, share) if share else None
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return _concatenate([s for s in gathered if s is not None]) if gathered is not None else None


def _concatenate(parts: list[Samples]) -> Samples:
    soft = [p.soft_labels for p in parts]
    return Samples(
        images=np.concatenate([p.images for p in parts]),
        labels=np.concatenate([p.labels for p in parts]),
        soft_labels=np.concatenate(soft) if all(s is not None for s in soft) else None,
    )


def describe_plan(plan: Any) -> str:
    """One line per mechanism, joined: ``name sigma=.. q=.. steps=..``."""
    return "; ".join(
        f"{m.name} sigma={m.to_dict()['noise_multiplier']} q={m.to_dict()['sample_rate']:.4g} steps={m.repeats}"
        for m in plan.mechanisms
    )


def _format_epsilon(epsilon: float | None) -> str:
    return "none (no guarantee)" if epsilon is None else f"{epsilon:.4f}"


#: config keys (prefixes) that may differ from the stored run on --resume
RESUMABLE_CHANGES = ("evaluate.",)


def _check_run_dir(run_dir: Path, config: RunConfig, resume: bool) -> None:
    if resume:
        if not is_run_dir(run_dir):
            raise ConfigError(f"--resume: {run_dir} holds no run ({CONFIG_FILE} missing)")
        changed = sorted(_diff_keys(read_run_config(run_dir).to_dict(), config.to_dict()))
        # The evaluation runs after training and only reads what the run releases, so its settings may
        # change on resume (the stored config.yaml is then rewritten); anything else would mix two runs.
        refused = [key for key in changed if not key.startswith(RESUMABLE_CHANGES)]
        if refused:
            raise ConfigError(f"--resume: the config differs from the stored run at {', '.join(refused)}")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} exists; pass --resume to continue it or --out for a new one")


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in set(a) | set(b) for k in _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


#: ``dpsynth generate --format``: dpsynth's samples.npz contract, or DPImageBench's gen.npz
SAMPLE_FORMATS = ("native", "dpimagebench")


def write_samples(path: Path, samples: Samples, num_classes: int, format: str = "native") -> None:
    """Write ``samples.npz`` (contract) and ``samples.png`` (one row per class) beside it.

    ``format="dpimagebench"`` writes DPImageBench's ``gen.npz`` instead (``x`` float32 NCHW in [0, 1],
    ``y`` int64; soft labels are not part of that layout), which its ``eval.py`` reads as is.
    """
    from dpsynth.report.grids import save_class_grid

    if format not in SAMPLE_FORMATS:
        raise ConfigError(f"sample format must be one of {', '.join(SAMPLE_FORMATS)}, got {format!r}")
    if format == "dpimagebench":
        from dpsynth.data.readers.npz import to_bench_arrays

        bench = to_bench_arrays(samples.images, samples.labels)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.savez(f, **bench))
        return
    arrays = {"images": samples.images, "labels": samples.labels}
    if samples.soft_labels is not None:
        arrays["soft_labels"] = samples.soft_labels
    atomic_write(path, lambda f: np.savez_compressed(f, **arrays))
    if path.name == SAMPLES_FILE:
        save_class_grid(samples.images, samples.labels, path.with_suffix(".png"), num_classes)


def evaluate_with_run_settings(ctx: RunContext, target: Path | None = None, metrics: list[str] | None = None) -> None:
    """Evaluate ``target`` (default: the run itself) as ``dpsynth evaluate RUN`` would, with no flags: the
    method's evaluation protocol overridden by the run's ``evaluate`` section (read by
    :func:`dpsynth.eval.evaluate.evaluate` from the run directory, so the two give the same numbers);
    ``metrics`` defaults to the section's (plus the audit if set).

    Collective under torchrun: every rank calls it; the Inception features (FID, KID, precision/recall)
    are extracted across the ranks, then rank 0 alone reads ``target``, computes, trains the downstream
    classifiers and writes (:func:`dpsynth.eval.evaluate.evaluate` with ``collective=True``)."""
    from dpsynth.eval.evaluate import evaluate

    settings = ctx.config.evaluate
    if metrics is None:
        metrics = list(settings.metrics) + (["audit"] if settings.audit and "audit" not in settings.metrics else [])
    if settings.dpsgd_baseline and target is None:  # the config load made sure accuracy is listed
        _baseline_before_evaluation(ctx)  # its accuracy is read beside the release's by evaluate()
    if metrics:
        evaluate(
            target or ctx.run_dir,
            metrics,
            splits=ctx.data,
            device=str(ctx.device),
            collective=True,
            run_config=ctx.config,
        )


def _baseline_before_evaluation(ctx: RunContext) -> None:
    """``evaluate.dpsgd_baseline``: train the DP-SGD classifier baseline on the run's own splits, once."""
    from dpsynth.dpsgd.distributed import is_main, world_size

    if world_size() > 1:  # one process trains it: after the run, `dpsynth evaluate RUN --baseline`
        if is_main():
            ctx.log("evaluate.dpsgd_baseline: not trained under torchrun; run `dpsynth evaluate RUN --baseline` after")
        return
    ctx.log("training the DP-SGD classifier baseline at the run's epsilon: a separate release in RUN/baseline-dpsgd")
    train_dpsgd_baseline(ctx.run_dir, ctx.config, ctx.data)  # with the run's evaluate.dpsgd_baseline_settings


def train_dpsgd_baseline(
    run_dir: Path,
    run_config: RunConfig,
    splits: Any = None,
    overrides: dict[str, Any] | list[str] | None = None,
    *,
    data: Any = None,
) -> Path:
    """Train the DP-SGD classifier baseline of ``run_dir`` on the run's own private train split into
    ``RUN/baseline-dpsgd`` unless it finished there before; a separate release at the run's ε and δ
    (:mod:`dpsynth.eval.baseline`). Returns its directory.

    The split is ``splits`` (held since the run) or, when None, drawn again as the run drew it: from the
    run's dataset, or for a run fitted on arrays from ``data`` (the arrays ``fit`` got, split by the run's
    rule, :func:`dpsynth.eval.held_out.array_run_splits`)."""
    from dpsynth.context import load_private_splits
    from dpsynth.eval.baseline import baseline_config, baseline_dir, check_can_train, finished
    from dpsynth.eval.held_out import array_run_splits, fitted_on_arrays

    out = baseline_dir(run_dir)
    if finished(run_dir):
        return out
    check_can_train(run_dir, run_config)
    if splits is None:
        baseline_config(run_config, 1, overrides)  # a bad override fails here, before any data is read
        splits = (
            array_run_splits(data, run_config, run_dir)
            if fitted_on_arrays(run_config)
            else load_private_splits(run_config)
        )
    config = baseline_config(run_config, len(splits.train), overrides)
    source = DatasetSource(private=splits, with_public=False)  # the run's own split; the baseline uses no public set
    execute(config, out, resume=is_run_dir(out), source=source, echo=False)
    return out


def summary_line(run_dir: Path) -> str:
    """One line on what a finished run released and where: method, ε spent of the target, samples, report.

    Every part is public: the method and target come from the config, ε from ``privacy.json`` (part of
    the release) and the sample count from ``samples.npz`` (the release itself); no private figure.
    """
    from dpsynth.rundir import REPORT_FILE

    config = read_run_config(run_dir)
    return (
        f"done: {config.method}, {_spent(run_dir, config)}; released {_released(run_dir)}; "
        f"report {run_dir / REPORT_FILE}"
    )


def _spent(run_dir: Path, config: RunConfig) -> str:
    """``eps=1.999 spent of target 2 (delta=1e-05)`` from ``privacy.json``, or that there is no guarantee."""
    import json

    from dpsynth.rundir import PRIVACY_FILE

    try:
        privacy = json.loads((run_dir / PRIVACY_FILE).read_text())
    except (OSError, ValueError):
        privacy = {}
    if privacy.get("guarantee", "dp") == "none":
        return "NO privacy guarantee (guarantee: none)"
    epsilon = privacy.get("epsilon")
    spent = f"eps={epsilon:.4g}" if isinstance(epsilon, (int, float)) else f"eps unknown ({PRIVACY_FILE} unreadable)"
    return f"{spent} spent of target {config.privacy.epsilon:g} (delta={config.privacy.delta:g})"


def _released(run_dir: Path) -> str:
    """``64 samples in RUN/samples.npz``, or ``a model, no samples`` for a method that releases a model."""
    samples = run_dir / SAMPLES_FILE
    if not samples.is_file():
        return "a model, no samples"
    with np.load(samples) as archive:  # reads the labels only
        released = f"{len(archive['labels'])} samples in {samples}"
    return released + _balance_note(run_dir)


def _balance_note(run_dir: Path) -> str:
    """``(WARNING: labels not balanced as requested, see log.txt)`` when the run's label check flagged the
    release (:func:`check_label_balance`), else nothing; the released labels are public."""
    import json

    from dpsynth.rundir import LOG_FILE

    try:
        balance = json.loads((diagnostics_dir(run_dir) / METRICS_FILE).read_text()).get("label_balance", {})
    except (OSError, ValueError, AttributeError):
        return ""
    flagged = isinstance(balance, dict) and balance.get("warning")
    return f" (WARNING: labels not balanced as requested, see {run_dir / LOG_FILE})" if flagged else ""


def _write_report(run_dir: Path, ctx: RunContext) -> None:
    """``report.html`` (with the private diagnostics, for the custodian) and ``report-release.html`` (without)."""
    from dpsynth.report.html import write_report

    ctx.log(f"report: {write_report(run_dir)}; release report: {write_report(run_dir, release=True)}")
