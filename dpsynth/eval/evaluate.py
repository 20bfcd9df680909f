"""``dpsynth evaluate``: fidelity and utility of a run's samples, written to ``metrics.json``.

``evaluate(target, metrics)`` takes a run directory (its ``config.yaml`` names the private dataset
and its splits) or a bare ``samples.npz`` (then ``data=`` names the private dataset) and returns one
key per metric:

* ``accuracy``: ``{model: {"mean", "std", "runs", "epochs", "test_size", "interval", "versus_majority"},
  "mean_of_models": {...}}`` in percent (train on synthetic, test on the real test split;
  :mod:`dpsynth.metrics.utility`), and ``accuracy_baselines``: the test size, chance and majority-class
  rates beside them (:mod:`dpsynth.metrics.usefulness`);
* ``fid``: float; ``kid``: ``{"mean", "std"}``; ``precision``, ``recall``: floats in [0, 1]; all
  against the private train split (or the test split, ``fid_reference="test"``) on TF-Inception
  features (:mod:`dpsynth.metrics.fidelity`);
* ``is``: null unless ``inception_logits`` gives a TorchScript network returning class logits
  (the reason is under ``"notes"``);
* ``model_selection``: rank correlations (:mod:`dpsynth.metrics.model_selection`);
* ``audit``: membership inference on the samples (and the released model when the method has the
  ``example_losses`` hook); ``canary`` adds the one-run canary ε lower bound (:mod:`dpsynth.eval.audit`)
  of the engine at the run's σ and q; ``run_canary`` that of the run's own method, retrained with
  planted canaries (:mod:`dpsynth.eval.run_canary`).

Plus ``"meta"`` (what was evaluated and how). Every figure here reads private data (the test split,
the train split, the val split) without noise, so it is a *private diagnostic*, not covered by ε: for
a run directory the result is merged into ``RUN_DIR/diagnostics/metrics.json`` (atomic write), apart
from the run's release; for a bare npz it goes to ``<stem>.metrics.json`` beside it. Selecting on the
private validation split is the one exception that charges the run's ledger: it restores the ledger
from ``ledger.json`` (refusing when it is missing or disagrees with ``privacy.json``) and writes the
new state before any metric that used it.

The console (stderr) shows progress and facts that quote no private figure: which metric is being
computed, and at the end where the private metrics were written. A line that quotes a private figure
(a test accuracy, a model-selection score) goes to the run's ``diagnostics/log.txt`` only
(:class:`~dpsynth.rundir.RunLog` with ``private=True``); for a bare npz, which has no run directory, it
is written nowhere: the figures are in the returned dict and ``<stem>.metrics.json`` (:class:`EvaluationLog`).

At the end of a ``torchrun`` run every rank calls ``evaluate(..., collective=True)``: the Inception
features are extracted across the ranks (:mod:`dpsynth.metrics.inception`), and rank 0 alone reads the
target, computes every metric and writes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.config import resolve_config
from dpsynth.context import load_private_splits, restore_ledger
from dpsynth.errors import ConfigError, DataError, PrivacyError
from dpsynth.eval.baseline import BASELINE_KEY, baseline_entry
from dpsynth.eval.held_out import array_run_splits, fitted_on_arrays, held_out_splits
from dpsynth.metrics.protocol import (
    AUDIT_METRICS,
    FID_REFERENCES,
    FIDELITY_METRICS,
    SAMPLES,
    SELECTIONS,
    EvaluationProtocol,
    ResolvedProtocol,
    parse_metrics,
    resolve_protocol,
    size_protocol,
    without_soft_labels,
)
from dpsynth.metrics.usefulness import annotate_accuracy
from dpsynth.metrics.utility import NoisyValidation, evaluate_utility
from dpsynth.rundir import (
    AUDIT_FILE,
    CONFIG_FILE,
    DIAGNOSTICS_DIR,
    INCEPTION_CACHE_DIR,
    LOG_FILE,
    METRICS_FILE,
    PRIVATE_LINE,
    SAMPLES_FILE,
    RunLog,
    diagnostics_dir,
    is_run_dir,
    read_config_file,
)
from dpsynth.sections import RunConfig

DIAGNOSTIC_NOTE = "private diagnostic: computed on private data without noise; not covered by epsilon"


def load_samples(path: str | Path) -> dict[str, np.ndarray]:
    """Read a ``samples.npz`` and check it against the contract."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"samples file not found: {path}")
    try:
        with np.load(path) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npz ({exc.__class__.__name__})") from None
    if "images" not in arrays and {"x", "y"} <= set(arrays):  # DPImageBench's gen.npz: x NCHW in [0, 1] by format
        from dpsynth.data.readers.npz import BENCH_RANGE, to_nhwc_uint8

        arrays = {"images": to_nhwc_uint8(arrays["x"], str(path), BENCH_RANGE), "labels": np.asarray(arrays["y"])}
    images, labels = arrays.get("images"), arrays.get("labels")
    if images is None or labels is None:
        raise DataError(f"{path}: a samples file needs arrays 'images' and 'labels' (or DPImageBench's 'x' and 'y')")
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise DataError(f"{path}: images must be uint8 [N, H, W, 1|3], got {images.dtype} {images.shape}")
    if labels.shape != (len(images),):
        raise DataError(f"{path}: {len(labels)} labels for {len(images)} images")
    soft = arrays.get("soft_labels")
    if soft is not None and (soft.ndim != 2 or len(soft) != len(images)):
        raise DataError(f"{path}: soft_labels must be [N, K], got {soft.shape}")
    return {"images": images, "labels": labels.astype(np.int64), "soft_labels": soft}


def _resolve_target(target: str | Path) -> tuple[Path | None, Path]:
    """(run directory or None, samples path)."""
    target = Path(target)
    if target.is_dir():
        if not is_run_dir(target):
            raise DataError(f"{target} is not a run directory (no {CONFIG_FILE})")
        return target, target / SAMPLES_FILE
    if target.suffix != ".npz":
        raise DataError(f"evaluate expects a run directory or an .npz file, got {target}")
    run_dir = target.parent if is_run_dir(target.parent) else None
    return run_dir, target


def _load_splits(
    run_config: RunConfig | None,
    data: Any,
    samples: dict[str, np.ndarray],
    run_dir: Path | None = None,
    test_data: Any = None,
) -> Any:
    """The private splits: ``test_data`` as the test split alone; for a run fitted on arrays, ``data`` split
    again by the run's rule (:mod:`dpsynth.eval.held_out`); else the run's ``data`` section, or ``data`` at
    the samples' size and channels."""
    from dpsynth.data import load_private

    if test_data is not None:
        return held_out_splits(test_data, run_config, run_dir, samples["images"].shape[1:])
    if fitted_on_arrays(run_config):
        return array_run_splits(data, run_config, run_dir)
    if data is not None:
        _, height, _, channels = samples["images"].shape
        return load_private(data, image_size=height, channels=channels)
    if run_config is None:
        raise DataError("a bare .npz needs --data NAME (the private dataset to compare with)")
    return load_private_splits(run_config)


def _restore_ledger(run_dir: Path, run_config: RunConfig) -> Any:
    """The run's ledger store, restored from ``ledger.json`` and verified (for noisy private-val selection)."""
    from dpsynth.rundir import LedgerStore

    store = LedgerStore(run_dir, restore_ledger(run_dir, run_config))
    store.assume_stored()
    return store


class EvaluationLog:
    """The evaluation's log, with :class:`~dpsynth.rundir.RunLog`'s signature ``log(message, private=False)``.

    A line that is not private (progress: which metric, which classifier) goes to stderr. A private
    line (``private=True``, or one matching :data:`~dpsynth.rundir.PRIVATE_LINE`: it quotes a figure
    computed on private data without noise) never reaches the console: with a run directory it is
    appended to the run's ``diagnostics/log.txt`` by the run's own :class:`~dpsynth.rundir.RunLog`
    (echo off; after the ledger state when ``store`` holds charges not yet written); without one it is
    dropped, the figure being in the returned metrics. ``quiet``: nothing on the console at all (a
    torchrun rank other than 0).
    """

    def __init__(self, run_dir: Path | None, store: Any = None, quiet: bool = False) -> None:
        self.run_dir, self.store, self.quiet = run_dir, store, quiet

    def after_ledger(self, store: Any) -> EvaluationLog:
        """The same log, its private lines held until ``store`` has written the ledger state."""
        return EvaluationLog(self.run_dir, store, self.quiet)

    @property
    def private_path(self) -> Path | None:
        """Where private lines go (the run's ``diagnostics/log.txt``), or None when they are dropped."""
        return None if self.run_dir is None else self.run_dir / DIAGNOSTICS_DIR / LOG_FILE

    def __call__(self, message: str, private: bool = False) -> None:
        if private or PRIVATE_LINE.search(message):
            if self.run_dir is not None and not self.quiet:
                RunLog(self.run_dir, echo=False, store=self.store)(message, private=True)
        elif not self.quiet:
            print(f"evaluate: {message}", file=sys.stderr, flush=True)


def evaluate(
    target: str | Path,
    metrics: str | Sequence[str] | None = None,
    *,
    data: Any = None,
    test_data: Any = None,
    splits: Any = None,
    device: str | None = None,
    seeds: int | Sequence[int] | None = None,
    preset: str | None = None,
    models: Sequence[str] | None = None,
    selection: str | None = None,
    protocol: Mapping[str, Any] | None = None,
    val_noise_multiplier: float | None = None,
    val_mechanism: str = "gaussian",
    inception: str | None = None,
    inception_logits: str | None = None,
    input_range: str = "tf",
    batch_size: int = 50,
    max_fid_samples: int | None = None,
    fid_reference: str | None = None,
    write: bool = True,
    collective: bool = False,
    run_config: RunConfig | None = None,
) -> dict[str, Any]:
    """Evaluate ``target`` (run dir or .npz) on ``metrics``; write and return the metrics dict.

    The downstream classifiers follow one protocol (:mod:`dpsynth.metrics.protocol`): for a run (a run
    directory, or an .npz inside one) the method's own ``evaluation_protocol``, overridden by the non-null
    keys of the run's ``evaluate`` section; for a bare .npz the default hard-label protocol (soft labels
    when the file carries them). ``seeds`` (a count or a list), ``preset``, ``models``, ``selection`` and
    ``protocol`` (any other :class:`~dpsynth.metrics.protocol.EvaluationProtocol` field, e.g.
    ``{"epochs": 5}``) override it explicitly; ``meta.protocol`` and ``meta.protocol_overrides`` record
    the outcome. ``metrics`` None: the run's ``evaluate.metrics`` when it lists any, else accuracy and
    fidelity. ``dpsynth run``, ``dpsynth evaluate`` and ``dpsynth.evaluate`` all call this function, so
    the same run and seeds give the same number.

    ``fid_reference`` names the real split the fidelity metrics compare with (``"train"`` or ``"test"``);
    ``max_fid_samples`` caps the images on each side. Both default to the run's ``evaluate`` section
    (``fid_reference``, ``fid_samples``), else ``"train"`` and no cap.

    A run fitted on in-memory arrays keeps no data to reload (:mod:`dpsynth.eval.held_out`): ``test_data``
    (``(images, labels)`` or an ``.npz`` path) scores it on held-out arrays taken as the test split (the
    fidelity metrics then compare with them), and ``data`` (the arrays ``fit`` got, or a path holding the same
    records) draws the run's own held-out split again; without either it fails with one line naming both.

    ``splits`` (an object with ``train``/``val``/``test`` ``ImageDataset``s) overrides the
    dataset lookup, for callers that already hold the data. ``device`` None: the run's ``device``
    (``auto``: CUDA when available), or the CPU for a bare .npz.

    ``run_config``: the run's resolved config when the caller holds it (the runner's end-of-run evaluation),
    instead of resolving the stored ``config.yaml`` again.

    ``collective=True`` under torchrun (a process group of W > 1 ranks): every rank calls this
    together with the same arguments (the run's end-of-training evaluation). Rank 0 alone reads the
    target and hands the samples to the others; the Inception feature extraction (FID, KID,
    precision/recall, IS) is split across the ranks; then the other ranks return ``{}`` while rank 0
    computes those metrics, trains the downstream classifiers (accuracy, model selection), runs the
    audit and writes. Fidelity comes first so that no rank waits in a collective while rank 0 trains
    classifiers. Without a process group (or with ``collective=False``) this process does everything.
    """
    from dpsynth.dpsgd.distributed import from_main, is_main, world_size

    if selection is not None and selection not in SELECTIONS:
        raise ConfigError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    if fid_reference is not None and fid_reference not in FID_REFERENCES:
        raise ConfigError(f"fid_reference must be one of {', '.join(FID_REFERENCES)}, got {fid_reference!r}")
    across_ranks = collective and world_size() > 1
    follower = across_ranks and not is_main()  # a rank other than 0: extracts features, reads and writes nothing
    shorthand = {"preset": preset, "models": models, "selection": selection}
    call = {**(protocol or {}), **{key: value for key, value in shorthand.items() if value is not None}}
    load = functools.partial(_load_target, target, metrics)
    run_dir, samples_path, stored_config, names, defaulted, samples = from_main(load) if across_ranks else load()
    if run_config is None and stored_config is not None:  # resolved once, here (the runner passes its own)
        run_config = resolve_config(stored_config)
    log = EvaluationLog(run_dir, quiet=follower)
    if samples is None:  # only the audit, of a run directory: a released model may have no samples
        if follower:
            return {}
        log(f"audit of {run_dir}")
        result = {"audit": _audit(run_dir, names, run_config, splits, data)}
        _finish(log, run_dir, samples_path, result, write)
        return result
    names, skipped = _computable(names, defaulted, inception)
    if skipped is not None:
        log(skipped)
    resolved = protocol_for(run_config, samples, call, seeds)
    for sized in resolved.sizing:  # public: the release's size and shape, never a private figure
        log(f"size rule: {sized.field} = {_shown(sized.value)} ({sized.why})")
    device = _resolve_device(device or (run_config.device if run_config else "cpu"))  # a run: the run's device
    if max_fid_samples is None and run_config is not None:
        max_fid_samples = run_config.evaluate.fid_samples
    if test_data is not None and fid_reference == "train":
        raise ConfigError(
            "fid_reference 'train' needs the run's train split, and held-out arrays are a test split only: "
            "use fid_reference 'test', or pass the arrays the run was fitted on as data"
        )
    held_out = "test" if test_data is not None else None  # held-out arrays: the only real split there is
    fid_reference = fid_reference or held_out or (run_config.evaluate.fid_reference if run_config else "train")
    splits = splits if splits is not None else _load_splits(run_config, data, samples, run_dir, test_data)

    result: dict[str, Any] = {}
    notes: dict[str, str] = {}
    wanted_fidelity = [m for m in names if m in FIDELITY_METRICS]
    if wanted_fidelity or "is" in names:
        wanted = ", ".join(wanted_fidelity + (["is"] if "is" in names else []))
        log(f"{wanted}: Inception features of the samples and of the private {fid_reference} split")
        result.update(
            _fidelity(
                samples,
                splits,
                None if follower else run_dir,
                run_config,
                data,
                wanted_fidelity,
                "is" in names,
                notes,
                device,
                inception,
                inception_logits,
                input_range,
                batch_size,
                max_fid_samples,
                fid_reference,
                across_ranks,
            )
        )
    if follower:
        return {}
    if "accuracy" in names:
        accuracy = _accuracy(
            samples, splits, run_dir, run_config, resolved, val_noise_multiplier, val_mechanism, device, log
        )
        # each figure with its test size, 95 % interval and the chance and majority rates beside it
        result["accuracy"], result["accuracy_baselines"] = annotate_accuracy(
            accuracy, splits.test.labels, splits.test.num_classes
        )
        same_test_split = test_data is None and (data is None or fitted_on_arrays(run_config))
        dpsgd = baseline_entry(run_dir) if run_dir is not None and same_test_split else None
        if dpsgd is not None:  # trained by `dpsynth evaluate --baseline` (a separate release, eval/baseline.py)
            result["accuracy_baselines"][BASELINE_KEY] = dpsgd
    if "model_selection" in names:
        from dpsynth.metrics.model_selection import model_selection

        log("model selection: the classifier grid on the synthetic set and on the private train split")
        result["model_selection"] = model_selection(
            samples["images"],
            samples["labels"],
            splits.train.images,
            splits.train.labels,
            splits.test.images,
            splits.test.labels,
            splits.test.num_classes,
            base=resolved.protocol.train_config(),
            seed=resolved.seeds[0],
            device=device,
            log=log,
        )
    if set(names) & set(AUDIT_METRICS):
        log(f"audit of {run_dir}")
        result["audit"] = _audit(run_dir, names, run_config, splits, data)
    if notes:
        result["notes"] = notes
    if skipped is not None:
        result["skipped"] = skipped
    # a line saying fidelity was skipped is stale once fidelity is computed (merged files keep other keys)
    stale = ("skipped",) if any(name in FIDELITY_METRICS for name in names) else ()
    result["meta"] = {
        "samples": str(samples_path),
        "num_samples": len(samples["images"]),
        "dataset": getattr(splits.test, "name", data) if isinstance(data, (str, Path, type(None))) else "arrays",
        "test_data": "held-out arrays passed to evaluate" if test_data is not None else "the run's test split",
        "test_size": len(splits.test),
        "method": run_config.method if run_config else None,
        "seeds": list(resolved.seeds),
        "preset": resolved.protocol.preset,
        "selection": resolved.protocol.selection,
        **resolved.meta(),
        "inception_input_range": input_range,
        "fid_reference": fid_reference,
        "max_fid_samples": max_fid_samples,
        "privacy": DIAGNOSTIC_NOTE,
    }
    _finish(log, run_dir, samples_path, result, write, stale)
    if write and not collective and run_dir is not None and samples_path.name == SAMPLES_FILE:
        _refresh_report(run_dir, log)  # the end of `dpsynth run` (collective) writes its report after this
    return result


def _refresh_report(run_dir: Path, log: EvaluationLog) -> None:
    """Render the run's ``report.html`` again, when it has one, so that the custodian's report shows the metrics
    just written (and the line naming any metric skipped); the release report holds no diagnostic."""
    from dpsynth.report.html import write_report
    from dpsynth.rundir import REPORT_FILE

    if (run_dir / REPORT_FILE).is_file():
        log(f"report: {write_report(run_dir)} (with these metrics)")


def _computable(names: list[str], defaulted: bool, inception: str | None) -> tuple[list[str], str | None]:
    """(the metrics to compute, the one line saying which were skipped or None). The fidelity metrics need the
    TF-Inception weights (the ``fid`` extra) or a network given with ``inception``: without them, default
    metrics skip them, named with the command that adds them; metrics asked for by name fail in one line."""
    from dpsynth.metrics.inception import FID_INSTALL, weights_installed

    wanted = [name for name in names if name in FIDELITY_METRICS]
    if not wanted or inception is not None or weights_installed():
        return names, None
    if not defaulted:
        raise DataError(
            f"{', '.join(wanted)} {'needs' if len(wanted) == 1 else 'need'} the TF-Inception weights, which are "
            f"not installed: {FID_INSTALL} "
            "(or name a TorchScript network with --inception PATH)"
        )
    kept = [name for name in names if name not in FIDELITY_METRICS]
    return kept, f"skipped {', '.join(wanted)}: the TF-Inception weights are not installed; add them: {FID_INSTALL}"


def _shown(value: Any) -> str:
    return ",".join(value) if isinstance(value, (tuple, list)) else str(value)


def _finish(
    log: EvaluationLog,
    run_dir: Path | None,
    samples_path: Path,
    result: dict[str, Any],
    write: bool,
    stale: Sequence[str] = (),
) -> None:
    """Write the metrics (when ``write``; ``stale`` keys of an earlier evaluation dropped) and say on the
    console where the private figures are, never what."""
    where = f"written to {_write_metrics(run_dir, samples_path, result, stale)}" if write else "returned, not written"
    lines = f"; log lines quoting them go to {log.private_path}" if log.private_path is not None else ""
    log(f"private diagnostics (not covered by epsilon) {where}{lines}")


def protocol_for(
    run_config: RunConfig | None,
    samples: dict[str, np.ndarray],
    call: Mapping[str, Any] | None = None,
    seeds: int | Sequence[int] | None = None,
) -> ResolvedProtocol:
    """The protocol that scores ``samples``: the run's method protocol (or, with no run, the default one)
    sized by the number of samples (:func:`~dpsynth.metrics.protocol.size_protocol`), then the run's
    ``evaluate`` section, then the ``call``'s explicit overrides and ``seeds``."""
    if run_config is not None:
        from dpsynth.methods import get_method

        declared = get_method(run_config.method).evaluation_protocol(run_config)
        section = _protocol_keys(run_config.evaluate.model_dump())
    else:
        declared, section = EvaluationProtocol(), None
    base, sizing = size_protocol(declared, len(samples["images"]), samples["images"].shape[1:])
    resolved = resolve_protocol(base, section, call, seeds, sizing)
    if run_config is None and samples["soft_labels"] is not None and "labels" not in resolved.overrides:
        protocol = dataclasses.replace(resolved.protocol, labels="soft")  # a bare file's soft labels
        resolved = dataclasses.replace(resolved, protocol=protocol, overrides={**resolved.overrides, "labels": SAMPLES})
    return resolved if samples["soft_labels"] is not None else without_soft_labels(resolved)


def _protocol_keys(section: Mapping[str, Any]) -> dict[str, Any]:
    """The protocol fields of a run's ``evaluate`` section (metrics and audit are not protocol fields)."""
    from dpsynth.metrics.protocol import FIELDS

    return {key: value for key, value in section.items() if key in FIELDS}


def _load_target(
    target: str | Path, metrics: str | Sequence[str] | None
) -> tuple[Path | None, Path, dict[str, Any] | None, list[str], bool, dict[str, np.ndarray] | None]:
    """(run directory or None, samples path, the run's stored config or None, the metric names, whether they
    are the default ones (nothing asked for by name), the samples, or None when only the audit of a run
    directory is asked for).

    ``metrics`` None: a run directory's own ``evaluate.metrics`` when it lists any, else accuracy and
    fidelity (so ``dpsynth evaluate RUN`` repeats the run's own evaluation). The config is returned as
    stored (plain values, which pass between torchrun ranks) and resolved once by the caller."""
    run_dir, samples_path = _resolve_target(target)
    stored = read_config_file(run_dir) if run_dir else None
    listed = (stored or {}).get("evaluate", {}).get("metrics") if Path(target).is_dir() else None
    chosen = metrics if metrics is not None else listed or None
    names = parse_metrics(chosen)
    defaulted = chosen is None or chosen == "" or chosen == []  # parse_metrics gave the default metrics
    audit_only = set(names) <= set(AUDIT_METRICS) and run_dir is not None
    return run_dir, samples_path, stored, names, defaulted, None if audit_only else load_samples(samples_path)


def _audit(
    run_dir: Path | None,
    names: Sequence[str],
    run_config: RunConfig | None = None,
    splits: Any = None,
    data: Any = None,
) -> dict[str, Any]:
    if run_dir is None:
        raise ConfigError("the privacy audit needs a run directory, not a bare .npz")
    from dpsynth.checkpoint import atomic_write_json
    from dpsynth.eval.audit import audit_run

    private = _audit_splits(run_dir, run_config, splits, data, names)
    report = audit_run(
        run_dir, canary="canary" in names, run_canary="run_canary" in names, write=False, private=private
    )
    atomic_write_json(diagnostics_dir(run_dir) / AUDIT_FILE, report)
    return report


def _audit_splits(run_dir: Path, run_config: RunConfig | None, splits: Any, data: Any, names: Sequence[str]) -> Any:
    """The private splits the audit of a run fitted on arrays compares with (its train and val records,
    which only the arrays it was fitted on give back); None for any other run, which reloads its own."""
    if not fitted_on_arrays(run_config):
        return None
    if "run_canary" in names:
        raise ConfigError(
            "run_canary retrains the method from its run directory, and a run fitted on in-memory arrays "
            "keeps no data to retrain on: audit it with --metrics audit,canary and the arrays as data"
        )
    if splits is None or not len(splits.train):
        splits = array_run_splits(data, run_config, run_dir)  # held-out arrays alone have no members
    return splits


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _accuracy(
    samples: dict[str, np.ndarray],
    splits: Any,
    run_dir: Path | None,
    run_config: RunConfig | None,
    resolved: ResolvedProtocol,
    noise_multiplier: float | None,
    mechanism: str,
    device: str,
    log: EvaluationLog | None = None,
) -> dict[str, Any]:
    protocol = resolved.protocol
    log = log or EvaluationLog(run_dir)
    validation, store = None, None
    if protocol.selection == "private-val":
        if run_dir is None or run_config is None:
            raise PrivacyError(
                "selection on the private validation split needs a run directory (its ledger pays for it)"
            )
        store = _restore_ledger(run_dir, run_config)
        validation = NoisyValidation(
            store.ledger,
            splits.val.images,
            splits.val.labels,
            noise_multiplier,
            mechanism,
            noise=run_config.privacy.noise_source(),  # os.urandom under privacy.secure_rng, never the run seed
        )
        log = log.after_ledger(store)  # a test accuracy of a selection charged in memory waits for its state
    log(
        f"accuracy: {', '.join(protocol.model_names)} x {len(resolved.seeds)} seed(s) on the synthetic set, "
        f"selection {protocol.selection}"
    )
    result = evaluate_utility(
        samples["images"],
        samples["labels"],
        splits.test.images,
        splits.test.labels,
        splits.test.num_classes,
        models=list(protocol.model_names),
        seeds=list(resolved.seeds),
        config=protocol.train_config(),
        soft_labels=samples["soft_labels"] if protocol.labels == "soft" else None,
        selection=protocol.selection,
        validation=validation,
        device=device,
        log=log,
    )
    if store is not None:
        # Persist the charge before any metric that used it is written: ledger.json, then privacy.json.
        store.persist()
    return result


def _fidelity(
    samples: dict[str, np.ndarray],
    splits: Any,
    run_dir: Path | None,
    run_config: RunConfig | None,
    data: Any,
    metrics: list[str],
    want_is: bool,
    notes: dict[str, str],
    device: str,
    inception: str | None,
    inception_logits: str | None,
    input_range: str,
    batch_size: int,
    max_samples: int | None,
    reference_split: str = "train",
    across_ranks: bool = False,
) -> dict[str, Any]:
    """The fidelity metrics. ``across_ranks``: a collective call, every rank extracts its share of the
    features; rank 0 computes the metrics from the gathered features, the other ranks return ``{}``."""
    from dpsynth.dpsgd.distributed import is_main
    from dpsynth.metrics.fidelity import IS_UNAVAILABLE, compute_fidelity, inception_score
    from dpsynth.metrics.inception import InceptionFeatures, reference_features

    computes = is_main() or not across_ranks
    options = {"device": device, "batch_size": batch_size, "input_range": input_range, "across_ranks": across_ranks}
    result: dict[str, Any] = {}
    fake = samples["images"] if max_samples is None else samples["images"][:max_samples]
    if metrics:
        extractor = InceptionFeatures(inception, **options)
        real = getattr(splits, reference_split).images
        reference = real if max_samples is None else real[:max_samples]
        # a name for the cache file only: arrays handed over in memory are named, never printed
        named = data if isinstance(data, (str, Path)) else None
        dataset = named or (run_config.data.private if run_config else None) or splits.test.name
        # Features of private images are private: cached in the run's diagnostics or in the private
        # directory its config names (a benchmark suite shares one across its runs), never in the user cache.
        shared = run_config.evaluate.fid_cache if run_config else None
        cache = Path(shared) if shared else (run_dir / INCEPTION_CACHE_DIR if run_dir is not None else None)
        real_features = reference_features(
            reference, extractor, str(dataset), reference_split, cache=cache, private=True
        )
        fake_features = extractor(fake, desc="inception samples")
        if computes:
            result.update(compute_fidelity(real_features, fake_features, metrics))
    if want_is:
        if inception_logits is None:
            result["is"] = None
            notes["is"] = IS_UNAVAILABLE
        else:
            import torch

            logits = torch.as_tensor(InceptionFeatures(inception_logits, **options)(fake, desc="inception logits"))
            mean, std = inception_score(torch.softmax(logits, dim=1).numpy())
            result["is"] = {"mean": mean, "std": std}
    return result if computes else {}


def _write_metrics(run_dir: Path | None, samples_path: Path, result: dict[str, Any], stale: Sequence[str] = ()) -> Path:
    path = (
        diagnostics_dir(run_dir) / METRICS_FILE
        if run_dir is not None and samples_path.name == SAMPLES_FILE
        else samples_path.with_suffix(f".{METRICS_FILE}")
    )
    return merge_metrics(path, result, stale)


def record_metrics(run_dir: Path, values: Mapping[str, Any]) -> Path:
    """Merge ``values`` into the run's ``diagnostics/metrics.json`` (its other keys kept) and return the path."""
    return merge_metrics(diagnostics_dir(run_dir) / METRICS_FILE, values)


def merge_metrics(path: Path, result: Mapping[str, Any], stale: Sequence[str] = ()) -> Path:
    """Merge ``result`` into the metrics file at ``path`` (atomic write; an unreadable file starts afresh),
    dropping its ``stale`` keys."""
    from dpsynth.checkpoint import atomic_write_json

    merged: dict[str, Any] = {}
    if path.is_file():
        try:
            merged = json.loads(path.read_text())
        except json.JSONDecodeError:
            merged = {}
    for key in stale:
        merged.pop(key, None)
    merged.update(result)
    atomic_write_json(path, merged)
    return path
