"""Benchmark suites: which presets run at which ε, and the settings every cell shares.

A suite is a YAML file, shipped inside the package under ``dpsynth/bench/suites/`` (so an installed
wheel runs ``dpsynth bench mnist10k-cpu`` by name) or given as a path. It is validated in full (a typed
pydantic schema, then every preset resolved with its overrides) before anything runs; a bad suite is
one :class:`~dpsynth.errors.ConfigError` line.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import Field

from dpsynth.config import find_packaged, load_config, one_line_error, read_yaml
from dpsynth.errors import ConfigError
from dpsynth.schema import Section

SUITES_DIR = Path(__file__).parent / "suites"
#: the metrics a suite can ask each run's own evaluation for (the baseline reports its test accuracy itself)
SUITE_METRICS = ("accuracy", "fid")
#: in a cell's ``set`` values, the directory of the suite's runs (OUT/SUITE). An override that holds it reads
#: an earlier run's output (e.g. ``privimage.selection.reuse={runs}/privimage-d_eps1/selection.json``), so it is
#: checked when its run starts, and the bench starts that run only once the run it names has finished.
RUNS_PLACEHOLDER = "{runs}"
_NEEDED_RUN = re.compile(re.escape(RUNS_PLACEHOLDER) + r"/([^/]+)")


class SuiteSettings(Section):
    classifier_seeds: int = Field(3, ge=1, description="downstream classifier trainings per run (evaluate.seeds)")
    pipeline_seeds: int = Field(3, ge=1, description="runs (seeds of the whole pipeline) of a cheap cell")
    cheap_run_minutes: float = Field(
        5.0, gt=0, description="a cell whose run is estimated under this gets pipeline_seeds runs, others one"
    )
    metrics: list[Literal["accuracy", "fid"]] = Field(
        default_factory=lambda: list(SUITE_METRICS), description="what each run's own evaluation must report"
    )
    fid_samples: int = Field(2000, ge=2, description="FID on at most this many images per side (evaluate.fid_samples)")
    fid_reference: Literal["train", "test"] = Field("test", description="real split FID compares the samples with")
    canary: bool = Field(True, description="one-run canary audit of each cell (dpsynth evaluate RUN --metrics canary)")
    run_budget_minutes: float = Field(30.0, gt=0, description="wall-clock limit of one run; past it, it is stopped")
    suite_budget_hours: float = Field(6.0, gt=0, description="wall-clock limit of the whole suite")
    budget_machine: str = Field("2 CPU cores", description="the machine the budgets and estimates are stated for")
    estimate_gpu: str | None = Field(
        None,
        description="a GPU class of dpsynth.dpsgd.estimate (H100, A100): --dry-run adds each cell's estimated "
        "parameters, peak memory per device and DP-training hours on it; null: none",
    )

    @pydantic.field_validator("estimate_gpu")
    @classmethod
    def _known_gpu(cls, gpu: str | None) -> str | None:
        from dpsynth.dpsgd.estimate import GPU_CLASSES

        if gpu is not None and gpu not in GPU_CLASSES:
            raise ValueError(f"expected one of {', '.join(GPU_CLASSES)}")
        return gpu


class CellPreset(Section):
    preset: str = Field(description="packaged preset name or config path")
    set: list[str] = Field(
        default_factory=list, description=f"--set overrides of this cell; {RUNS_PLACEHOLDER} is OUT/SUITE"
    )
    estimated_minutes: float | None = Field(None, gt=0, description="this cell's estimate; default: the entry's")


class MethodEntry(Section):
    method: str = Field(description="registered method id")
    name: str | None = Field(None, description="row name and run-directory prefix; default: the method id")
    estimated_minutes: float = Field(
        gt=0, description="wall minutes of one run on the budget machine, its evaluation and audit included"
    )
    set: list[str] = Field(default_factory=list, description="--set overrides of every cell of this entry")
    num_examples: int | None = Field(
        None,
        ge=1,
        description="private train size the dry run's estimate assumes where the dataset's is not "
        "registered (a path, or a dataset with options); null: the registry's",
    )
    presets: dict[float, CellPreset] = Field(description="ε → preset name, or {preset, set}")

    @pydantic.field_validator("presets", mode="before")
    @classmethod
    def _names_as_cells(cls, presets: Any) -> Any:
        if isinstance(presets, dict):
            return {eps: {"preset": spec} if isinstance(spec, str) else spec for eps, spec in presets.items()}
        return presets

    @pydantic.field_validator("presets")
    @classmethod
    def _some_presets(cls, presets: dict[float, Any]) -> dict[float, Any]:
        if not presets:
            raise ValueError("list at least one epsilon: preset")
        if any(eps <= 0 for eps in presets):
            raise ValueError("every epsilon must be positive")
        return presets

    @property
    def label(self) -> str:
        return self.name or self.method


class SuiteSchema(Section):
    name: str | None = Field(None, description="suite name; default: the file's stem")
    description: str = Field("", description="one line on what the suite measures")
    dataset: str | None = Field(
        description="the private dataset every cell uses (checked against presets); null: each preset names its own"
    )
    baseline: str | None = Field("dpsgd-classifier", description="the entry drawn as the baseline line; null: none")
    settings: SuiteSettings = Field(default_factory=SuiteSettings)
    methods: list[MethodEntry] = Field(min_length=1)

    @pydantic.model_validator(mode="after")
    def _names_unique_and_baseline_listed(self) -> SuiteSchema:
        labels = [entry.label for entry in self.methods]
        duplicated = sorted({label for label in labels if labels.count(label) > 1})
        if duplicated:
            raise ValueError(f"entry name {duplicated[0]!r} is used twice; give one of them a 'name'")
        if self.baseline is not None and self.baseline not in labels:
            raise ValueError(f"baseline {self.baseline!r} is not one of the entries ({', '.join(labels)})")
        return self


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (entry, ε) of a suite: the preset and overrides each of its pipeline seeds runs."""

    label: str
    method: str
    epsilon: float
    preset: str
    overrides: tuple[str, ...]  # the entry's and the cell's own; the bench's evaluation overrides are added later
    estimated_minutes: float
    baseline: bool
    num_examples: int | None = None  # the entry's, for the dry run's estimate

    @property
    def needs(self) -> tuple[str, ...]:
        """Names of the runs whose output this cell's overrides read (through ``{runs}/NAME/...``)."""
        return tuple(dict.fromkeys(name for item in self.overrides for name in _NEEDED_RUN.findall(item)))

    @property
    def checked_overrides(self) -> list[str]:
        """The overrides that can be resolved before any run: those not reading another run's output."""
        return [item for item in self.overrides if RUNS_PLACEHOLDER not in item]


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    source: Path
    schema: SuiteSchema
    cells: tuple[Cell, ...]

    @property
    def settings(self) -> SuiteSettings:
        return self.schema.settings

    @property
    def epsilons(self) -> list[float]:
        return sorted({cell.epsilon for cell in self.cells})


def available_suites() -> list[str]:
    """The suites shipped inside the package, by name."""
    return sorted(path.stem for path in SUITES_DIR.glob("*.yaml"))


def find_suite(spec: str | Path) -> Path:
    """``spec`` itself if it is a file, else the packaged suite of that name."""
    return find_packaged(spec, SUITES_DIR, "suite file", "packaged suite", f"known: {', '.join(available_suites())}")


def load_suite(spec: str | Path) -> Suite:
    """Read, validate and expand a suite; every cell's preset is resolved with its overrides (no data read)."""
    path = find_suite(spec)
    raw = read_yaml(path)
    try:
        schema = SuiteSchema.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ConfigError(f"suite {path.name}: {one_line_error(exc, SuiteSchema)}") from None
    cells = tuple(cell for entry in schema.methods for cell in _entry_cells(path, schema, entry))
    return Suite(name=schema.name or path.stem, source=path, schema=schema, cells=cells)


def _entry_cells(path: Path, schema: SuiteSchema, entry: MethodEntry) -> list[Cell]:
    cells = []
    for epsilon, spec in sorted(entry.presets.items()):
        preset, own = spec.preset, spec.set
        overrides = (*entry.set, *own)
        where = f"{path.name}: {entry.label} at eps {epsilon:g}"
        cell = Cell(
            label=entry.label,
            method=entry.method,
            epsilon=float(epsilon),
            preset=preset,
            overrides=tuple(overrides),
            estimated_minutes=spec.estimated_minutes or entry.estimated_minutes,
            baseline=entry.label == schema.baseline,
            num_examples=entry.num_examples,
        )
        try:
            config = load_config(preset, cell.checked_overrides)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if config.method != entry.method:
            raise ConfigError(f"{where}: preset {preset} is a {config.method} config, not {entry.method}")
        if config.privacy.epsilon != epsilon:
            raise ConfigError(
                f"{where}: preset {preset} targets privacy.epsilon={config.privacy.epsilon:g}, not {epsilon:g}"
            )
        if schema.dataset is not None and config.data.private != schema.dataset:
            raise ConfigError(f"{where}: preset {preset} reads {config.data.private}, not {schema.dataset}")
        cells.append(cell)
    return cells
