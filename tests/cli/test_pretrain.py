"""``dpsynth pretrain CONFIG``: builds the public backbone into the cache, reuses it, refuses bad input in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_one_line_error, run_cli_in_process

from dpsynth.cli import main

TINY_BACKBONE = {
    "autoencoder": {"base_channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1},
    "steps": 3,
    "batch_size": 8,
}


def _images(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 8, 8, 1), dtype=np.uint8)


@pytest.fixture
def config(tmp_path, monkeypatch):
    """A run config whose private and public sets are two tiny, disjoint .npz files."""
    monkeypatch.setenv("DPSYNTH_CACHE", str(tmp_path / "cache"))
    private, public = _images(60, seed=0), _images(40, seed=1)
    np.savez(tmp_path / "private.npz", images=private, labels=np.arange(60) % 2, class_names=np.array(["a", "b"]))
    np.savez(tmp_path / "public.npz", images=public, labels=np.arange(40) % 2, class_names=np.array(["a", "b"]))
    path = tmp_path / "run.yaml"
    settings = {
        "method": "dpdm",
        "data": {"private": str(tmp_path / "private.npz"), "public": str(tmp_path / "public.npz"), "val_size": 0.1},
        "backbone": TINY_BACKBONE,
        "dpdm": {"space": "latent"},  # DPDM trains from scratch: in latent space its one public model is the backbone
    }
    path.write_text(json.dumps(settings))  # JSON is YAML
    return path


def _switch_to_tiny_fine_tuning(config, method: str, model: str, attention_levels: list[int]) -> None:
    """Make ``config`` a run of ``method`` (a public-pre-trained diffusion method) with a tiny UNet and 2 steps."""
    settings = json.loads(config.read_text())
    del settings["dpdm"]
    settings["method"] = method
    settings[method] = {
        "model": model,
        "unet": {"base_channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_levels": attention_levels},
        "pretrain": {"steps": 2, "batch_size": 8, "warmup_steps": 0},
    }
    config.write_text(json.dumps(settings))


def test_pretrain_builds_once_prints_the_cache_path_and_reuses_it(config, tmp_path, capsys):
    assert main(["pretrain", str(config)]) == 0
    out, err = capsys.readouterr()
    path = out.strip()
    assert path.startswith(str(tmp_path / "cache" / "pretrained" / "autoencoder")) and path.endswith(".pt")
    assert "built" in err and "backbone" in err  # the progress bar and the log line go to stderr
    assert main(["pretrain", str(config), "--json"]) == 0
    [model] = json.loads(capsys.readouterr().out)["models"]
    assert model["cached"] and model["path"] == path
    assert model["image_shape"] == [1, 8, 8] and model["latent_shape"] == [4, 4, 4]
    assert main(["pretrain", str(config), "--set", "backbone.steps=4", "--json"]) == 0
    [changed] = json.loads(capsys.readouterr().out)["models"]
    assert not changed["cached"] and changed["path"] != path


def test_a_pdp_diffusion_config_gets_its_diffusion_model_and_in_latent_space_the_backbone_too(config, capsys):
    _switch_to_tiny_fine_tuning(config, "pdp-diffusion", model="0.8m", attention_levels=[])
    assert main(["pretrain", str(config), "--json"]) == 0
    [pixel] = json.loads(capsys.readouterr().out)["models"]
    assert pixel["kind"] == "diffusion" and pixel["image_shape"] == [1, 8, 8] and not pixel["cached"]
    latent = ["--set", "pdp-diffusion.space=latent", "--json"]
    assert main(["pretrain", str(config), *latent]) == 0
    backbone, diffusion = json.loads(capsys.readouterr().out)["models"]
    assert backbone["kind"] == "autoencoder" and diffusion["image_shape"] == backbone["latent_shape"] == [4, 4, 4]
    assert main(["pretrain", str(config), *latent]) == 0
    assert all(model["cached"] for model in json.loads(capsys.readouterr().out)["models"])


def test_the_backbone_public_set_must_not_hold_a_private_record(config, tmp_path, capsys):
    with np.load(tmp_path / "private.npz") as private:
        leaked = np.concatenate([_images(40, seed=1), private["images"][:1]])
    np.savez(tmp_path / "public.npz", images=leaked, labels=np.arange(41) % 2, class_names=np.array(["a", "b"]))
    assert main(["pretrain", str(config)]) == 1
    err = capsys.readouterr().err
    assert "error: private images also appear in the public set" in err and " 1 " not in err
    assert not (tmp_path / "cache" / "pretrained").exists()  # refused before any training


def test_bad_input_is_one_line_naming_the_key_before_any_data_is_read(config, tmp_path, capsys):
    result = run_cli_in_process("pretrain", str(config), "--set", "backbone.stepz=3", cwd=tmp_path)
    assert_one_line_error(result, "backbone.stepz")
    channel_mult = ["--set", "backbone.autoencoder.channel_mult=[1,2,2,2]"]
    for args, fragments in (
        (["dpdm/smoke", "--set", "dpdm.space=latent", *channel_mult], ("backbone.autoencoder.channel_mult", "28x28")),
        ([str(config), "--set", "data.public=null"], ("data.public",)),
        ([str(config), "--set", "data.image_size=30", *channel_mult], ("backbone.autoencoder.channel_mult", "30x30")),
    ):
        assert main(["pretrain", *args]) == 1
        errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("error: ") and all(f in errors[0] for f in fragments)
    assert not (tmp_path / "cache").exists()


def test_a_pixel_space_fine_tuning_without_a_space_key_gets_its_diffusion_model_and_no_backbone(config, capsys):
    """DP-LDM (SD) declares no ``space``: it fine-tunes PDP-Diffusion's pixel model, so no backbone is built."""
    _switch_to_tiny_fine_tuning(config, "dp-ldm-sd", model="0.3m", attention_levels=[1])  # attention: what it trains
    assert main(["pretrain", str(config), "--json"]) == 0
    [pixel] = json.loads(capsys.readouterr().out)["models"]
    assert pixel["kind"] == "diffusion" and pixel["image_shape"] == [1, 8, 8] and not pixel["cached"]


def test_a_method_that_reads_no_backbone_gets_none(config, capsys):
    """A kernel method without a ``space`` key works on pixels: its run declares no backbone phase, so none is built
    (it used to get one it never read)."""
    settings = json.loads(config.read_text())
    del settings["dpdm"]
    config.write_text(json.dumps({**settings, "method": "dp-merf"}))
    assert main(["pretrain", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"] == []
