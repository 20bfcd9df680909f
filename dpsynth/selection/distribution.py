"""PrivImage's DP semantic distribution and public-data selection (Li et al., arXiv:2311.12850).

Algorithm 2, lines 3-18, and Theorem 3.1:

* **Semantic distribution** (lines 3-10). Every private image adds 1 to each of its top-k1 public
  classes. *Conditional* variant (§3.3, last paragraph): one histogram row per private class, the
  image adding to the row of its own label. *Unconditional*: one row (CelebA in the paper).
* **Privacy** (line 11, Theorem 3.1). Flatten the ``R x NS`` histogram into one vector. One image
  contributes a vector with k1 ones, all in the row of its label, so removing it moves the whole
  vector by exactly sqrt(k1) in L2: the sensitivity of the *whole* table is sqrt(k1), whatever R.
  Hence all rows together are one Gaussian mechanism with noise std sqrt(k1)*sigma_q on every cell,
  released with the privacy core's bounded-sum release (:mod:`dpsynth.privacy.bounded_sum`: feature
  = the image's k1-hot vector over the public classes, class = its private label, bound sqrt(k1),
  which clips nothing) and charged once as ``Gaussian(name, sigma_q)``. The rows are not composed
  sequentially: each image touches one row, so they compose in parallel.
* **Selection** (lines 12-18). Each private class keeps the public classes with its top-k2 noisy
  counts. Collisions (a public class in the top-k2 of several private classes): ``share`` (default,
  the algorithm as printed) keeps it for every such class, its images appearing once per class
  with that class's label; ``exclusive`` gives it to the class where it ranks highest (then the
  higher noisy count), and a class left with nothing keeps its best public class anyway. Public classes
  with no image are never chosen. So no class is
  ever empty: PrivImage's reference code, which sizes per-class shares by integer rounding, can
  give a class zero images (CIFAR-100).
* **SDS** (Eq. 5): the semantic distribution similarity of the private set to a public set.

Everything after the noisy histogram is post-processing of a released value plus public data.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpsynth.errors import ConfigError, DataError, PrivacyError

QUERY_MECHANISM = "semantic-query"
SELECTION_FORMAT = "dpsynth-privimage-selection/1"


# -- the histogram and its DP release -----------------------------------------------------------


def semantic_features(topk: torch.Tensor, num_semantics: int) -> torch.Tensor:
    """Per-image k1-hot vectors ``[N, NS]`` over the public classes; each has L2 norm sqrt(k1)
    (top-k indices are distinct)."""
    features = torch.zeros(topk.shape[0], num_semantics, dtype=torch.float64)
    if topk.shape[0]:
        features.scatter_(1, topk.long(), 1.0)
    return features


def _semantic_chunks(topk: torch.Tensor, labels: torch.Tensor | None, num_rows: int, num_semantics: int):
    """``(k1-hot features, row)`` chunks for the bounded-sum layer. ``labels`` None (or ``num_rows`` 1)
    is the unconditional variant: every image adds to row 0."""
    for start in range(0, len(topk), 4096):
        part = topk[start : start + 4096]
        rows = (
            torch.zeros(len(part), dtype=torch.int64)
            if labels is None or num_rows == 1
            else labels[start : start + 4096].long()
        )
        yield semantic_features(part, num_semantics), rows


def semantic_histogram(
    topk: torch.Tensor, labels: torch.Tensor | None, num_rows: int, num_semantics: int
) -> np.ndarray:
    """The exact (non-private) semantic distribution ``[R, NS]``; never released, used by tests."""
    from dpsynth.privacy.bounded_sum import class_sums

    bound = math.sqrt(max(int(topk.shape[1]), 1))
    sums, _ = class_sums(_semantic_chunks(topk, labels, num_rows, num_semantics), num_semantics, num_rows, bound)
    return sums.numpy()


def private_semantic_distribution(
    topk: torch.Tensor,
    labels: torch.Tensor | None,
    num_rows: int,
    num_semantics: int,
    noise_multiplier: float,
    ledger: Any,
    noise: Any,
    name: str = QUERY_MECHANISM,
) -> np.ndarray:
    """Release the semantic distribution with noise N(0, k1 sigma_q^2) per cell (Theorem 3.1).

    One bounded-sum release (rows = private labels, bound sqrt(k1), no denominator): charges
    ``Gaussian(name, sigma_q)`` to ``ledger`` before anything is computed from the private
    ``topk`` / ``labels`` (a refused charge releases nothing). Returns float64 ``[R, NS]``.
    """
    from dpsynth.privacy.bounded_sum import BoundedSum, release_bounded_sum

    query = BoundedSum(name, math.sqrt(int(topk.shape[1])), noise_multiplier, num_classes=num_rows)
    chunks = _semantic_chunks(topk, labels, num_rows, num_semantics)
    return release_bounded_sum(chunks, num_semantics, query, ledger, noise).sums.numpy()


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """The exact ε at δ of one Gaussian mechanism with std σ x sensitivity (Balle & Wang 2018, Thm. 8)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    mu = 1.0 / noise_multiplier

    def excess(eps: float) -> float:
        # e^eps * Phi(.) in the log domain: no overflow for small sigma (large eps).
        return float(norm.cdf(-eps / mu + mu / 2) - np.exp(eps + norm.logcdf(-eps / mu - mu / 2)) - delta)

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2
    return float(brentq(excess, 0.0, high, xtol=1e-12))


def query_noise_multiplier(target_epsilon: float, delta: float, share: float) -> float:
    """σ_q for which the query alone is (share · ε, δ)-DP, exactly (analytic Gaussian mechanism).

    The ledger then composes it with fine-tuning (PRV), whose σ is calibrated to what is left, so
    the total meets the target; the query's marginal cost in that composition is below share · ε.
    """
    from scipy.optimize import brentq

    if not 0 < share < 1:
        raise ConfigError(f"query_epsilon_share must be in (0, 1), got {share}")
    epsilon = share * target_epsilon
    # ε(σ) decreases in σ; bracket it on a log scale.
    low, high = 1e-2, 1e7
    if gaussian_epsilon(high, delta) > epsilon:
        raise PrivacyError(f"no query noise up to {high:g} reaches eps={epsilon:g}; raise query_epsilon_share")
    return float(
        math.exp(
            brentq(lambda s: gaussian_epsilon(math.exp(s), delta) - epsilon, math.log(low), math.log(high), xtol=1e-6)
        )
    )


# -- selection --------------------------------------------------------------------------------


@dataclasses.dataclass
class Selection:
    """The released selection: which public classes each private class keeps, with the noisy counts."""

    noisy_counts: np.ndarray  # float64 [R, NS], the released semantic distribution
    chosen: list[list[int]]  # per private row, its public classes (after collisions), best first
    k1: int
    k2: int
    noise_multiplier: float  # σ_q; the cell noise std is sqrt(k1) σ_q
    conditional: bool
    row_names: list[str]
    semantic_names: list[str]
    private_spec: str
    collisions: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # public class -> rows wanting it
    # The settings that decided which private records were queried and what the query saw (the
    # split, max_train, preprocessing): a re-use compares them (dpsynth.selection.pipeline).
    private_settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def owners(self) -> dict[int, list[int]]:
        """Public class -> the private rows whose selection contains it."""
        result: dict[int, list[int]] = {}
        for row, classes in enumerate(self.chosen):
            for semantic in classes:
                result.setdefault(semantic, []).append(row)
        return result

    def subset_spec(self, public_spec: str) -> str:
        """The cache spec of the public subset this selection picks from ``public_spec``: pre-training on it
        (§3.3) is cached under a key that names the chosen classes, so another selection never shares it."""
        return f"{public_spec}|privimage-selection|{'/'.join(','.join(map(str, c)) for c in self.chosen)}"

    def to_json(
        self,
        public_size: int | None = None,
        ratio: float | None = None,
        sds: dict[str, float] | None = None,
        query_accuracy: float | None = None,
    ) -> dict[str, Any]:
        rows = []
        for row, classes in enumerate(self.chosen):
            rows.append(
                {
                    "class": self.row_names[row],
                    "selected": [
                        {
                            "public_class": self.semantic_names[s],
                            "index": int(s),
                            "noisy_count": round(float(self.noisy_counts[row, s]), 3),
                        }
                        for s in classes
                    ],
                }
            )
        return {
            "format": SELECTION_FORMAT,
            "conditional": self.conditional,
            "k1": self.k1,
            "k2": self.k2,
            "query": {
                "mechanism": QUERY_MECHANISM,
                "noise_multiplier": self.noise_multiplier,
                "cell_noise_std": self.noise_multiplier * math.sqrt(self.k1),
                "l2_sensitivity": math.sqrt(self.k1),
                "public_accuracy": query_accuracy,
            },
            "private_spec": self.private_spec,
            "private_settings": self.private_settings,
            "rows": rows,
            "collisions": {
                self.semantic_names[s]: [self.row_names[r] for r in wanted] for s, wanted in self.collisions.items()
            },
            "selection_ratio": ratio,
            "public_size": public_size,
            "sds": sds,
            "row_names": self.row_names,
            "semantic_names": self.semantic_names,
            "noisy_counts": self.noisy_counts.tolist(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Selection:
        """The selection written by :meth:`to_json`; refuses names or entries that collide.

        Public classes and private rows are looked up by name, so two classes of one name, a class
        listed twice in a row, or an entry whose ``index`` names another class would silently map
        to the wrong class: each is refused instead.
        """
        if data.get("format") != SELECTION_FORMAT:
            raise DataError(f"not a PrivImage selection file (format {data.get('format')!r})")
        semantic_names = _unique_names(data["semantic_names"], "semantic_names")
        row_names = _unique_names(data["row_names"], "row_names")
        index = {name: i for i, name in enumerate(semantic_names)}
        rows = {name: i for i, name in enumerate(row_names)}
        if [row["class"] for row in data["rows"]] != row_names:
            raise DataError("the selection's rows do not match its row_names, in order")
        chosen = [_chosen_row(row, index) for row in data["rows"]]
        noisy_counts = np.asarray(data["noisy_counts"], dtype=np.float64)
        expected = (len(row_names), len(semantic_names))
        if noisy_counts.shape != expected:
            raise DataError(f"noisy_counts has shape {noisy_counts.shape}, not rows x classes {expected}")
        return cls(
            noisy_counts=noisy_counts,
            chosen=chosen,
            k1=int(data["k1"]),
            k2=int(data["k2"]),
            noise_multiplier=float(data["query"]["noise_multiplier"]),
            conditional=bool(data["conditional"]),
            row_names=row_names,
            semantic_names=semantic_names,
            private_spec=str(data["private_spec"]),
            collisions=_collisions(data.get("collisions") or {}, index, rows),
            private_settings=dict(data.get("private_settings") or {}),
        )


def _unique_names(names: list[Any], field: str) -> list[str]:
    names = [str(name) for name in names]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise DataError(f"the selection's {field} repeat {', '.join(map(repr, repeated))}: entries would collide")
    return names


def _chosen_row(row: dict[str, Any], index: dict[str, int]) -> list[int]:
    """One row's public classes by name, each checked against its recorded index and listed once."""
    chosen = []
    for item in row["selected"]:
        name = str(item["public_class"])
        if name not in index:
            raise DataError(f"row {row['class']!r} selects {name!r}, which is not among semantic_names")
        if "index" in item and int(item["index"]) != index[name]:
            raise DataError(f"row {row['class']!r}: {name!r} has index {index[name]}, the entry says {item['index']}")
        if index[name] in chosen:
            raise DataError(f"row {row['class']!r} selects {name!r} twice")
        chosen.append(index[name])
    return chosen


def _collisions(named: dict[str, list[str]], index: dict[str, int], rows: dict[str, int]) -> dict[int, list[int]]:
    """The collisions map by index; every public class and row it names must exist."""
    unknown = sorted(set(named) - set(index)) + sorted({r for wanted in named.values() for r in wanted} - set(rows))
    if unknown:
        raise DataError(f"the selection's collisions name unknown classes or rows {unknown}")
    return {index[name]: [rows[r] for r in wanted] for name, wanted in named.items()}


COLLISION_POLICIES = ("share", "exclusive")


def select_public_classes(
    noisy_counts: np.ndarray, k2: int, public_class_sizes: np.ndarray, collisions: str = "share"
) -> tuple[list[list[int]], dict[int, list[int]]]:
    """Per row, its top-k2 public classes by noisy count, collisions resolved (Algorithm 2, line 12).

    Returns ``(chosen, collisions)``: ``chosen[r]`` lists row r's public classes, highest count
    first; ``collisions`` maps each public class wanted by several rows to those rows.

    ``collisions="share"`` (Algorithm 2 as printed: each private class selects on its own): a
    contested class is kept by every row that wants it, its images relabelled once per row.
    ``"exclusive"``: a contested class goes to the row where it ranks highest (a glyph "5" ranked 1st
    for digit 5 and 2nd for
    digit 3 goes to 5), ties to the higher noisy count, then the lower row. A row left empty keeps
    its top public class (shared). Empty public classes are never chosen.
    """
    num_rows = noisy_counts.shape[0]
    available = np.flatnonzero(np.asarray(public_class_sizes) > 0)
    if len(available) == 0:
        raise DataError("the public dataset has no images to select from")
    if collisions not in COLLISION_POLICIES:
        raise ConfigError(f"collisions must be one of {', '.join(COLLISION_POLICIES)}, got {collisions!r}")
    if not 1 <= k2 <= len(available):
        raise ConfigError(f"k2 must be in [1, {len(available)}] (non-empty public classes), got {k2}")
    wanted = []
    for row in range(num_rows):
        scores = noisy_counts[row, available]
        order = np.lexsort((available, -scores))  # highest count first, ties by class index
        wanted.append([int(available[i]) for i in order[:k2]])
    rows_wanting: dict[int, list[int]] = {}
    for row, classes in enumerate(wanted):
        for semantic in classes:
            rows_wanting.setdefault(semantic, []).append(row)
    contested = {s: rows for s, rows in rows_wanting.items() if len(rows) > 1}
    if collisions == "share":
        return wanted, contested
    rank = {(row, s): position for row, classes in enumerate(wanted) for position, s in enumerate(classes)}
    owner = {s: min(rows, key=lambda r: (rank[r, s], -noisy_counts[r, s], r)) for s, rows in rows_wanting.items()}
    chosen = [[s for s in classes if owner[s] == row] for row, classes in enumerate(wanted)]
    for row, classes in enumerate(chosen):
        if not classes:  # no-empty-class rule: keep the best one even though another row owns it
            classes.append(wanted[row][0])
    return chosen, contested


def selected_indices(public_labels: np.ndarray, chosen: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(indices into the public set, private row of each)`` for the selection (Algorithm 2, 13-18)."""
    indices, rows = [], []
    for row, classes in enumerate(chosen):
        picked = np.flatnonzero(np.isin(public_labels, classes))
        indices.append(picked)
        rows.append(np.full(len(picked), row, dtype=np.int64))
    return np.concatenate(indices), np.concatenate(rows)


def selection_ratio(public_labels: np.ndarray, chosen: list[list[int]]) -> float:
    """Fraction of the public images selected (each counted once)."""
    classes = sorted({s for row in chosen for s in row})
    return float(np.isin(public_labels, classes).mean()) if len(public_labels) else 0.0


def semantic_distribution_similarity(weights_1: np.ndarray, weights_2: np.ndarray, profiles: np.ndarray) -> float:
    """SDS of Eq. 5: Σ_i Σ_k w1_i w2_k cos(V(s_i), V(s_k)), both datasets described over the same semantics.

    ``weights_*`` are semantic frequencies (normalised here; negative noisy counts count as 0),
    ``profiles[s]`` is the embedding V(s).
    """
    w1 = np.clip(np.asarray(weights_1, dtype=np.float64), 0, None)
    w2 = np.clip(np.asarray(weights_2, dtype=np.float64), 0, None)
    if w1.sum() <= 0 or w2.sum() <= 0:
        return 0.0
    w1, w2 = w1 / w1.sum(), w2 / w2.sum()
    unit = profiles / np.maximum(np.linalg.norm(profiles, axis=1, keepdims=True), 1e-12)
    return float(w1 @ (unit @ unit.T) @ w2)


# -- released figure --------------------------------------------------------------------------


def save_selection_figure(selection: Selection, path: Path, top: int = 12) -> None:
    """A bar chart per private class of its largest noisy counts; selected public classes highlighted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = len(selection.chosen)
    columns = min(rows, 5)
    lines = math.ceil(rows / columns)
    figure = Figure(figsize=(3.2 * columns, 2.4 * lines), dpi=100)
    FigureCanvasAgg(figure)
    for row in range(rows):
        axes = figure.add_subplot(lines, columns, row + 1)
        counts = selection.noisy_counts[row]
        order = np.argsort(-counts)[:top]
        colours = ["tab:orange" if s in selection.chosen[row] else "tab:grey" for s in order]
        axes.bar(range(len(order)), counts[order], color=colours)
        axes.set_xticks(range(len(order)))
        axes.set_xticklabels([selection.semantic_names[s] for s in order], fontsize=7)
        axes.set_title(f"private class {selection.row_names[row]}", fontsize=9)
        axes.tick_params(axis="y", labelsize=7)
    figure.subplots_adjust(left=0.05, right=0.99, bottom=0.12 / lines, top=1 - 0.1 / lines, wspace=0.3, hspace=0.5)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")


def write_selection(
    run_dir: Path,
    selection: Selection,
    public_labels: np.ndarray,
    sds: dict[str, float],
    query_accuracy: float | None = None,
) -> None:
    """``selection.json``, ``figures/selection.png`` and its caption ``figures/selection.txt`` (released).

    Everything in them is the noisy release or computed from public data: the SDS compares the noisy
    semantic distribution with the full and the selected public set, ``query_accuracy`` is the query
    classifier's accuracy on the public set.
    """
    from dpsynth.checkpoint import atomic_write_json, atomic_write_text
    from dpsynth.rundir import FIGURES_DIR, SELECTION_FILE

    ratio = selection_ratio(public_labels, selection.chosen)
    atomic_write_json(run_dir / SELECTION_FILE, selection.to_json(len(public_labels), ratio, sds, query_accuracy))
    save_selection_figure(selection, run_dir / FIGURES_DIR / "selection.png")
    caption = (
        f"PrivImage selection: noisy semantic distribution (top-{selection.k1} public classes per private "
        f"image, Gaussian noise std {selection.noise_multiplier * math.sqrt(selection.k1):.1f} per cell); "
        f"orange = selected (top-{selection.k2}). Selection ratio {ratio:.1%} of the public set; "
        f"SDS full {sds.get('full', float('nan')):.3f} vs selected {sds.get('selected', float('nan')):.3f}."
    )
    atomic_write_text(run_dir / FIGURES_DIR / "selection.txt", caption)


def read_selection(path: str | Path) -> Selection:
    from dpsynth.rundir import SELECTION_FILE

    path = Path(path)
    if path.is_dir():
        path = path / SELECTION_FILE
    if not path.is_file():
        raise DataError(f"selection file {path} not found")
    try:
        return Selection.from_json(json.loads(path.read_text(), object_pairs_hook=_refuse_repeated_keys))
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"cannot read selection {path}: {err}") from None


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique; ``json.loads`` alone keeps the last of repeated keys silently."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"repeated key(s) {', '.join(map(repr, repeated))} in one object: entries collide")
    return dict(pairs)
