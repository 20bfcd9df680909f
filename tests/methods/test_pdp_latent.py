"""PDP-Diffusion in the public backbone's latent space (``pdp-diffusion.space: latent``): the contract tests on
the smoke preset moved to latent space, and a run that decodes through the public decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpsynth.config import load_config
from dpsynth.diffusion.generation import generate_labelled
from dpsynth.diffusion.schedules import build_schedule
from dpsynth.errors import ConfigError
from dpsynth.runner import run_config
from dpsynth.testing import SHRINK, MethodContractTests

LATENT = {
    "pdp-diffusion.space": "latent",
    "backbone.steps": 10,
    "backbone.batch_size": 16,
    "backbone.autoencoder.base_channels": 8,
}


class TestPDPDiffusionLatentContract(MethodContractTests):
    """Resume, exact spending and the one-record bound of the first DP step, with latents as the DP inputs."""

    method = "pdp-diffusion"
    shrink = {**SHRINK, **LATENT}


def test_a_latent_run_decodes_its_samples_and_a_second_run_reuses_the_cached_backbone(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))
    overrides = {**SHRINK, **LATENT}
    first = run_config("pdp-diffusion/smoke", overrides, out=tmp_path / "first", echo=False)
    with np.load(first / "samples.npz") as samples:
        assert samples["images"].shape == (20, 28, 28, 1) and samples["images"].dtype == np.uint8
        assert samples["images"].std() > 0  # decoded pixels, not a constant
    assert (first / "checkpoints" / "backbone.pt").is_file()  # `dpsynth generate` decodes without the cache
    log = (first / "log.txt").read_text()
    assert "latents (4, 7, 7)" in log and "(trained)" in log
    second = run_config("pdp-diffusion/smoke", overrides, out=tmp_path / "second", echo=False)
    log = (second / "log.txt").read_text()
    assert "backbone: cache hit" in log and "pre-training: cache hit" in log  # both public phases reused


def test_latent_space_is_refused_at_load_with_pixel_augmentation_or_an_indivisible_side():
    with pytest.raises(ConfigError, match="flip must be false"):
        load_config("pdp-diffusion/smoke", {**LATENT, "pdp-diffusion.flip": True})
    with pytest.raises(ConfigError, match=r"backbone\.autoencoder\.channel_mult.*28x28"):
        load_config("pdp-diffusion/smoke", {**LATENT, "backbone.autoencoder.channel_mult": [1, 2, 2, 2]})
    assert load_config("pdp-diffusion/smoke").section.space == "pixel"  # the paper's pixel space by default


class _PointOracle(torch.nn.Module):
    """The exact ε-predictor of a dataset holding one latent ``point`` (values outside [-1, 1])."""

    def __init__(self, point: torch.Tensor, schedule) -> None:
        super().__init__()
        self.point, self.schedule = point, schedule

    def forward(self, x, t, y=None):
        abar = self.schedule.alphas_cumprod[t].reshape(-1, 1, 1, 1)
        return (x - abar.sqrt() * self.point) / (1 - abar).sqrt()


def test_latent_sampling_is_unclamped_and_decoded_by_the_given_decoder():
    schedule = build_schedule("linear")
    point = torch.linspace(-3.0, 3.0, 16).reshape(1, 4, 2, 2)  # a latent beyond the pixel range
    oracle = _PointOracle(point, schedule)
    options = {"sample_steps": 20, "seed": 0, "progress": False}
    pixels, _ = generate_labelled(oracle, schedule, 4, 2, (4, 2, 2), **options)
    assert pixels.min() == 0 and pixels.max() == 255  # pixel space: clamped to [-1, 1]

    def decode(latents: torch.Tensor) -> torch.Tensor:  # a stand-in decoder: 4x2x2 latents -> 1x4x4 pixels
        decoded.append(latents.clone())
        return (latents.reshape(-1, 1, 4, 4) / 3.0).clamp(-1, 1)

    decoded: list[torch.Tensor] = []
    images, labels = generate_labelled(oracle, schedule, 4, 2, (4, 2, 2), decode=decode, batch_size=3, **options)
    assert images.shape == (4, 4, 4, 1) and labels.tolist() == [0, 1, 0, 1]
    latents = torch.cat(decoded)
    torch.testing.assert_close(latents, point.expand(4, -1, -1, -1), atol=0.05, rtol=0)  # reached 3.0 unclipped
    assert [len(batch) for batch in decoded] == [3, 1]
