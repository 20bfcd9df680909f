"""PrivImage's selection phase end to end (Li et al., arXiv:2311.12850, Algorithm 2, lines 2-18).

``run_selection`` trains (or loads) the semantic query function on public data, queries the top-k1
public classes of every private training image, releases the noisy semantic distribution as one
ledger mechanism with the σ_q it is given (a run takes it from its privacy plan; calibrating it is
:func:`dpsynth.selection.distribution.query_noise_multiplier`), selects the public classes and
returns the relabelled public subset to pre-train on, with the selection ratio and the SDS of the
full and the selected public set.

A selection is a release computed from private data. Re-using one (``reuse_selection``) in another
run charges its mechanism again to that run's ledger, with the σ it was released with: the new
run's output depends on it, so its ε must count it. (PrivImage's reference code loads a cached
selection file and charges nothing for it.) It must also have queried the records this run trains on,
seen as this run sees them: every setting that decides the private train split or the query's input
(:func:`private_query_settings`) is recorded with the selection and compared on re-use.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from dpsynth.data.loading import DEFAULT_TEST_SIZE, private_options
from dpsynth.data.section import DataSection, as_data_section
from dpsynth.data.splits import SPLIT_SCHEME
from dpsynth.errors import DataError
from dpsynth.selection.distribution import (
    QUERY_MECHANISM,
    Selection,
    private_semantic_distribution,
    select_public_classes,
    selected_indices,
    selection_ratio,
    semantic_distribution_similarity,
)
from dpsynth.selection.semantic import SemanticQuery, SemanticQuerySettings, train_semantic_query


@dataclasses.dataclass(frozen=True)
class SelectionSettings:
    k1: int = 1  # public classes queried per private image (Theorem 3.1: sensitivity sqrt(k1))
    k2: int = 1  # public classes kept per private class (appendix B: k1 = k2 = k)
    conditional: bool = True  # one histogram row per private class, selected images relabelled
    collisions: str = "share"  # share | exclusive (dpsynth.selection.distribution.select_public_classes)
    query: SemanticQuerySettings = dataclasses.field(default_factory=SemanticQuerySettings)
    cache: bool = True  # cache the semantic query classifier (public data only)


def private_query_settings(data: DataSection | Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a config's ``data`` section that decide what the semantic query read.

    Two runs that agree on all of them query the same records (given the same files), each
    preprocessed the same way; the split rule itself is part of it (``split_scheme``), so a
    selection made under another rule is not taken for this run's. Values go through JSON, as
    they are stored.
    """
    # Every option the private loader takes (one list, ``private_options``), so a new one is compared too.
    read = {"private": as_data_section(data).private, "test_size": DEFAULT_TEST_SIZE}
    settings = {f"data.{key}": value for key, value in {**read, **private_options(data)}.items()}
    settings["split_scheme"] = SPLIT_SCHEME
    return json.loads(json.dumps(settings))


@dataclasses.dataclass
class SelectionResult:
    selection: Selection
    subset: Any  # ImageDataset to pre-train on
    ratio: float
    sds: dict[str, float]
    query_accuracy: float | None = None  # the query classifier's accuracy on the public set (public)

    def pretraining_data(self, public_spec: str) -> tuple[Any, str]:
        """``(subset, cache spec)`` to pre-train on (§3.3): the spec names the selection, so pre-training on
        another selection of ``public_spec`` never shares its cache entry."""
        return self.subset, self.selection.subset_spec(public_spec)


def run_selection(
    private_train: Any,
    public: Any,
    *,
    public_spec: str,
    settings: SelectionSettings,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] = print,
    **release: Any,
) -> SelectionResult:
    """Algorithm 2, lines 2-18: train (or load) the query on ``public``, release and select
    (:func:`release_selection`, whose keywords ``release`` passes: ``private_spec``, ``private_settings``,
    ``noise_multiplier``, ``ledger``, ``noise``), and return the subset to pre-train on."""
    query = train_semantic_query(public, public_spec, settings.query, device=device, use_cache=settings.cache, log=log)
    selection = release_selection(private_train, public, query, settings=settings, log=log, **release)
    return finish_selection(selection, public, query)


def release_selection(
    private_train: Any,
    public: Any,
    query: SemanticQuery,
    *,
    private_spec: str,
    private_settings: Mapping[str, Any] | None = None,
    settings: SelectionSettings,
    noise_multiplier: float,
    ledger: Any,
    noise: Any,
    log: Callable[[str], None] = print,
) -> Selection:
    """Algorithm 2, lines 3-18 with a trained ``query``: the one charged release (the noisy semantic
    distribution, Theorem 3.1, charged as ``Gaussian(semantic-query, noise_multiplier)``) and the public classes
    it selects; nothing else reads private data. ``private_settings`` (:func:`private_query_settings`) are
    recorded with the selection for a later re-use to compare."""
    conditional = settings.conditional and private_train.num_classes > 1
    rows = private_train.num_classes if conditional else 1
    sigma = float(noise_multiplier)
    images, labels = private_train.to_tensors()
    # Private reads below are inside the charged mechanism: the top-k1 classes only enter the noisy sum.
    topk = query.topk(images, settings.k1)
    noisy = private_semantic_distribution(
        topk, labels if conditional else None, rows, public.num_classes, sigma, ledger, noise
    )
    log(
        f"semantic query: {QUERY_MECHANISM} charged, sigma_q={sigma:.3f} (cell noise std "
        f"{sigma * settings.k1**0.5:.2f}); eps so far {ledger.epsilon():.4f}"
    )
    public_sizes = np.bincount(public.labels, minlength=public.num_classes)
    chosen, collisions = select_public_classes(noisy, settings.k2, public_sizes, settings.collisions)
    return Selection(
        noisy_counts=noisy,
        chosen=chosen,
        k1=settings.k1,
        k2=settings.k2,
        noise_multiplier=sigma,
        conditional=conditional,
        row_names=_row_names(private_train, rows),
        semantic_names=_names(public),
        private_spec=private_spec,
        collisions=collisions,
        private_settings=dict(private_settings or {}),
    )


def reuse_selection(
    selection: Selection,
    public: Any,
    *,
    private_spec: str,
    ledger: Any,
    query: SemanticQuery | None = None,
    private_settings: Mapping[str, Any] | None = None,
) -> SelectionResult:
    """Use an earlier run's released selection in this run, charging its mechanism to ``ledger`` again.

    Refused unless it was released on this run's private data as this run splits and preprocesses
    it (:func:`check_reusable`).
    """
    from dpsynth.privacy import Gaussian

    check_reusable(selection, public, private_spec=private_spec, private_settings=private_settings)
    ledger.charge(Gaussian(QUERY_MECHANISM, float(selection.noise_multiplier)))
    return finish_selection(selection, public, query)


def check_reusable(
    selection: Selection, public: Any, *, private_spec: str, private_settings: Mapping[str, Any] | None = None
) -> None:
    """A :class:`DataError` unless ``selection`` was released on this run's private data: ``private_spec`` and
    every one of ``private_settings`` must equal what it records, and its public classes this run's."""
    differing = _differing_settings(
        {"data.private": selection.private_spec, **selection.private_settings},
        {"data.private": private_spec, **(private_settings or {})},
    )
    if differing:
        raise DataError(
            "the selection was released on other private data than this run's (differing: "
            + "; ".join(differing)
            + "); re-run the selection for this data"
        )
    if selection.semantic_names != _names(public):
        raise DataError("the selection was made over other public classes than this run's data.public")


def _differing_settings(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: recorded -> current`` for every setting the two disagree on (a missing one differs too)."""
    recorded, current = json.loads(json.dumps(dict(recorded))), json.loads(json.dumps(dict(current)))

    def shown(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key]) if key in values else "not recorded"

    return [
        f"{key} {shown(recorded, key)} there, {shown(current, key)} here"
        for key in sorted(recorded.keys() | current.keys())
        if key not in recorded or key not in current or recorded[key] != current[key]
    ]


def finish_selection(selection: Selection, public: Any, query: SemanticQuery | None) -> SelectionResult:
    """The relabelled subset, the ratio and the SDS (post-processing of the release and public data)."""
    from dpsynth.data.dataset import ImageDataset

    indices, rows = selected_indices(public.labels, selection.chosen)
    if selection.conditional:
        subset = ImageDataset(
            public.images[indices], rows, len(selection.chosen), f"{public.name}-selected", selection.row_names
        )
    else:
        subset = ImageDataset(
            public.images[indices],
            public.labels[indices],
            public.num_classes,
            f"{public.name}-selected",
            public.class_names,
        )
    if len(subset) == 0:
        raise DataError("the selection is empty")
    sds: dict[str, float] = {}
    accuracy = None
    if query is not None:
        profiles, accuracy = query.profile_public(public)
        private_weights = selection.noisy_counts.sum(0).clip(min=0)  # sum rows first: less noise mass
        full = np.bincount(public.labels, minlength=public.num_classes)
        chosen_weights = np.bincount(public.labels[indices], minlength=public.num_classes)
        sds = {
            "full": semantic_distribution_similarity(private_weights, full, profiles),
            "selected": semantic_distribution_similarity(private_weights, chosen_weights, profiles),
        }
    return SelectionResult(selection, subset, selection_ratio(public.labels, selection.chosen), sds, accuracy)


def _names(dataset: Any) -> list[str]:
    return list(dataset.class_names) if dataset.class_names else [str(i) for i in range(dataset.num_classes)]


def _row_names(private_train: Any, rows: int) -> list[str]:
    return _names(private_train) if rows > 1 else ["all"]
