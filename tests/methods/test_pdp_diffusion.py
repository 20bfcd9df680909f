"""PDP-Diffusion: cached public pre-training, class-embedding transfer, the smoke run end to end, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsynth.data.dataset import ImageDataset
from dpsynth.diffusion.generation import DiffusionModelSpec, build_diffusion_model
from dpsynth.diffusion.pretrain import PretrainSettings, pretrain_cache_key, pretrain_diffusion, transfer_pretrained
from dpsynth.errors import ConfigError
from dpsynth.runner import run_config
from dpsynth.testing import MethodContractTests

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "dpsynth" / "presets" / "pdp-diffusion" / "smoke.yaml"
TINY_UNET = {
    "preset": "0.8m",
    "base_channels": 8,
    "channel_mult": [1, 2],
    "num_res_blocks": 1,
    "attention_levels": [],
    "num_head_channels": 8,
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    # Every test pre-trains into its own cache directory, never into the user's ~/.cache.
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path_factory.mktemp("cache")))


def _public(num: int = 40, classes: int = 6, seed: int = 0) -> ImageDataset:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (num, 8, 8, 1), dtype=np.uint8)
    return ImageDataset(images, np.arange(num) % classes, classes, name="tiny-public")


def _spec(num_classes: int) -> DiffusionModelSpec:
    return DiffusionModelSpec(model=TINY_UNET, image_size=8, channels=1, num_classes=num_classes, timesteps=100)


SETTINGS = PretrainSettings(steps=3, batch_size=8, lr=1e-3, ema_decay=0.5, checkpoint_every=2)


def test_pretrain_cache_hit_returns_the_same_weights():
    public = _public()
    first = pretrain_diffusion(public, _spec(6), SETTINGS, seed=0, public_spec="tiny", log=lambda m: None)
    assert not first.cached and first.path.is_file()
    second = pretrain_diffusion(public, _spec(6), SETTINGS, seed=0, public_spec="tiny", log=lambda m: None)
    assert second.cached and second.path == first.path
    for (name, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert not list(first.path.parent.glob("*.partial.pt"))  # snapshots removed once finished


def test_cache_key_changes_with_data_settings_model_and_seed():
    public = _public()
    key = pretrain_cache_key(public, "tiny", _spec(6), SETTINGS, 0)
    assert key == pretrain_cache_key(public, "tiny", _spec(6), SETTINGS, 0)
    edited = _public(seed=1)
    assert key != pretrain_cache_key(edited, "tiny", _spec(6), SETTINGS, 0)
    assert key != pretrain_cache_key(public, "other", _spec(6), SETTINGS, 0)
    assert key != pretrain_cache_key(public, "tiny", _spec(6), PretrainSettings(steps=4, batch_size=8), 0)
    wider = DiffusionModelSpec(
        model=dict(TINY_UNET, base_channels=16), image_size=8, channels=1, num_classes=6, timesteps=100
    )
    assert key != pretrain_cache_key(public, "tiny", wider, SETTINGS, 0)
    assert key != pretrain_cache_key(public, "tiny", _spec(6), SETTINGS, 1)


def test_transfer_starts_every_private_class_at_the_null_class():
    torch.manual_seed(0)
    pretrained = build_diffusion_model(_spec(6)).eval()
    with torch.no_grad():  # perturb the zero-initialised layers so that the class embedding matters
        for parameter in pretrained.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    target = build_diffusion_model(_spec(3)).eval()
    assert transfer_pretrained(pretrained, target, "null") == ["class_embedding.weight"]
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([5, 50, 90])
    with torch.no_grad():
        unconditional = pretrained(x, t, None)
        for label in range(3):
            torch.testing.assert_close(target(x, t, torch.full((3,), label)), unconditional)
        assert not torch.allclose(pretrained(x, t, torch.zeros(3, dtype=torch.long)), unconditional)

    mean_init = build_diffusion_model(_spec(3))
    transfer_pretrained(pretrained, mean_init, "mean")
    rows = mean_init.class_embedding.weight.detach()
    torch.testing.assert_close(rows[0], pretrained.class_embedding.weight[:6].mean(0).detach())
    torch.testing.assert_close(rows[-1], pretrained.class_embedding.weight[-1].detach())


def test_transfer_by_class_name_copies_the_public_row_of_the_same_name():
    torch.manual_seed(0)
    pretrained = build_diffusion_model(_spec(6)).eval()
    public_rows = pretrained.class_embedding.weight.detach()
    target = build_diffusion_model(_spec(3))
    transfer_pretrained(
        pretrained, target, "names", public_names=["a", "b", "c", "d", "e", "f"], private_names=["d", "a", "zebra"]
    )
    rows = target.class_embedding.weight.detach()
    torch.testing.assert_close(rows[0], public_rows[3])
    torch.testing.assert_close(rows[1], public_rows[0])
    torch.testing.assert_close(rows[2], public_rows[-1])  # no public class of that name: the null row
    torch.testing.assert_close(rows[3], public_rows[-1])
    with pytest.raises(ConfigError, match="class names"):
        transfer_pretrained(pretrained, build_diffusion_model(_spec(3)), "names", None, ["a", "b", "c"])


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("pdp")
    mp = pytest.MonkeyPatch()
    mp.setenv("DPSYNTH_CACHE", str(base / "cache"))
    try:
        yield run_config(SMOKE, out=base / "run", echo=False)
    finally:
        mp.undo()


def test_smoke_run_end_to_end(smoke_run):
    with np.load(smoke_run / "samples.npz") as samples:
        images, labels = samples["images"], samples["labels"]
    assert images.shape == (100, 28, 28, 1) and images.dtype == np.uint8
    assert np.bincount(labels, minlength=10).tolist() == [10] * 10
    privacy = json.loads((smoke_run / "privacy.json").read_text())
    assert privacy["epsilon"] <= privacy["target_epsilon"] == 10.0
    assert {m["name"]: m["steps"] for m in privacy["mechanisms"]}["dp-adam"] == 4
    log = (smoke_run / "log.txt").read_text()
    assert "62 public -> 10 private classes" in log


def test_resume_of_a_finished_run_neither_retrains_nor_recharges(smoke_run, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(smoke_run.parent / "cache"))  # the smoke run's cache
    before = json.loads((smoke_run / "privacy.json").read_text())
    run_config(SMOKE, out=smoke_run, resume=True, echo=False)
    after = json.loads((smoke_run / "privacy.json").read_text())
    assert after["mechanisms"] == before["mechanisms"]
    assert after["epsilon"] == pytest.approx(before["epsilon"])
    log = (smoke_run / "log.txt").read_text()
    # the second pass restored the released model: no pre-training (not even a cache hit) and no DP step
    assert "pdp-diffusion: training had finished; released state restored, nothing spent" in log
    assert "cache hit" not in log


class TestPDPDiffusionContract(MethodContractTests):
    """The common method contract (dpsynth.testing) on the ``pdp-diffusion/smoke`` preset."""

    method = "pdp-diffusion"
