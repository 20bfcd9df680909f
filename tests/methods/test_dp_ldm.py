"""DP-LDM, DP-LDM (SD) and DP-LoRA: the method contract on their smoke presets, the trainable set of the first DP
step, the released model (a plain UNet, adapters folded in) and the config rules checked at load."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from dpsynth.config import load_config
from dpsynth.contract import RELEASED_PHASE
from dpsynth.diffusion.generation import diffusion_model_from_state
from dpsynth.errors import ConfigError
from dpsynth.runner import run_config
from dpsynth.testing import SHRINK, MethodContractTests


class TestDPLDMContract(MethodContractTests):
    """The common contract on ``dp-ldm/smoke`` (latent space, attention blocks and label embedder trained)."""

    method = "dp-ldm"


class TestDPLDMSDContract(MethodContractTests):
    """The common contract on ``dp-ldm-sd/smoke`` (pixel space, K = 2 noise draws per example)."""

    method = "dp-ldm-sd"


class TestDPLoRAContract(MethodContractTests):
    """The common contract on ``dp-lora/smoke`` (rank-2 adapters, K = 2 replicas averaged before clipping), and
    what a LoRA run releases. In the class, the run shares the contract's pre-training cache (one per test
    process): the public models are trained once for the contract's runs and this one."""

    method = "dp-lora"

    def test_a_lora_run_trains_only_the_adapters_and_releases_a_plain_unet_that_moved_from_the_public_model(
        self, tmp_path
    ):
        run = run_config("dp-lora/smoke", SHRINK, out=tmp_path / "run", echo=False)
        log = (run / "log.txt").read_text()
        assert "fine-tuning lora:" in log and "backbone" in log
        released, spec = diffusion_model_from_state(_checkpoints(run).load(phase=RELEASED_PHASE))
        assert not any(".down." in name or ".base." in name for name in released.state_dict())  # adapters folded in
        public = _pretrained_unet(log)
        moved = {
            name
            for name, value in released.state_dict().items()
            if name in public and value.shape == public[name].shape and not torch.equal(value, public[name])
        }
        # the attention projections moved (adapters folded in); no residual-block convolution did
        assert any(".qkv." in name or ".proj." in name for name in moved)
        assert not any(".blocks." in name and "conv" in name for name in moved)


@pytest.mark.parametrize(
    "preset, trainable, space",
    [
        ("dp-ldm/smoke", "attention", "latent"),
        ("dp-ldm-sd/smoke", "attention", "pixel"),
        ("dp-lora/smoke", "lora", "latent"),
    ],
)
def test_presets_declare_their_trainable_set_and_space(preset, trainable, space):
    section = load_config(preset).section
    assert (section.trainable, getattr(section, "space", "pixel")) == (trainable, space)


def _checkpoints(run):
    from dpsynth.checkpoint import CheckpointManager

    return CheckpointManager(run / "checkpoints")


def _pretrained_unet(log: str):
    """The EMA weights of the public UNet the run fine-tuned: the cache entry its log names."""
    (key,) = re.findall(r"pre-trained model ([0-9a-f]+) ", log)
    path = Path(os.environ["DPSYNTH_CACHE"]) / "pretrained" / "diffusion" / f"{key}.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    return state.get("ema") or state["model"]


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        ("dp-ldm/smoke", {"dp-ldm.pretrain.enabled": False}, "needs pretrain.enabled"),
        ("dp-ldm-sd/smoke", {"data.public": None}, "set data.public"),
        ("dp-lora/smoke", {"dp-lora.lora_rank": 0}, "lora_rank"),
        ("dp-ldm/smoke", {"dp-ldm.trainable": "bias"}, "trainable"),
        ("dp-lora/smoke", {"dp-lora.flip": True}, "flip must be false"),
    ],
)
def test_bad_fine_tuning_config_fails_at_load(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(preset, overrides)
