"""PDP-Diffusion in the public backbone's latent space (``pdp-diffusion.space: latent``): the contract tests on
the smoke preset moved to latent space, and a run that decodes through the public decoder."""

from __future__ import annotations

import numpy as np
import pytest

from dpsynth.config import load_config
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
