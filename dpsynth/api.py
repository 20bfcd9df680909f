"""The Python API: ``Synthesizer`` with ``fit`` / ``sample``, as in SDV and smartnoise-synth.

The command line (``dpsynth run``, ``generate``) is a thin layer over this class, and every run
it makes is a normal run directory (config.yaml, privacy.json, checkpoints/, samples.npz, ...).

    >>> synth = Synthesizer("dp-imgsyn", epsilon=1.0, overrides={"dp-imgsyn.teacher.steps": 20})
    >>> synth.fit(images, labels, num_classes=10, public="digits8x8")
    >>> images, labels = synth.sample(100)
    >>> synth.privacy["epsilon"]
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from dpsynth.config import deep_merge, find_config, load_config, overrides_to_tree, resolve_config
from dpsynth.errors import ConfigError, DataError
from dpsynth.runner import IN_MEMORY as ARRAYS

DATASET_FILE = "dataset.json"  # image shape and classes of an arrays run: what generation needs


class Synthesizer:
    """A differentially private synthesizer of labelled images: one method, one (ε, δ) budget, one run.

    ``overrides`` use the dotted keys of ``dpsynth run --set`` (``{"dpdm.steps": 20}``) and are
    validated by the same schemas, when the synthesizer is built: a bad key or value raises one
    :class:`~dpsynth.errors.ConfigError` line before any data is read.
    """

    def __init__(self, method: str, epsilon: float | None = None, delta: float | None = None,
                 overrides: dict[str, Any] | None = None) -> None:
        raw: dict[str, Any] = {"method": method}
        privacy = {k: v for k, v in (("epsilon", epsilon), ("delta", delta)) if v is not None}
        if privacy:
            raw["privacy"] = privacy
        config = resolve_config(deep_merge(raw, overrides_to_tree(overrides)))
        config["name"] = config["name"] or method
        self._init(config)

    def _init(self, config: dict[str, Any], run_dir: Path | None = None) -> None:
        self._config = config
        self._run_dir = run_dir
        self._context: Any = None
        self._method: Any = None

    @classmethod
    def from_config(cls, path: str | Path, overrides: dict[str, Any] | list[str] | None = None) -> Synthesizer:
        """A synthesizer from a YAML config or a packaged preset name (``"dpdm/mnist10k_eps10"``)."""
        synth = cls.__new__(cls)
        synth._init(load_config(find_config(path), overrides))
        return synth

    @classmethod
    def load(cls, run_dir: str | Path) -> Synthesizer:
        """Reopen a finished run directory (to sample from it or read its privacy record)."""
        run_dir = Path(run_dir)
        stored = run_dir / "config.yaml"
        if not stored.is_file():
            raise DataError(f"{run_dir} is not a run directory (no config.yaml)")
        synth = cls.__new__(cls)
        synth._init(resolve_config(yaml.safe_load(stored.read_text())), run_dir)
        return synth

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> dict[str, Any]:
        """The resolved configuration (every default filled in); a copy."""
        return copy.deepcopy(self._config)

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            raise ConfigError("this synthesizer has not been fitted yet; call fit() first")
        return self._run_dir

    @property
    def privacy(self) -> dict[str, Any]:
        """The run's ``privacy.json``: the spent ε, δ, every mechanism and the guarantee statement."""
        path = self.run_dir / "privacy.json"
        if not path.is_file():
            raise DataError(f"{self.run_dir} has no privacy.json (training did not finish)")
        return json.loads(path.read_text())

    # ------------------------------------------------------------------ the plan
    def plan(self, data: int | np.ndarray | None = None) -> Any:
        """The :class:`~dpsynth.privacy.plan.PrivacyPlan` this synthesizer will spend, without reading data.

        It needs the private train size N only: ``data`` is N itself, or the private image array
        that ``fit`` will get (its length, minus the test and val hold-outs), or None for the
        registered dataset of ``data.private`` (its metadata).
        """
        from dpsynth.data.sizes import planned_train_size
        from dpsynth.runner import plan_run

        if data is None:
            num_examples = planned_train_size(self._config["data"])
        elif isinstance(data, np.ndarray):
            num_examples = array_train_size(len(data), self._config["data"])
        else:
            num_examples = int(data)
        if num_examples < 1:
            raise ConfigError(f"the private train size must be positive, got {num_examples}")
        return plan_run(self._config, num_examples)

    # ------------------------------------------------------------------ fit / sample
    def fit(self, images: Any = None, labels: np.ndarray | None = None, public: Any = None,
            out: str | Path | None = None, *, num_classes: int | None = None, resume: bool = False,
            echo: bool = False) -> Synthesizer:
        """Train under the budget and write a run directory at ``out`` (default: a new temporary directory).

        ``images``: uint8 ``[N, H, W, C]`` or ``[N, H, W]`` arrays (with ``labels`` int ``[N]`` and
        ``num_classes``: a class count read off the labels would be a function of private data), or a
        registered dataset name or path; None keeps ``data.private`` of the config. ``public``: the
        same for the public data (arrays as ``(images, labels)`` or images alone), free to use.
        ``resume`` continues an interrupted run in ``out``; ``echo`` prints the run log to stderr.
        """
        from dpsynth.runner import execute

        config, data = self._config, None
        if isinstance(images, (str, Path)):
            config = resolve_config(deep_merge(config, {"data": {"private": str(images)}}))
        if isinstance(public, (str, Path)):
            config = resolve_config(deep_merge(config, {"data": {"public": str(public)}}))
        if isinstance(images, np.ndarray) or isinstance(public, (np.ndarray, tuple)):
            config, data = self._array_data(config, images, labels, num_classes, public)
        elif images is None and labels is not None:
            raise DataError("labels were given without images")
        run_dir = Path(out) if out else _temporary_run_dir()
        self._config, self._run_dir = config, run_dir
        self._context, self._method = execute(config, run_dir, resume=resume, data=data, echo=echo)
        if data is not None and config["data"]["private"] == ARRAYS:
            _write_dataset_file(run_dir, data[0].train)
        return self

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` synthetic ``(images uint8 [n, H, W, C], labels int64 [n])``; costs no privacy."""
        samples = self._generate(n)
        return samples.images, samples.labels

    def generate(self, n: int, out: str | Path | None = None) -> Path:
        """Write ``n`` samples to ``out`` (default ``RUN_DIR/samples.npz``, with samples.png); return the path."""
        from dpsynth.runner import write_samples

        samples = self._generate(n)
        path = Path(out) if out else self.run_dir / "samples.npz"
        write_samples(path, samples, self._context.num_classes)
        return path

    def _generate(self, n: int) -> Any:
        from dpsynth.runner import open_run, seed_everything

        if int(n) < 1:
            raise ConfigError(f"the number of samples must be positive, got {n}")
        if self._method is None:
            dataset = _read_dataset_file(self.run_dir)
            self._context, self._method = open_run(self.run_dir, echo=False, private=dataset)
        if self._method.releases != "samples":
            raise ConfigError(f"{self._method.name} releases a model, not samples")
        seed_everything(self._context.seed + 7)
        return self._method.generate(self._context, int(n))

    # ------------------------------------------------------------------ arrays
    def _array_data(self, config: dict[str, Any], images: Any, labels: Any, num_classes: int | None,
                    public: Any) -> tuple[dict[str, Any], tuple[Any, Any]]:
        from dpsynth.data import load_private, load_public
        from dpsynth.data.transforms import prepare

        data_cfg = config["data"]
        if isinstance(images, np.ndarray):
            splits = split_arrays(images, labels, num_classes, data_cfg)
            config = deep_merge(config, {"data": {"private": ARRAYS}})
        else:
            splits = load_private(data_cfg["private"], image_size=data_cfg["image_size"], channels=data_cfg["channels"],
                                  val_size=data_cfg["val_size"], split_seed=data_cfg["split_seed"],
                                  max_train=data_cfg["max_train"])
        channels, size, _ = splits.train.image_shape
        if isinstance(public, (np.ndarray, tuple)):
            public_set = prepare(_as_dataset(public, None, None, "public"), size, channels)
            config = deep_merge(config, {"data": {"public": ARRAYS}})
        elif config["data"]["public"]:
            public_set = load_public(config["data"]["public"], image_size=size, channels=channels,
                                     max_size=config["data"]["max_public"])
        else:
            public_set = None
        return resolve_config(config), (splits, public_set)


def array_train_size(total: int, data_cfg: dict[str, Any]) -> int:
    """The train size :func:`split_arrays` leaves of ``total`` examples (from the count alone)."""
    from dpsynth.data.loading import DEFAULT_TEST_SIZE
    from dpsynth.data.transforms import resolve_holdout

    train = total - resolve_holdout(DEFAULT_TEST_SIZE, total)
    train -= resolve_holdout(data_cfg["val_size"] if data_cfg["val_size"] is not None else 0.1, train)
    return min(train, int(data_cfg["max_train"])) if data_cfg["max_train"] is not None else train


def split_arrays(images: np.ndarray, labels: Any, num_classes: int | None, data_cfg: dict[str, Any]) -> Any:
    """Private train/val/test splits of in-memory arrays, by the protocol of ``load_private``.

    Test and val are class-stratified hold-outs (10 % each unless ``data.val_size``), drawn with
    ``data.split_seed``; ``data.max_train`` keeps a stratified subset of train.
    """
    from dpsynth.data import PrivateSplits
    from dpsynth.data.loading import DEFAULT_TEST_SIZE
    from dpsynth.data.transforms import prepare, resolve_holdout, stratified_split, stratified_subset

    dataset = _as_dataset(images, labels, num_classes, "private")
    seed = int(data_cfg["split_seed"])
    keep, held = stratified_split(dataset.labels, dataset.num_classes, resolve_holdout(DEFAULT_TEST_SIZE, len(dataset)),
                                  seed=seed + 1000)
    train, test = dataset.subset(keep, "private-train"), dataset.subset(held, "private-test")
    holdout = resolve_holdout(data_cfg["val_size"] if data_cfg["val_size"] is not None else 0.1, len(train))
    keep, held = stratified_split(train.labels, train.num_classes, holdout, seed=seed)
    train, val = train.subset(keep), train.subset(held, "private-val")
    if data_cfg["max_train"] is not None and int(data_cfg["max_train"]) < len(train):
        train = train.subset(stratified_subset(train.labels, train.num_classes, int(data_cfg["max_train"]), seed))
    size, channels = data_cfg["image_size"], data_cfg["channels"]
    return PrivateSplits(*(prepare(part, size, channels) for part in (train, val, test)))


def _as_dataset(images: Any, labels: Any, num_classes: int | None, role: str) -> Any:
    from dpsynth.data import ImageDataset

    if isinstance(images, tuple):
        images, labels = images
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if labels is None:
        labels, num_classes = np.zeros(len(images), np.int64), 1 if num_classes is None else num_classes
    elif num_classes is None:
        if role == "private":
            raise DataError("pass num_classes with private labels: a class count read off the labels would "
                            "be a function of the private data")
        num_classes = int(np.max(labels)) + 1 if len(labels) else 1
    return ImageDataset(images, np.asarray(labels, np.int64), int(num_classes), name=role)


def _temporary_run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="dpsynth-run-"))


def _write_dataset_file(run_dir: Path, train: Any) -> None:
    from dpsynth.checkpoint import atomic_write_json

    channels, height, width = train.image_shape
    atomic_write_json(run_dir / DATASET_FILE, {"shape": [height, width, channels], "num_classes": train.num_classes,
                                               "class_names": train.class_names})


def _read_dataset_file(run_dir: Path) -> Any:
    """Empty splits with the stored image shape and classes (arrays runs: there is nothing to reload)."""
    from dpsynth.data import ImageDataset, PrivateSplits

    path = run_dir / DATASET_FILE
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    empty = ImageDataset(np.zeros((0, *meta["shape"]), np.uint8), np.zeros(0, np.int64), meta["num_classes"],
                         "private", meta["class_names"])
    return PrivateSplits(empty, empty, empty)
