"""PrivImage selection: sensitivity of the semantic distribution, the ledger, selection rules, re-use charging."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from dpsynth.data.dataset import ImageDataset
from dpsynth.errors import ConfigError, DataError
from dpsynth.privacy import Gaussian, NoiseSource, PrivacyLedger, SubsampledGaussian, compute_epsilon
from dpsynth.selection import (
    QUERY_MECHANISM,
    Selection,
    private_semantic_distribution,
    query_noise_multiplier,
    reuse_selection,
    select_public_classes,
    semantic_distribution_similarity,
    semantic_histogram,
)
from dpsynth.selection.distribution import gaussian_epsilon, read_selection, selected_indices, write_selection
from dpsynth.selection.pipeline import finish_selection


def _random_topk(rng: np.random.Generator, count: int, k1: int, num_semantics: int) -> torch.Tensor:
    return torch.tensor(np.stack([rng.choice(num_semantics, k1, replace=False) for _ in range(count)]))


@pytest.mark.parametrize("conditional", [True, False])
def test_removing_one_image_moves_the_histogram_by_at_most_sqrt_k1(conditional):
    rng = np.random.default_rng(0)
    for trial in range(30):
        k1, semantics, rows = int(rng.integers(1, 6)), int(rng.integers(6, 20)), int(rng.integers(1, 5))
        count = int(rng.integers(2, 40))
        topk = _random_topk(rng, count, k1, semantics)
        labels = torch.tensor(rng.integers(0, rows, count)) if conditional else None
        full = semantic_histogram(topk, labels, rows, semantics)
        drop = int(rng.integers(0, count))
        keep = torch.tensor([i for i in range(count) if i != drop])
        neighbour = semantic_histogram(topk[keep], None if labels is None else labels[keep], rows, semantics)
        distance = np.linalg.norm(full - neighbour)
        assert distance <= math.sqrt(k1) + 1e-9, (trial, distance, k1)
        assert distance == pytest.approx(math.sqrt(k1))  # the bound is attained: no slack in Theorem 3.1
        assert full.sum() == count * k1


def test_release_charges_one_gaussian_and_the_noise_has_std_sqrt_k1_sigma():
    ledger = PrivacyLedger(10.0, 1e-5)
    topk = torch.zeros(0, 4, dtype=torch.int64)  # no images: the release is pure noise
    noisy = private_semantic_distribution(topk, torch.zeros(0, dtype=torch.int64), 50, 40, 3.0, ledger, NoiseSource())
    assert noisy.shape == (50, 40)
    assert np.std(noisy) == pytest.approx(2 * 3.0, rel=0.05)  # sqrt(4) * sigma
    assert [(m.name, m.noise_multiplier, m.repeats) for m in ledger.mechanisms()] == [(QUERY_MECHANISM, 3.0, 1)]
    # Two releases in a row differ: the noise is not drawn from a fixed seed.
    again = private_semantic_distribution(
        topk, torch.zeros(0, dtype=torch.int64), 50, 40, 3.0, PrivacyLedger(10.0, 1e-5), NoiseSource()
    )
    assert not np.allclose(noisy, again)


def test_ledger_composes_the_query_with_fine_tuning():
    ledger = PrivacyLedger(4.0, 1e-5)
    sigma_q = query_noise_multiplier(4.0, 1e-5, 0.05)
    assert gaussian_epsilon(sigma_q, 1e-5) == pytest.approx(0.2, abs=1e-6)
    private_semantic_distribution(
        torch.zeros(3, 2, dtype=torch.int64) + torch.tensor([0, 1]), None, 1, 5, sigma_q, ledger, NoiseSource()
    )
    sigma = ledger.calibrate(0.1, 50)
    ledger.register(SubsampledGaussian("dp-adam", sigma, 0.1, 0))
    ledger.spend("dp-adam", 50)
    names = [m.name for m in ledger.mechanisms()]
    assert names == [QUERY_MECHANISM, "dp-adam"]
    alone = compute_epsilon([SubsampledGaussian("dp-adam", sigma, 0.1, 50)], 1e-5)
    total = ledger.epsilon()
    assert alone < total <= 4.0  # the query costs something, and the total meets the target
    assert total == pytest.approx(
        compute_epsilon([Gaussian(QUERY_MECHANISM, sigma_q), SubsampledGaussian("dp-adam", sigma, 0.1, 50)], 1e-5)
    )


def test_paper_noise_is_the_classical_gaussian_bound_at_eps_001():
    # PrivImage uses sigma_q = sqrt(2 ln(1.25/delta)) / 0.01 ~ 484 at delta = 1e-5; the exact
    # analytic calibration needs less noise for the same (0.01, 1e-5).
    classical = math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.01
    assert classical == pytest.approx(484.5, abs=0.1)
    assert gaussian_epsilon(classical, 1e-5) <= 0.01
    assert query_noise_multiplier(1.0, 1e-5, 0.01) < classical


def test_selection_shares_contested_classes_by_default():
    counts = np.array([[9.0, 8.0, 1.0], [7.0, 2.0, 6.0]])
    chosen, collisions = select_public_classes(counts, 2, np.array([3, 3, 3]))
    assert chosen == [[0, 1], [0, 2]] and collisions == {0: [0, 1]}
    indices, rows = selected_indices(np.array([0, 1, 2]), chosen)
    assert sorted(zip(indices.tolist(), rows.tolist())) == [(0, 0), (0, 1), (1, 0), (2, 1)]  # image 0 twice


def test_exclusive_selection_top_k2_collisions_and_no_empty_class():
    counts = np.array(
        [
            [9.0, 8.0, 1.0, 0.0, 0.0, 5.0],  # row 0 wants 0, 1
            [7.0, 2.0, 6.0, 0.0, 0.0, 0.0],  # row 1 wants 0, 2; loses 0 to row 0 (same rank, 9 > 7)
            [8.5, 7.9, 0.0, 0.0, 0.0, 0.0],  # row 2 wants 0, 1; loses both to row 0 -> keeps its best (0)
        ]
    )
    sizes = np.array([5, 5, 5, 5, 5, 0])  # class 5 has no image: never selected
    chosen, collisions = select_public_classes(counts, 2, sizes, "exclusive")
    assert chosen == [[0, 1], [2], [0]]
    assert collisions == {0: [0, 1, 2], 1: [0, 2]}
    assert all(chosen)  # no empty class
    counts[0, 5] = 100.0  # the top count is on an empty public class: skipped
    chosen, _ = select_public_classes(counts, 2, sizes, "exclusive")
    assert 5 not in chosen[0]
    # A contested class goes where it ranks highest, even against a larger count elsewhere.
    ranked, _ = select_public_classes(
        np.array([[10.0, 9.0, 0.0], [0.0, 5.0, 1.0]]), 2, np.array([1, 1, 1]), "exclusive"
    )
    assert ranked == [[0], [1, 2]]
    with pytest.raises(ConfigError):
        select_public_classes(counts, 6, sizes)
    with pytest.raises(ConfigError):
        select_public_classes(counts, 2, sizes, "random")


def test_selected_subset_is_relabelled_with_the_private_class():
    public_labels = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    indices, rows = selected_indices(public_labels, [[1], [2, 3]])
    assert sorted(indices.tolist()) == [1, 2, 3, 5, 6, 7]
    assert dict(zip(indices.tolist(), rows.tolist())) == {1: 0, 5: 0, 2: 1, 6: 1, 3: 1, 7: 1}


def test_sds_prefers_a_selection_matching_the_private_semantics():
    profiles = np.eye(4)
    private = np.array([10.0, 0.0, 0.0, -3.0])  # negative noisy counts count as 0
    assert semantic_distribution_similarity(private, np.array([5, 0, 0, 0]), profiles) == pytest.approx(1.0)
    assert semantic_distribution_similarity(private, np.array([5, 5, 5, 5]), profiles) == pytest.approx(0.25)


def _tiny_public() -> ImageDataset:
    images = np.zeros((12, 4, 4, 1), dtype=np.uint8)
    return ImageDataset(images, np.arange(12) % 3, 3, name="toy", class_names=["a", "b", "c"])


def _selection(private_spec: str = "toy-private") -> Selection:
    counts = np.array([[5.0, 1.0, 0.0], [0.0, 2.0, 6.0]])
    return Selection(
        noisy_counts=counts,
        chosen=[[0], [2]],
        k1=1,
        k2=1,
        noise_multiplier=12.5,
        conditional=True,
        row_names=["x", "y"],
        semantic_names=["a", "b", "c"],
        private_spec=private_spec,
    )


def test_reused_selection_is_charged_again(tmp_path):
    public = _tiny_public()
    write_selection(tmp_path, _selection(), public.labels, {"full": 0.5, "selected": 0.9})
    assert (tmp_path / "figures" / "selection.png").stat().st_size > 0
    assert "SDS" in (tmp_path / "figures" / "selection.txt").read_text()
    loaded = read_selection(tmp_path)
    assert loaded.chosen == [[0], [2]] and loaded.noise_multiplier == 12.5
    ledger = PrivacyLedger(1.0, 1e-5)
    result = reuse_selection(loaded, public, private_spec="toy-private", ledger=ledger)
    assert [(m.name, m.noise_multiplier) for m in ledger.mechanisms()] == [(QUERY_MECHANISM, 12.5)]
    assert ledger.epsilon() > 0
    assert result.subset.num_classes == 2 and sorted(set(result.subset.labels.tolist())) == [0, 1]
    assert result.ratio == pytest.approx(8 / 12)
    with pytest.raises(DataError, match="private data"):
        reuse_selection(loaded, public, private_spec="other-private", ledger=PrivacyLedger(1.0, 1e-5))


def test_unconditional_selection_keeps_public_labels():
    selection = _selection()
    selection.conditional = False
    selection.noisy_counts, selection.chosen, selection.row_names = np.array([[5.0, 1.0, 6.0]]), [[0, 2]], ["all"]
    result = finish_selection(selection, _tiny_public(), None)
    assert result.subset.num_classes == 3 and set(result.subset.labels.tolist()) == {0, 2}


def test_semantic_query_is_cached_by_public_data_and_settings(tmp_path, monkeypatch):
    from dpsynth.selection import SemanticQuerySettings, train_semantic_query
    from dpsynth.selection.semantic import semantic_query_key

    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path))
    rng = np.random.default_rng(0)
    public = ImageDataset(rng.integers(0, 256, (30, 8, 8, 1), dtype=np.uint8), np.arange(30) % 3, 3, name="p")
    settings = SemanticQuerySettings(preset="cpu", max_steps=2, batch_size=8)
    first = train_semantic_query(public, "p", settings, log=lambda m: None)
    second = train_semantic_query(public, "p", settings, log=lambda m: None)
    assert not first.cached and second.cached and first.key == second.key
    images = public.to_tensors()[0]
    torch.testing.assert_close(first.probabilities(images), second.probabilities(images))
    top = second.topk(images, 2)
    assert top.shape == (30, 2) and (top[:, 0] != top[:, 1]).all()
    edited = ImageDataset(public.images.copy(), public.labels, 3, name="p")
    edited.images[0, 0, 0, 0] ^= 1
    assert semantic_query_key(edited, "p", settings) != first.key
    assert semantic_query_key(public, "p", SemanticQuerySettings(preset="cpu", max_steps=3)) != first.key
    with pytest.raises(DataError):
        second.topk(images, 4)


def test_run_selection_charges_one_query_and_returns_the_relabelled_subset(tmp_path, monkeypatch):
    """The standalone entry point (docs/methods/privimage.md): query, one charged release, selection, subset."""
    from dpsynth.selection import SelectionSettings, SemanticQuerySettings, run_selection

    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path))
    rng = np.random.default_rng(0)
    public = ImageDataset(rng.integers(0, 256, (30, 8, 8, 1), dtype=np.uint8), np.arange(30) % 3, 3, name="p")
    private = ImageDataset(rng.integers(0, 256, (10, 8, 8, 1), dtype=np.uint8), np.arange(10) % 2, 2, name="q")
    ledger = PrivacyLedger(10.0, 1e-5)
    settings = SelectionSettings(k1=2, k2=1, query=SemanticQuerySettings(preset="cpu", max_steps=2, batch_size=8))
    result = run_selection(
        private, public, public_spec="p", private_spec="q", settings=settings, noise_multiplier=3.0,
        ledger=ledger, noise=NoiseSource(), log=lambda m: None,
    )  # fmt: skip
    assert [(m.name, m.noise_multiplier, m.repeats) for m in ledger.mechanisms()] == [(QUERY_MECHANISM, 3.0, 1)]
    selection = result.selection
    assert selection.noisy_counts.shape == (2, 3) and [len(c) for c in selection.chosen] == [1, 1]
    # each private class keeps one public class of 10 images, relabelled with it (a shared class counted per row)
    assert result.subset.num_classes == 2 and np.bincount(result.subset.labels).tolist() == [10, 10]
    subset, spec = result.pretraining_data("p")
    assert subset is result.subset and spec.startswith("p|privimage-selection|")


def test_selection_package_imports_no_method():
    """dpsynth.selection sits below the methods: importing it (and what its functions import lazily) pulls in none."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, dpsynth.selection, dpsynth.selection.pipeline, dpsynth.metrics.utility\n"
        "import dpsynth.models.classifiers\n"
        "above = ('dpsynth.methods', 'dpsynth.runner', 'dpsynth.contract')\n"
        "print(sorted(m for m in sys.modules if m.startswith(above)))"
    )
    repo = str(Path(__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=repo),
    )
    assert result.stdout.strip() == "[]"


def _settings(**changes) -> dict:
    from dpsynth.selection import private_query_settings

    data = {"private": "toy-private", "split_seed": 0, "max_train": 300, "val_size": None, "image_size": None}
    return private_query_settings({**data, **changes})


def test_reuse_refuses_a_selection_made_under_other_split_or_preprocessing_settings(tmp_path):
    public = _tiny_public()
    selection = _selection()
    selection.private_settings = _settings()
    write_selection(tmp_path, selection, public.labels, {})
    loaded = read_selection(tmp_path)
    assert loaded.private_settings == _settings()
    reuse_selection(
        loaded, public, private_spec="toy-private", private_settings=_settings(), ledger=PrivacyLedger(1.0, 1e-5)
    )
    for changes, named in [
        ({"split_seed": 1}, "data.split_seed 0 there, 1 here"),
        ({"val_size": 0.2}, "data.val_size null there, 0.2 here"),
        ({"max_train": 0.5}, "data.max_train 300 there, 0.5 here"),
        ({"image_size": 32, "channels": 3}, "data.channels null there, 3 here; data.image_size null there, 32 here"),
        ({"pixel_range": [0.0, 1.0]}, "data.pixel_range null there, [0.0, 1.0] here"),
    ]:
        ledger = PrivacyLedger(1.0, 1e-5)
        with pytest.raises(DataError, match=f"private data .*differing: {re.escape(named)}\\)") as err:
            reuse_selection(
                loaded, public, private_spec="toy-private", private_settings=_settings(**changes), ledger=ledger
            )
        assert "\n" not in str(err.value) and not ledger.mechanisms()  # one line, nothing charged
    # A selection that records no settings (an older file) is not taken for this run's.
    with pytest.raises(DataError, match="data.split_seed not recorded there, 0 here"):
        reuse_selection(
            _selection(),
            public,
            private_spec="toy-private",
            private_settings=_settings(),
            ledger=PrivacyLedger(1, 1e-5),
        )


def test_selection_json_with_colliding_entries_is_refused(tmp_path):
    import json

    selection = _selection()
    selection.collisions = {2: [0, 1]}
    write_selection(tmp_path, selection, _tiny_public().labels, {})
    path = tmp_path / "selection.json"
    good = json.loads(path.read_text())
    assert read_selection(path).collisions == {2: [0, 1]}  # restored, not dropped

    def refused(edit, match, raw=None):
        data = json.loads(json.dumps(good))
        edit(data)
        path.write_text(raw or json.dumps(data))
        with pytest.raises(DataError, match=match):
            read_selection(path)

    refused(lambda d: d.update(semantic_names=["a", "b", "a"]), "semantic_names repeat 'a'")
    refused(lambda d: d.update(row_names=["x", "x"]), "row_names repeat 'x'")
    refused(lambda d: d["rows"][0]["selected"].append(dict(d["rows"][0]["selected"][0])), "selects 'a' twice")
    refused(lambda d: d["rows"][1]["selected"][0].update(index=0), "'c' has index 2, the entry says 0")
    refused(lambda d: d.update(collisions={"zz": ["x"]}), "collisions name unknown")
    repeated = json.dumps(good).replace('"k2": 1', '"k2": 1, "k2": 2')
    refused(lambda d: None, "repeated key.*'k2'", raw=repeated)
