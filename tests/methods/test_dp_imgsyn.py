"""DP-ImgSyn: its presets, the smoke run end to end (noisy statistics, samples, the released state) and the
resume of a run stopped after the statistics charge. The inversion layer it composes is tested in
tests/inversion/test_inversion.py."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsynth.config import load_config
from dpsynth.contract import RELEASED_PHASE
from dpsynth.errors import PrivacyError
from dpsynth.inversion.statistics import moment_chunks
from dpsynth.methods import dp_imgsyn
from dpsynth.methods.dp_imgsyn import STATS_MECHANISM, TEACHER_MECHANISM, DPImgSyn
from dpsynth.privacy.bounded_sum import clip_to_bound
from dpsynth.report.balance import balanced_labels
from dpsynth.rundir import LEDGER_FILE
from dpsynth.testing import SHRINK, MethodContractTests

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("num, classes", [(100, 10), (83, 10), (7, 3), (80, 2)])
def test_target_labels_are_uniform(num, classes):
    labels = torch.from_numpy(balanced_labels(num, classes))
    counts = np.bincount(labels.numpy(), minlength=classes)
    assert counts.sum() == num and counts.max() - counts.min() <= 1
    if num % classes == 0:
        assert set(counts.tolist()) == {num // classes}


@pytest.mark.parametrize(
    "name",
    [
        "smoke",
        "mnist10k_eps1",
        "mnist10k_eps10",
        "fashionmnist_eps10_tinyimagenet",
        "celeba_hair_eps1_places365",
        "celeba_gender_eps10_lsun",
        "cifar10_eps10_tinyimagenet",
    ],
)
def test_shipped_configs_resolve(name):
    config = load_config(REPO / "dpsynth" / "presets" / "dp-imgsyn" / f"{name}.yaml")
    assert config.method == "dp-imgsyn"
    assert config.section.synthesis.iterations >= 0


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[Path, dict]:
    """The smoke preset run in process; ``seen`` holds the method and the RunContext ``fit`` received."""
    from dpsynth.runner import run_config

    seen: dict = {}
    original_fit = DPImgSyn.fit

    def spying_fit(self, ctx):
        seen.update(method=self, ctx=ctx)
        return original_fit(self, ctx)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DPImgSyn, "fit", spying_fit)
        out = run_config(
            REPO / "dpsynth" / "presets" / "dp-imgsyn" / "smoke.yaml",
            out=tmp_path_factory.mktemp("dpimgsyn") / "run",
            echo=False,
        )
    return out, seen


def test_released_statistics_carry_noise_of_std_sigma_c(smoke_run):
    """The run's released GroupNorm statistics differ from the exact clipped ones by N(0, (σC)²) noise.

    σ is the preset's ``stats.noise_multiplier`` (``privacy.json`` records it composed with the count's
    σ_c, checked here too), C the clip norm the method used; the exact sum is recomputed here from the
    run's own teacher and private train split. A release without noise (the authors' code) or with less
    noise than charged fails.
    """
    out, seen = smoke_run
    ctx, method = seen["ctx"], seen["method"]
    stored = ctx.checkpoints.load(phase=RELEASED_PHASE)  # what the runner kept of the fitted method
    clip_norm, noisy_count = float(stored["clip_norm"]), float(stored["noisy_count"])
    stats = ctx.section.stats
    recorded = {m["name"]: m for m in json.loads((out / "privacy.json").read_text())["mechanisms"]}[STATS_MECHANISM]
    sigma_sum, sigma_count = stats.noise_multiplier, stats.count_noise_multiplier
    assert recorded["noise_multiplier"] == pytest.approx((sigma_sum**-2 + sigma_count**-2) ** -0.5)
    images, _ = ctx.data.train.to_tensors()
    moments = torch.cat(list(moment_chunks(method.model, images, 256, "cpu")))
    exact = clip_to_bound(moments.double(), clip_norm).sum(0)
    channels = [len(mean) for mean in method.statistics.means]
    offsets = np.cumsum([0] + [2 * c for c in channels])
    exact_mean_sums = torch.cat([exact[o : o + c] for o, c in zip(offsets, channels)])
    released_mean_sums = torch.cat(method.statistics.means).double() * noisy_count
    residual = released_mean_sums - exact_mean_sums
    expected_std = sigma_sum * clip_norm
    assert len(residual) >= 30
    # The sample std of d normals leaves ±40 % of the true std with probability 1e-4 at d = 48 (the smoke
    # teacher's GroupNorm channels; chi-square tails), under 0.3 % for any d ≥ 30.
    assert 0.6 * expected_std <= float(residual.std()) <= 1.4 * expected_std
    assert abs(float(residual.mean())) < 4 * expected_std / len(residual) ** 0.5


def test_smoke_run_end_to_end(smoke_run):
    out, _ = smoke_run
    privacy = json.loads((out / "privacy.json").read_text())
    names = {m["name"]: m for m in privacy["mechanisms"]}
    assert {STATS_MECHANISM, TEACHER_MECHANISM} <= set(names)
    assert privacy["target_epsilon"] - 0.01 <= privacy["epsilon"] <= privacy["target_epsilon"]
    assert any("commented out" in note for note in privacy["notes"])
    with np.load(out / "samples.npz") as samples:
        assert samples["images"].dtype == np.uint8 and samples["images"].shape[1:] == (28, 28, 1)
        assert np.allclose(samples["soft_labels"].sum(1), 1.0, atol=1e-4)
        assert len(samples["labels"]) == len(samples["images"])
    log = (out / "diagnostics" / "log.txt").read_text()  # the full log: the teacher's test accuracy is private
    assert "teacher test accuracy" in log and "R_feature" in log
    assert "teacher test accuracy" not in (out / "log.txt").read_text()


def test_a_reopened_run_restores_the_released_state_and_aligns_from_it(smoke_run):
    """Every later process (generate, evaluate, audit) gets the teacher, the noisy statistics, C and the noisy
    count from the released checkpoint alone (no test accuracy or other private diagnostic is stored)."""
    from dpsynth.context import open_run

    out, seen = smoke_run
    fitted = seen["method"]
    stored = seen["ctx"].checkpoints.load(phase=RELEASED_PHASE)
    assert set(stored) == {"model", "statistics", "clip_norm", "noisy_count"}
    ctx, method = open_run(out, echo=False)
    assert (method.clip_norm, method.noisy_count) == (fitted.clip_norm, fitted.noisy_count)
    for ours, theirs in zip(
        [*fitted.statistics.means, *fitted.statistics.variances],
        [*method.statistics.means, *method.statistics.variances],
    ):
        assert torch.equal(ours.cpu(), theirs)
    weights = method.model.state_dict()
    assert all(torch.equal(value.cpu(), weights[key]) for key, value in fitted.model.state_dict().items())
    samples = method.generate(ctx, 6)
    assert samples.images.shape == (6, 28, 28, 1) and samples.soft_labels.shape == (6, ctx.num_classes)


def _mechanisms(run_dir: Path) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads((run_dir / LEDGER_FILE).read_text())["mechanisms"]}


def test_a_run_killed_while_the_statistics_are_read_releases_them_once_on_resume(tmp_path, monkeypatch):
    """Killed during the statistics pass, before anything quoted its charge (the ledger on disk holds the
    teacher only, and nothing was released): the resumed run keeps the checkpointed teacher, releases the
    statistics once and ends on its plan."""
    from dpsynth.runner import run_config

    original = dp_imgsyn.release_feature_statistics

    class DiesWhileRead:
        def __init__(self, train):
            self.train = train

        def __len__(self):
            return len(self.train)

        def batch_tensors(self, indices):
            raise KeyboardInterrupt  # the process is killed during the pass over the private records

    def killed(teacher, train, *args, **kwargs):
        return original(teacher, DiesWhileRead(train), *args, **kwargs)

    smoke, out = REPO / "dpsynth" / "presets" / "dp-imgsyn" / "smoke.yaml", tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(dp_imgsyn, "release_feature_statistics", killed)
        with pytest.raises(KeyboardInterrupt):
            run_config(smoke, SHRINK, out=out, echo=False)
    assert set(_mechanisms(out)) == {TEACHER_MECHANISM}
    teacher = _mechanisms(out)[TEACHER_MECHANISM]
    run_config(smoke, SHRINK, out=out, resume=True, echo=False)
    spent = _mechanisms(out)
    assert spent[TEACHER_MECHANISM] == teacher, "the teacher was not trained again"
    assert (spent[STATS_MECHANISM]["kind"], spent[STATS_MECHANISM]["steps"]) == ("gaussian", 1), "released once"
    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["target_epsilon"] - 0.01 <= privacy["epsilon"] <= privacy["target_epsilon"]
    assert (out / "samples.npz").is_file()


def test_a_run_killed_after_the_statistics_charge_was_stored_is_refused_on_resume(tmp_path, monkeypatch):
    """Killed after ledger.json recorded the statistics charge but before the released state was saved: the
    release is spent and its result lost; repeating it would spend more than the plan, so the resumed run is
    refused and spends nothing."""
    from dpsynth.checkpoint import CheckpointManager
    from dpsynth.runner import run_config

    save = CheckpointManager.save

    def persist_then_die(manager, state, phase="main"):
        if phase == RELEASED_PHASE:
            manager.store.persist()  # what save writes first; the process dies before the checkpoint
            raise KeyboardInterrupt
        save(manager, state, phase=phase)

    smoke, out = REPO / "dpsynth" / "presets" / "dp-imgsyn" / "smoke.yaml", tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(CheckpointManager, "save", persist_then_die)
        with pytest.raises(KeyboardInterrupt):
            run_config(smoke, SHRINK, out=out, echo=False)
    charged = json.loads((out / LEDGER_FILE).read_text())
    assert STATS_MECHANISM in _mechanisms(out)
    with pytest.raises(PrivacyError, match="start a new run"):
        run_config(smoke, SHRINK, out=out, resume=True, echo=False)
    assert json.loads((out / LEDGER_FILE).read_text()) == charged, "nothing more was spent"


class TestDPImgSynContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``dp-imgsyn/smoke`` preset."""

    method = "dp-imgsyn"
