"""Per-layer strategies give the same clipped, noised update: ghost norms, instantiated gradients,
plain vmap and the exact per-example loop agree on random shapes, with K > 1 and virtual batches.
The exact path is also correct for a loss that differentiates with respect to its input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsynth.dpsgd import DPSGDEngine, PerExampleGradients
from dpsynth.dpsgd.per_example import STRATEGIES
from dpsynth.dpsgd.taps import linear_form_costs
from dpsynth.errors import ConfigError
from dpsynth.privacy import PrivacyLedger
from dpsynth.privacy.rng import NoiseSource


class Attention(nn.Module):
    """Single-head self-attention over the positions of a feature map (as in the UNet's blocks)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)  # [K, T, C]
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return x + self.out(weights @ v).transpose(1, 2).reshape(x.shape)


class RandomNet(nn.Module):
    """Embedding + conv (small or large map) + GroupNorm + attention + Linear head, random sizes."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()

        def pick(low: int, high: int) -> int:
            return int(torch.randint(low, high + 1, (1,), generator=g))

        self.size, self.channels, self.classes = pick(3, 9), pick(1, 3), pick(2, 5)
        width = 2 * pick(1, 4)
        self.embed = nn.Embedding(self.classes, width)
        self.conv = nn.Conv2d(self.channels, width, pick(1, 3), padding="same" if pick(0, 1) else 1)
        self.norm = nn.GroupNorm(2, width)
        self.down = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.attention = Attention(width)
        self.head = nn.Linear(width, self.classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.conv(x)) + self.embed(y)[:, :, None, None])
        h = self.attention(torch.tanh(self.down(h)))
        return self.head(h.mean((2, 3)))


def class_loss(model_call, example):
    x, y = example["x"], example["y"]  # [K, C, H, W], [K]
    return F.cross_entropy(model_call(x, y), y)


def ledger() -> PrivacyLedger:
    return PrivacyLedger(target_epsilon=50.0, delta=1e-5, accountant="rdp")


def update(
    model: nn.Module, loss, batch: dict, strategy: str, physical: int, per_layer: bool = False, clip: float = 0.3
) -> torch.Tensor:
    """The parameter change of one engine step (SGD, lr 1) with a fixed noise seed."""
    model = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    engine = DPSGDEngine(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        loss,
        ledger(),
        noise_multiplier=0.7,
        max_grad_norm=clip,
        sample_rate=0.1,
        expected_batch_size=6,
        max_physical_batch_size=physical,
        noise=NoiseSource(seed=17),
        per_layer_clipping=per_layer,
        strategy=strategy,
    )
    engine.step(batch)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


@pytest.mark.parametrize("case", range(6))
def test_every_strategy_gives_the_same_update_on_random_shapes(case):
    g = torch.Generator().manual_seed(case)
    torch.manual_seed(case)
    model = RandomNet(g)
    n, k = int(torch.randint(1, 6, (1,), generator=g)), (1, 3)[case % 2]
    batch = {
        "x": torch.randn(n, k, model.channels, model.size, model.size, generator=g),
        "y": torch.randint(0, model.classes, (n, k), generator=g),
    }
    physical, per_layer = (2, n)[case % 3 == 0], case % 4 == 1
    want = update(model, class_loss, batch, "exact", physical=1, per_layer=per_layer)
    for strategy in ("auto", "ghost", "instantiate", "timed"):
        got = update(model, class_loss, batch, strategy, physical, per_layer)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (case, strategy)


def test_ghost_strategy_taps_large_convolutions_that_auto_leaves_to_vmap():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(2 * 12 * 12, 1))
    batch = {"x": torch.randn(3, 1, 1, 12, 12), "y": torch.zeros(3, 1, 1)}

    def loss(model_call, example):
        return F.mse_loss(model_call(example["x"]), example["y"])

    auto = PerExampleGradients(model, loss, strategy="auto").compute(batch)
    ghost = PerExampleGradients(model, loss, strategy="ghost").compute(batch)
    assert "0.weight" not in auto.factored  # 144 positions, 9 -> 2 channels: instantiating is cheaper
    assert ghost.factored["0.weight"].ghost
    for name, want in auto.full().items():
        assert torch.allclose(ghost.full()[name], want, atol=1e-6), name


def test_cost_model_prefers_ghost_norms_for_few_rows_and_instantiation_for_many():
    def prefers_ghost(rows: int, in_features: int, out_features: int) -> bool:
        ghost, instantiated = linear_form_costs(rows, in_features, out_features)
        return ghost <= instantiated

    assert prefers_ghost(rows=4, in_features=2048, out_features=400)  # a classifier head at K = 4
    assert not prefers_ghost(rows=784, in_features=288, out_features=32)  # a 3x3 conv on 28x28
    assert prefers_ghost(rows=49, in_features=576, out_features=64)  # 7x7 map, 64 channels


def test_unknown_strategy_is_a_config_error():
    with pytest.raises(ConfigError, match="strategy"):
        PerExampleGradients(nn.Linear(2, 1), class_loss, strategy="fastest")
    assert set(STRATEGIES) == {"auto", "ghost", "instantiate", "timed", "exact"}


@pytest.mark.parametrize("strategy", ["auto", "ghost", "instantiate"])
def test_unet_and_cnn_updates_match_the_exact_path(strategy):
    from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
    from dpsynth.diffusion.schedules import build_schedule, build_timestep_sampler
    from dpsynth.models.classifiers import build_classifier
    from dpsynth.models.unet import build_unet

    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    unet = build_unet(
        {
            "base_channels": 8,
            "channel_mult": (1, 2),
            "num_res_blocks": 1,
            "attention_levels": (1,),
            "num_head_channels": 8,
        },
        8,
        1,
        3,
    )
    x0 = torch.rand(3, 1, 8, 8, generator=g) * 2 - 1
    batch = make_multiplicity_batch(x0, torch.randint(0, 3, (3,), generator=g), 2, build_timestep_sampler(None, 50), g)
    loss = make_loss_fn(build_schedule("cosine", 50), "simple")
    assert torch.allclose(update(unet, loss, batch, strategy, 2), update(unet, loss, batch, "exact", 3), atol=1e-5)

    cnn = build_classifier("cnn", 1, 3, 8)
    images = {"x": torch.randn(3, 2, 1, 8, 8, generator=g), "y": torch.randint(0, 3, (3, 2), generator=g)}

    def cnn_loss(model_call, example):
        return F.cross_entropy(model_call(example["x"]), example["y"])

    assert torch.allclose(
        update(cnn, cnn_loss, images, strategy, 2), update(cnn, cnn_loss, images, "exact", 3), atol=1e-5
    )


# -- losses that differentiate with respect to their input ----------------------------------------------


class SmallScoreNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Linear(3 * 4 * 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def autograd_input_loss(model_call, example):
    """A toy sliced-score-matching-like loss: the squared input gradient of the model output."""
    x = example["x"].clone().requires_grad_(True)
    energy = model_call(x).sum()
    (score,) = torch.autograd.grad(energy, x, create_graph=True)
    return score.pow(2).sum() + energy


autograd_input_loss.differentiates_input = True


def func_input_loss(model_call, example):
    score = torch.func.grad(lambda x: model_call(x).sum())(example["x"])
    return score.pow(2).sum()


func_input_loss.differentiates_input = True


@pytest.mark.parametrize("loss", [autograd_input_loss, func_input_loss])
def test_input_differentiating_losses_get_exact_per_example_gradients(loss):
    torch.manual_seed(2)
    model = SmallScoreNet()
    batch = {"x": torch.randn(4, 2, 1, 4, 4)}
    per_example = PerExampleGradients(model, loss)  # asks for "auto", gets the exact path
    assert per_example.strategy == "exact"
    got, _ = per_example(batch)
    for i in range(4):
        model.zero_grad()
        loss(model, {"x": batch["x"][i]}).backward()
        for name, p in model.named_parameters():
            want = p.grad if p.grad is not None else torch.zeros_like(p)  # e.g. a bias the score ignores
            assert torch.allclose(got[name][i], want, atol=1e-5), (i, name)
