"""The Python API: ``Synthesizer`` with ``fit`` / ``sample``, as in SDV and smartnoise-synth.

The command line (``dpsynth run``, ``generate``) is a thin layer over this class, and every run
it makes is a normal run directory (config.yaml, privacy.json, checkpoints/, samples.npz, ...).

    >>> synth = Synthesizer("dp-imgsyn", epsilon=1.0, overrides={"dp-imgsyn.teacher.steps": 20})
    >>> synth.fit(images, labels, num_classes=10, public="digits8x8")
    >>> images, labels = synth.sample(100)
    >>> synth.privacy["epsilon"]
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dpsynth.config import deep_merge, find_config, load_config, overrides_to_tree, resolve_config
from dpsynth.context import read_run_config
from dpsynth.data.source import DatasetSource
from dpsynth.errors import ConfigError, DataError
from dpsynth.rundir import DPIMAGEBENCH_SAMPLES, PRIVACY_FILE, SAMPLES_FILE
from dpsynth.sections import RunConfig


class Synthesizer:
    """A differentially private synthesizer of labelled images: one method, one (ε, δ) budget, one run.

    ``overrides`` use the dotted keys of ``dpsynth run --set`` (``{"dpdm.steps": 20}``) and are
    validated by the same schemas, when the synthesizer is built: a bad key or value raises one
    :class:`~dpsynth.errors.ConfigError` line before any data is read.
    """

    def __init__(
        self,
        method: str,
        epsilon: float | None = None,
        delta: float | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        raw: dict[str, Any] = {"method": method}
        privacy = {k: v for k, v in (("epsilon", epsilon), ("delta", delta)) if v is not None}
        if privacy:
            raw["privacy"] = privacy
        config = resolve_config(deep_merge(raw, overrides_to_tree(overrides)))
        self._init(config if config.name else config.replace(name=method))

    def _init(self, config: RunConfig, run_dir: Path | None = None) -> None:
        self._config = config
        self._run_dir = run_dir
        self._context: Any = None
        self._method: Any = None

    @classmethod
    def from_config(
        cls, path: str | Path, overrides: dict[str, Any] | list[str] | None = None, num_examples: int | None = None
    ) -> Synthesizer:
        """A synthesizer from a YAML config or a packaged preset name (``"dpdm/mnist10k_eps10"``, ``"auto"``).

        An ``auto`` preset is sized by the scaling rule for ``num_examples`` (default: the data's own N, from
        metadata); ``fit`` sizes it again for the data it gets (docs/own-data.md)."""
        synth = cls.__new__(cls)
        synth._init(load_config(find_config(path), overrides, num_examples=num_examples))
        return synth

    @classmethod
    def load(cls, run_dir: str | Path) -> Synthesizer:
        """Reopen a finished run directory (to sample from it or read its privacy record)."""
        run_dir = Path(run_dir)
        synth = cls.__new__(cls)
        synth._init(read_run_config(run_dir), run_dir)
        return synth

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> dict[str, Any]:
        """The resolved configuration (every default filled in), as ``config.yaml`` stores it; a copy."""
        return self._config.to_dict()

    @property
    def settings(self) -> RunConfig:
        """The resolved configuration as the typed object the method receives; a copy."""
        return self._config.model_copy(deep=True)

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            raise ConfigError("this synthesizer has not been fitted yet; call fit() first")
        return self._run_dir

    @property
    def privacy(self) -> dict[str, Any]:
        """The run's ``privacy.json``: the spent ε, δ, every mechanism and the guarantee statement."""
        path = self.run_dir / PRIVACY_FILE
        if not path.is_file():
            raise DataError(f"{self.run_dir} has no {PRIVACY_FILE} (training did not finish)")
        return json.loads(path.read_text())

    # ------------------------------------------------------------------ the plan
    def plan(self, data: int | np.ndarray | str | Path | None = None, labels: np.ndarray | None = None) -> Any:
        """The :class:`~dpsynth.privacy.plan.PrivacyPlan` this synthesizer will spend.

        It needs the private train size N only (public by the stated assumption, docs/privacy.md):
        ``data`` is N itself, or the private image array that ``fit`` will get together with its
        ``labels`` (each record's hold-out draw is keyed on its content, so the arrays are split
        exactly as ``fit`` splits them; nothing else is read), or a dataset name or path, or None for the
        registered dataset of ``data.private`` (its metadata). An ``auto`` preset is sized for that data first,
        as ``fit`` sizes it.
        """
        from dpsynth.runner import plan_run, plan_source

        if isinstance(data, (int, float, np.number)):  # N itself
            return plan_run(self._config, int(data))
        if data is not None and not isinstance(data, (str, Path)) and labels is None:
            raise DataError("plan(images) needs the labels too: plan(images, labels), as fit gets them")
        return plan_source(self._config, DatasetSource.of(data, labels))

    # ------------------------------------------------------------------ fit / sample
    def fit(
        self,
        images: Any = None,
        labels: np.ndarray | None = None,
        public: Any = None,
        out: str | Path | None = None,
        *,
        num_classes: int | None = None,
        resume: bool = False,
        echo: bool = False,
    ) -> Synthesizer:
        """Train under the budget and write a run directory at ``out`` (default: a new temporary directory).

        ``images``: uint8 ``[N, H, W, C]`` or ``[N, H, W]`` arrays (with ``labels`` int ``[N]`` and
        ``num_classes``: a class count read off the labels would be a function of private data), or a
        registered dataset name or path (``num_classes`` then sets ``data.num_classes``); None keeps
        ``data.private`` of the config. Float images need ``data.pixel_range`` in ``overrides``. ``public``: the
        same for the public data (arrays as ``(images, labels)`` or images alone), free to use.
        ``resume`` continues an interrupted run in ``out``; ``echo`` prints the run log to stderr.

        The arguments become one :class:`~dpsynth.data.source.DatasetSource`, which the run reads exactly as
        ``dpsynth run`` reads a config's datasets (:func:`dpsynth.runner.execute`).
        """
        from dpsynth.runner import execute

        source = DatasetSource.of(images, labels, public, num_classes)
        run_dir = Path(out) if out else _temporary_run_dir()
        self._run_dir = run_dir
        self._context, self._method = execute(self._config, run_dir, resume=resume, source=source, echo=echo)
        self._config = self._context.config
        _warn_if_flagged(run_dir)
        return self

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` synthetic ``(images uint8 [n, H, W, C], labels int64 [n])``; costs no privacy."""
        samples = self._generate(n)
        _warn_if_unbalanced(samples.labels, self._context.num_classes)
        return samples.images, samples.labels

    def generate(self, n: int, out: str | Path | None = None, format: str = "native") -> Path:
        """Write ``n`` samples to ``out`` and return the path. ``format="native"``: the samples.npz contract
        (default ``RUN_DIR/samples.npz``, with samples.png); ``"dpimagebench"``: DPImageBench's gen.npz
        (``x`` float32 NCHW in [0, 1], ``y`` int64; default ``RUN_DIR/gen/gen.npz``, where its eval.py looks)."""
        from dpsynth.runner import SAMPLE_FORMATS, write_samples

        if format not in SAMPLE_FORMATS:
            raise ConfigError(f"sample format must be one of {', '.join(SAMPLE_FORMATS)}, got {format!r}")
        samples = self._generate(n)
        default = self.run_dir / (SAMPLES_FILE if format == "native" else DPIMAGEBENCH_SAMPLES)
        path = Path(out) if out else default
        write_samples(path, samples, self._context.num_classes, format=format)
        return path

    def evaluate(
        self,
        test_images: Any = None,
        test_labels: Any = None,
        metrics: str | list[str] | None = None,
        *,
        data: Any = None,
        baseline: bool = False,
        baseline_overrides: dict[str, Any] | list[str] | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Score this run's samples (:func:`evaluate`); figures computed on private data land in diagnostics/.

        The real data it is scored on, for any run, arrays-fitted ones included:

        * ``test_images, test_labels``: held-out arrays (read as ``fit`` reads arrays), scored as the test split;
        * ``data=(images, labels)``: the arrays ``fit`` got; the run's own held-out split is drawn again (keyed
          on each record's content, so exactly the records the run held out), and only that split is scored;
        * neither: the split this synthesizer holds since ``fit``, else the dataset the run's config names
          (a run fitted on arrays and reloaded has none: one line says which of the two to pass).

        ``baseline=True`` also trains the DP-SGD classifier baseline at the run's ε (a separate release, see
        :func:`evaluate`); ``baseline_overrides`` sets its dotted keys (``{"dpsgd-classifier.steps": 50}``).
        """
        if _names_metrics(test_images) and test_labels is None and metrics is None:
            metrics, test_images = test_images, None  # evaluate("accuracy"), as before held-out arrays existed
        if test_images is not None:
            options["test_data"] = (test_images, test_labels)
        if data is not None:  # with held-out arrays too: the baseline trains on the split drawn from it
            options["data"] = data
        elif test_images is None and self._holds_splits():
            options.setdefault("splits", self._context.data)
        return evaluate(self.run_dir, metrics, baseline=baseline, baseline_overrides=baseline_overrides, **options)

    def _holds_splits(self) -> bool:
        """Whether this synthesizer holds the run's real splits (after ``fit``, not after ``load``)."""
        splits = getattr(self._context, "data", None)
        return splits is not None and len(splits.test) > 0

    def _generate(self, n: int) -> Any:
        from dpsynth.context import open_run
        from dpsynth.eval.held_out import recorded_source
        from dpsynth.seeding import seed_everything

        if int(n) < 1:
            raise ConfigError(f"the number of samples must be positive, got {n}")
        if self._method is None:  # an arrays run reopens on its recorded shape: nothing to reload
            private = recorded_source(self.run_dir)
            self._context, self._method = open_run(self.run_dir, echo=False, private=private)
        if self._method.releases != "samples":
            raise ConfigError(f"{self._method.name} releases a model, not samples")
        seed_everything(self._context.seed + 7)
        return self._method.generate(self._context, int(n))


def evaluate(
    target: str | Path,
    metrics: str | list[str] | None = None,
    *,
    baseline: bool = False,
    baseline_overrides: dict[str, Any] | list[str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Score a run directory or a samples ``.npz`` with the evaluation protocol (docs/evaluation.md).

    ``options`` are those of :func:`dpsynth.eval.evaluate.evaluate` (``data``, ``test_data``, ``models``,
    ``seeds``, ``selection``, ...). ``selection="private-val"`` charges the run's ledger; every other figure
    reads private data without noise and is a private diagnostic, not covered by ε.

    ``baseline=True`` first trains the DP-SGD classifier baseline of the run (once; a finished one is
    reused): ``dpsgd-classifier`` on the run's private train split at the run's ε and δ, a separate release
    in ``RUN/baseline-dpsgd`` with its own ``privacy.json`` (:mod:`dpsynth.eval.baseline`); its test
    accuracy then stands beside the chance and majority rates in ``accuracy_baselines``.
    """
    from dpsynth.eval.evaluate import evaluate as evaluate_target

    if baseline:
        train_baseline(target, baseline_overrides, data=options.get("data"), splits=options.get("splits"))
    elif baseline_overrides:
        raise ConfigError("baseline_overrides set the DP-SGD baseline's keys: pass baseline=True with them")
    return evaluate_target(target, metrics, **options)


def train_baseline(
    run_dir: str | Path, overrides: dict[str, Any] | list[str] | None = None, *, data: Any = None, splits: Any = None
) -> Path:
    """Train the DP-SGD classifier baseline of ``run_dir`` into ``RUN/baseline-dpsgd`` unless it is there
    (a separate release at the run's ε and δ; :mod:`dpsynth.eval.baseline`) and return its directory.

    It trains on the run's own private train split: the run's dataset, or for a run fitted on arrays
    ``data`` (the arrays ``fit`` got, split again by the run's rule) or ``splits`` (held since ``fit``)."""
    from dpsynth.rundir import is_run_dir
    from dpsynth.runner import train_dpsgd_baseline

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not is_run_dir(run_dir):
        raise ConfigError(f"the DP-SGD baseline belongs to a run: {run_dir} is not a run directory")
    return train_dpsgd_baseline(run_dir, read_run_config(run_dir), splits, overrides, data=data)


def _names_metrics(value: Any) -> bool:
    """Whether a first positional argument names metrics (``"accuracy"``, ``["fid", "kid"]``), not images."""
    return isinstance(value, str) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
    )


def _warn_if_unbalanced(labels: np.ndarray, num_classes: int) -> None:
    """A Python warning when the released labels stray from the requested balance (the run's own release is
    checked by the runner, into its log and metrics.json); the labels are public output."""
    from dpsynth.report.balance import label_balance

    message = label_balance(labels, num_classes)["warning"]
    if message:
        warnings.warn(message, UnbalancedLabelsWarning, stacklevel=3)


def _warn_if_flagged(run_dir: Path) -> None:
    """The runner's label check of the run's own release (``metrics.json["label_balance"]``) as a Python
    warning too, since ``fit`` does not echo the run log."""
    from dpsynth.rundir import METRICS_FILE, diagnostics_dir

    try:
        balance = json.loads((diagnostics_dir(run_dir) / METRICS_FILE).read_text()).get("label_balance") or {}
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(balance, dict) and balance.get("warning"):
        warnings.warn(f"{run_dir}: {balance['warning']}", UnbalancedLabelsWarning, stacklevel=3)


class UnbalancedLabelsWarning(UserWarning):
    """Released labels far from the requested (balanced) distribution, or a requested class with no sample."""


def _temporary_run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="dpsynth-run-"))
