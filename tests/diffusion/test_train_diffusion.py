"""train_diffusion, the non-private diffusion loop: augmentation hook, and a resume that equals an unbroken run."""

from __future__ import annotations

import torch

from dpsynth.diffusion.generation import DiffusionModelSpec, build_diffusion_model
from dpsynth.diffusion.pretrain import PretrainSettings, Snapshots, train_diffusion

SPEC = DiffusionModelSpec(
    model={
        "preset": "0.8m",
        "base_channels": 8,
        "channel_mult": [1, 2],
        "num_res_blocks": 1,
        "attention_levels": [],
        "num_head_channels": 8,
    },
    image_size=8,
    channels=1,
    num_classes=3,
    timesteps=50,
)
SETTINGS = PretrainSettings(steps=4, batch_size=4, lr=1e-3, ema_decay=0.5, label_dropout=0.0, checkpoint_every=2)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(6, 1, 8, 8, generator=generator) * 2 - 1, torch.arange(6) % 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_diffusion_model(SPEC)


def test_a_resumed_run_ends_where_an_unbroken_one_does():
    images, labels = _data()
    unbroken = train_diffusion(_model(), images, labels, SPEC, SETTINGS, torch.Generator().manual_seed(1), log=print)

    store: dict[str, dict] = {}

    class Died(Exception):
        pass

    def save_then_die(state: dict) -> None:
        store["state"] = state
        raise Died

    try:
        train_diffusion(
            _model(),
            images,
            labels,
            SPEC,
            SETTINGS,
            torch.Generator().manual_seed(1),
            log=print,
            snapshots=Snapshots(save=save_then_die, load=lambda: None),
        )
    except Died:
        pass
    assert store["state"]["step"] == 2
    resumed = train_diffusion(
        _model(),
        images,
        labels,
        SPEC,
        SETTINGS,
        torch.Generator().manual_seed(99),  # the snapshot's generator state replaces it
        log=print,
        snapshots=Snapshots(save=lambda state: None, load=lambda: store["state"]),
    )
    for (name, a), (_, b) in zip(unbroken.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_the_augmentation_sees_every_batch_in_the_model_range():
    images, labels = _data()
    seen: list[torch.Tensor] = []

    def augment(x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        seen.append(x0.clone())
        return -x0

    train_diffusion(
        _model(), images, labels, SPEC, SETTINGS, torch.Generator().manual_seed(1), log=print, augment=augment
    )
    assert len(seen) == SETTINGS.steps and all(batch.shape == (4, 1, 8, 8) for batch in seen)
    assert all(float(batch.min()) >= -1.0 and float(batch.max()) <= 1.0 for batch in seen)
