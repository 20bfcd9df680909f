"""``space: latent`` for DPDM, PrivImage+D, DPPM and DP-FETA: each method's contract tests on its smoke preset moved
to the public backbone's latent space, the contract's finished run decoding its samples through the public decoder
(``check_finished_run``), and the combinations refused at load."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dpsynth.config import load_config
from dpsynth.errors import ConfigError
from dpsynth.methods import get_method
from dpsynth.testing import SHRINK, MethodContractTests

#: a tiny backbone (10 steps, 8 base channels): seconds to train, 28x28x1 -> 7x7x4 latents
TINY_BACKBONE = {"backbone.steps": 10, "backbone.batch_size": 16, "backbone.autoencoder.base_channels": 8}


def latent(method: str) -> dict[str, Any]:
    return {f"{method}.space": "latent", **TINY_BACKBONE}


def check_latent_run(run_dir: Any) -> None:
    """Decoded uint8 pixels in samples.npz, the public backbone in checkpoints/backbone.pt, latents in the log."""
    with np.load(run_dir / "samples.npz") as samples:
        assert samples["images"].shape == (20, 28, 28, 1) and samples["images"].dtype == np.uint8
        assert samples["images"].std() > 0  # decoded pixels, not a constant
    assert (run_dir / "checkpoints" / "backbone.pt").is_file()  # `dpsynth generate` decodes without the cache
    assert "latents (4, 7, 7)" in (run_dir / "log.txt").read_text()


# -------------------------------------------------------------------------------------------- DPDM


class TestDPDMLatentContract(MethodContractTests):
    """Resume, exact spending and the one-record bound of the first DP step, with latents as the DP inputs."""

    method = "dpdm"
    shrink = {**SHRINK, **latent("dpdm")}

    def check_finished_run(self, run_dir: Any) -> None:  # the latent run decodes its samples
        check_latent_run(run_dir)


def test_dpdm_latent_space_is_declared_and_pixel_space_is_the_default():
    config = load_config("dpdm/smoke", latent("dpdm"))
    phases = [phase.name for phase in get_method(config.method).phases(config)]
    assert phases[0] == "backbone" and "dp-adam" in phases
    pixel = load_config("dpdm/smoke")
    assert pixel.section.space == "pixel" and "backbone" not in [p.name for p in get_method(pixel.method).phases(pixel)]


# --------------------------------------------------------------------------------------- PrivImage


class TestPrivImageLatentContract(MethodContractTests):
    """PrivImage+D with the selected public subset encoded by the backbone, DP fine-tuning on latents."""

    method = "privimage"
    shrink = {**SHRINK, **latent("privimage")}

    def check_finished_run(self, run_dir: Any) -> None:  # selects in pixel space, decodes its samples
        check_latent_run(run_dir)
        assert (run_dir / "selection.json").is_file()  # the pixel-space selection is released as before
        assert "pre-trained model" in (run_dir / "log.txt").read_text()


def test_privimage_gan_refuses_latent_space_at_load():
    with pytest.raises(ConfigError, match="space: latent is PrivImage\\+D's"):
        load_config("privimage/smoke_gan", latent("privimage"))
    with pytest.raises(ConfigError, match="flip must be false"):
        load_config("privimage/smoke", {**latent("privimage"), "privimage.flip": True})


# -------------------------------------------------------------------------------------------- DPPM

#: DPPM's smoke preset reads no public data; the backbone trains on a small public set
DPPM_LATENT = {**latent("dppm"), "data.public": "glyphs-digits", "data.max_public": 500}


class TestDPPMLatentContract(MethodContractTests):
    """The score network on label-embedded latents [4, 8, 7]: resume, exact spending, the one-record bound."""

    method = "dppm"
    shrink = {**SHRINK, **DPPM_LATENT}

    def check_finished_run(self, run_dir: Any) -> None:  # decodes its samples; the loss attack scores latents
        from dpsynth.eval.audit import audit_run

        check_latent_run(run_dir)
        # a fresh method instance: the backbone comes from checkpoints/backbone.pt, pairs scored on their latents
        report = audit_run(run_dir, max_examples=10, write=False)
        assert 0.0 <= report["membership_inference"]["loss"]["auc"] <= 1.0


def test_dppm_latent_space_needs_public_data_and_divisible_sides_at_load():
    with pytest.raises(ConfigError, match="data.public"):
        load_config("dppm/smoke", latent("dppm"))
    with pytest.raises(ConfigError, match=r"backbone\.autoencoder\.channel_mult.*28x28"):
        load_config("dppm/smoke", {**DPPM_LATENT, "backbone.autoencoder.channel_mult": [1, 2, 2, 2]})
    assert load_config("dppm/smoke").section.space == "pixel"


# ----------------------------------------------------------------------------------------- DP-FETA

#: DP-FETA's smoke preset reads no public data; the backbone trains on a small public set
FETA_LATENT = {**latent("dp-feta"), "data.public": "glyphs-digits", "data.max_public": 500}


class TestDPFETALatentContract(MethodContractTests):
    """Central images released in pixel space, the warm-up on their latents, DP-Adam on private latents."""

    method = "dp-feta"
    shrink = {**SHRINK, **FETA_LATENT}

    def check_finished_run(self, run_dir: Any) -> None:  # pixel central images released, latent samples decoded
        check_latent_run(run_dir)
        assert (run_dir / "figures" / "central-images.png").is_file()  # the release is pixel images, as before
        log = (run_dir / "log.txt").read_text()
        assert log.index("central images:") < log.index("backbone") < log.index("warm-up:")


def test_dp_feta_latent_space_is_declared_after_the_release_and_needs_public_data():
    config = load_config("dp-feta/smoke", FETA_LATENT)
    phases = [phase.name for phase in get_method("dp-feta").phases(config)]
    assert phases[:3] == ["central-images", "backbone", "warm-up"]
    with pytest.raises(ConfigError, match="data.public"):
        load_config("dp-feta/smoke", latent("dp-feta"))
