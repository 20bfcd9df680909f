"""Engine support for fine-tuning methods: trainable-parameter selectors, LoRA adapters on the attention
projections (per-example gradients on token tensors), and noise multiplicity as one per-example unit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
from dpsynth.diffusion.schedules import build_schedule, build_timestep_sampler
from dpsynth.dpsgd import PerExampleGradients
from dpsynth.dpsgd.per_example import clipped_grad_sum
from dpsynth.errors import ConfigError
from dpsynth.models.fine_tuning import LoRAAdapter, add_lora_adapters, merge_lora_adapters, select_trainable
from dpsynth.models.unet import AttentionBlock, build_unet
from tests.dpsgd.test_taps import engine_update

TINY = {"base_channels": 8, "channel_mult": (1, 2), "attention_levels": (0, 1), "num_head_channels": 8}


def _unet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    unet = build_unet(TINY, 8, 2, 3)
    with torch.no_grad():  # the zero-initialised output layers would hide every gradient upstream
        for parameter in unet.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return unet


def _diffusion_batch(examples: int = 3, copies: int = 2, seed: int = 1) -> tuple[dict, object]:
    g = torch.Generator().manual_seed(seed)
    batch = make_multiplicity_batch(
        torch.rand(examples, 2, 8, 8, generator=g) * 2 - 1,
        torch.randint(0, 3, (examples,), generator=g),
        copies,
        build_timestep_sampler(None, 50),
        g,
    )
    return batch, make_loss_fn(build_schedule("linear", 50), "simple")


def _trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_attention_selector_trains_the_attention_blocks_and_the_label_embedder_only():
    unet = _unet()
    count = select_trainable(unet, "attention")
    names = _trainable_names(unet)
    assert names and all("attention" in name or name.startswith("class_embedding") for name in names)
    assert "class_embedding.weight" in names and any(name.startswith("mid_attention.qkv") for name in names)
    assert (
        count
        == sum(p.numel() for p in unet.parameters() if p.requires_grad)
        < sum(p.numel() for p in unet.parameters())
    )
    assert select_trainable(unet, "all") == sum(p.numel() for p in unet.parameters())


def test_lora_adapters_start_as_the_base_model_merge_exactly_and_are_all_that_trains():
    unet = _unet()
    batch, _ = _diffusion_batch()
    x, t, y = batch["x0"][:, 0], batch["t"][:, 0], batch["label"][:, 0]
    before = unet(x, t, y)
    adapted = add_lora_adapters(unet, rank=2, alpha=4.0)
    blocks = [m for m in unet.modules() if isinstance(m, AttentionBlock)]
    assert len(adapted) == 2 * len(blocks) > 2  # qkv and proj of every attention block, the middle one included
    torch.testing.assert_close(unet(x, t, y), before)  # up = 0: the adapted model is the pre-trained one
    select_trainable(unet, "lora")
    names = _trainable_names(unet)
    assert names == {n for n in names if ".down." in n or ".up." in n or n.startswith("class_embedding")}
    assert all(not p.requires_grad for m in unet.modules() if isinstance(m, LoRAAdapter) for p in m.base.parameters())
    with torch.no_grad():
        for module in unet.modules():
            if isinstance(module, LoRAAdapter):
                module.up.weight.normal_()
    adapted_output = unet(x, t, y)
    assert not torch.allclose(adapted_output, before)
    merge_lora_adapters(unet)
    assert not any(isinstance(m, LoRAAdapter) for m in unet.modules())
    torch.testing.assert_close(unet(x, t, y), adapted_output, atol=1e-5, rtol=1e-4)
    assert set(build_unet(TINY, 8, 2, 3).state_dict()) == set(unet.state_dict())  # a plain UNet again


def test_lora_adapts_linear_projections_on_token_tensors_and_refuses_other_layers():
    torch.manual_seed(0)
    base = nn.Linear(6, 4)
    adapter = LoRAAdapter(base, rank=2, alpha=2.0)
    tokens = torch.randn(3, 5, 6)  # [B, tokens, dim]
    with torch.no_grad():
        adapter.up.weight.normal_()
    torch.testing.assert_close(adapter.merged()(tokens), adapter(tokens), atol=1e-6, rtol=1e-5)
    with pytest.raises(TypeError, match="Linear and 1x1 Conv1d"):
        LoRAAdapter(nn.Conv2d(2, 2, 3), rank=1, alpha=1.0)


def test_selectors_refuse_what_they_cannot_select():
    no_attention = build_unet(dict(TINY, attention_levels=()), 8, 2, 3)
    del no_attention.mid_attention  # a UNet without any attention block
    no_attention.mid_attention = nn.Identity()
    with pytest.raises(ConfigError, match="attention"):
        add_lora_adapters(no_attention, rank=2, alpha=2.0)
    with pytest.raises(ConfigError, match="adapters"):
        select_trainable(_unet(), "lora")
    with pytest.raises(ConfigError, match="unknown trainable selector"):
        select_trainable(_unet(), "bias")


@pytest.mark.parametrize("selector", ["attention", "lora"])
def test_every_strategy_gives_the_exact_update_of_the_selected_parameters(selector):
    unet = _unet(seed=3)
    if selector == "lora":
        add_lora_adapters(unet, rank=2, alpha=2.0)
        with torch.no_grad():
            for module in unet.modules():
                if isinstance(module, LoRAAdapter):
                    module.up.weight.normal_(std=0.1)
    select_trainable(unet, selector)
    batch, loss = _diffusion_batch(examples=4, copies=2)
    tapped = {name for tap in PerExampleGradients(unet, loss).taps(batch) for name in tap.params.values()}
    assert tapped == _trainable_names(unet)  # every adapter and attention projection has a layer tap
    want = engine_update(unet, loss, batch, "exact", 4)
    frozen = torch.cat([p.detach().flatten() * 0 + (not p.requires_grad) for p in unet.parameters()]).bool()
    assert torch.count_nonzero(want[frozen]) == 0  # frozen parameters never move
    for strategy, physical in (("auto", 3), ("ghost", 4), ("instantiate", 1)):
        assert torch.allclose(engine_update(unet, loss, batch, strategy, physical), want, atol=1e-6), strategy


class _Identity(nn.Module):
    """``w . x``: the gradient of the loss below for a row is the row itself, whatever ``w`` is."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)


def _replica_loss(model_call, example):
    return model_call(example["x"]).mean()  # the mean over the K replicas of one example


@pytest.mark.parametrize("strategy", ["auto", "ghost", "instantiate", "exact"])
def test_noise_replicas_of_one_example_are_averaged_before_one_clip(strategy):
    """Sensitivity C per example, not K C: with K = 4 replicas whose gradients point in four orthogonal
    directions of norm 10, one example's clipped contribution is clip_C(mean) (norm C = 1). Clipping the
    replicas separately (DP-LoRA's defect: each replica a row of its own) would give norm 2 C."""
    copies, clip = 4, 1.0
    rows = 10.0 * torch.eye(copies)  # replica j's gradient is 10 e_j
    model = _Identity(copies)
    per_example = PerExampleGradients(model, _replica_loss, strategy=strategy)
    total, count = clipped_grad_sum(per_example, [{"x": rows.unsqueeze(0)}], clip)
    released = total["w.weight"].flatten()
    assert count == 1
    torch.testing.assert_close(released, torch.full((copies,), 0.5))  # clip_1(mean of 10 e_j) = 0.5 * (1,1,1,1)
    assert released.norm() == pytest.approx(clip)
    separately = sum(F.normalize(row, dim=0) * clip for row in rows)
    assert separately.norm() == pytest.approx(2 * clip)  # what per-replica clipping would have released
