"""Per-layer taps give the per-example gradients of the exact path, layer type by layer type, on random
configurations (a seeded loop: stride, padding, dilation, groups, bias, padding modes, K copies), and the
clipped, noised update of the models the methods train (UNet, CNN, RefineNet) equals the exact path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_strategies import update
from torch import nn

from dpsynth.dpsgd import PerExampleGradients


def pick(g: torch.Generator, *options):
    return options[int(torch.randint(len(options), (1,), generator=g))]


def assert_same_per_example_grads(model: nn.Module, loss, batch: dict, strategies=("auto", "ghost", "instantiate")):
    want, want_losses = PerExampleGradients(model, loss, strategy="exact")(batch)
    for strategy in strategies:
        got, losses = PerExampleGradients(model, loss, strategy=strategy)(batch)
        assert torch.allclose(losses, want_losses, atol=1e-5), strategy
        for name, grad in want.items():
            assert torch.allclose(got[name], grad, atol=1e-5, rtol=1e-3), (strategy, name)


def mse_loss(model_call, example):
    out = model_call(example["x"])
    return F.mse_loss(out, example["target"].expand_as(out))


class ConvNet(nn.Module):
    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x)).pow(2)


def random_conv(g: torch.Generator) -> tuple[nn.Module, tuple[int, ...]]:
    """A Conv1d/Conv2d with random geometry and the per-example input shape (with or without K)."""
    two_d = bool(pick(g, 0, 1))
    groups = pick(g, 1, 1, 2)
    in_channels, out_channels = groups * pick(g, 1, 2, 3), groups * pick(g, 1, 2)
    kernel, dilation = pick(g, 1, 2, 3), pick(g, 1, 2)
    stride = pick(g, 1, 2) if kernel > 1 else 1
    padding = pick(g, 0, 1, 2, "valid", "same" if kernel % 2 and stride == 1 else 1)
    padding_mode = pick(g, "zeros", "zeros", "reflect", "circular") if isinstance(padding, int) and padding else "zeros"
    layer = nn.Conv2d if two_d else nn.Conv1d
    conv = layer(
        in_channels,
        out_channels,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=bool(pick(g, 0, 1)),
        padding_mode=padding_mode,
    )
    size = pick(g, 7, 9)
    spatial = (size, size) if two_d else (size,)
    copies = pick(g, (), (1,), (3,))
    return conv, (*copies, in_channels, *spatial)


@pytest.mark.parametrize("seed", range(12))
def test_convolutions_of_random_geometry_match_the_exact_path(seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    conv, shape = random_conv(g)
    model = ConvNet(conv)
    batch = {"x": torch.randn(3, *shape, generator=g), "target": torch.randn(3, 1, generator=g)}
    assert [tap.module_name for tap in PerExampleGradients(model, mse_loss).taps(batch)] == ["conv"]
    assert_same_per_example_grads(model, mse_loss, batch)


def test_asymmetric_same_padding_is_left_to_the_fallback_and_still_exact():
    torch.manual_seed(0)
    model = ConvNet(nn.Conv2d(2, 3, 4, padding="same"))  # even kernel: torch pads unevenly
    batch = {"x": torch.randn(3, 2, 6, 6), "target": torch.randn(3, 1)}
    assert PerExampleGradients(model, mse_loss).taps(batch) == []
    assert_same_per_example_grads(model, mse_loss, batch, strategies=("auto",))


class NormNet(nn.Module):
    """GroupNorm on maps, LayerNorm on rows, each with or without an affine bias."""

    def __init__(self, channels: int, groups: int, bias: bool) -> None:
        super().__init__()
        self.group = nn.GroupNorm(groups, channels)
        self.layer = nn.LayerNorm(channels, bias=bias)
        self.mix = nn.Linear(channels, channels, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(self.group(x))  # [K, C, H, W]
        return self.layer(self.mix(h.flatten(2).transpose(1, 2))).pow(2)


@pytest.mark.parametrize("seed", range(4))
def test_normalisation_layers_and_linear_rows_match_the_exact_path(seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    groups = pick(g, 1, 2)
    model = NormNet(groups * pick(g, 2, 3), groups, bool(seed % 2))
    for module in (model.group, model.layer):  # away from the identity initialisation
        nn.init.normal_(module.weight)
    batch = {"x": torch.randn(4, pick(g, 1, 2), model.group.num_channels, 3, 3, generator=g)}
    batch["target"] = torch.randn(4, 1, generator=g)
    assert {tap.module_name for tap in PerExampleGradients(model, mse_loss).taps(batch)} == {"group", "layer", "mix"}
    assert_same_per_example_grads(model, mse_loss, batch)


class EmbedNet(nn.Module):
    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5, padding_idx=padding_idx)
        self.head = nn.Linear(5, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens))).squeeze(-1)  # [K, T]


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embeddings_with_repeated_indices_match_the_exact_path(padding_idx):
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    model = EmbedNet(padding_idx)
    batch = {"x": torch.randint(0, 7, (5, 2, 6), generator=g), "target": torch.randn(5, 1, generator=g)}
    assert_same_per_example_grads(model, mse_loss, batch)
    ghost = PerExampleGradients(model, mse_loss, strategy="ghost").compute(batch)
    assert "embed.weight" in ghost.factored


class TiedNet(nn.Module):
    """An embedding whose table is also the output projection, and a Linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.twice = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.twice(torch.tanh(self.twice(self.embed(tokens))))
        return F.linear(self.head(h), self.embed.weight)  # reads embed.weight a second time


def test_tied_and_repeated_layers_are_not_tapped_and_still_exact():
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    model = TiedNet()
    batch = {"x": torch.randint(0, 6, (4, 3), generator=g), "target": torch.randn(4, 1, generator=g)}
    assert [tap.module_name for tap in PerExampleGradients(model, mse_loss).taps(batch)] == ["head"]
    assert_same_per_example_grads(model, mse_loss, batch)


def test_a_layer_whose_output_does_not_reach_the_loss_gets_zero_gradients():
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.ignored = nn.Linear(3, 1), nn.Linear(3, 2)

        def forward(self, x):
            self.ignored(x).detach()
            return self.used(x)

    model = Unused()
    batch = {"x": torch.randn(3, 3), "target": torch.randn(3, 1)}
    grads, _ = PerExampleGradients(model, mse_loss)(batch)
    assert grads["ignored.weight"].shape == (3, 2, 3) and not grads["ignored.weight"].any()
    assert grads["used.weight"].abs().sum() > 0


def test_a_tapped_layer_whose_input_is_the_same_for_every_example_still_gets_per_example_gradients():
    # The embedding's input is a constant, so vmap does not batch its output (and the GroupNorm sees an
    # unbatched input): the taps expand it to one row per example, so each example gets its own G.
    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm, self.head = nn.Embedding(4, 6), nn.GroupNorm(2, 6), nn.Linear(6, 1)

        def forward(self, x):
            shared = self.norm(self.embed(torch.arange(3)).t().unsqueeze(0))  # [1, 6, 3], the same for all
            return self.head(x * shared.mean(-1))

    g = torch.Generator().manual_seed(3)
    model = Constant()
    batch = {"x": torch.randn(4, 6, generator=g), "target": torch.randn(4, 1, generator=g)}
    assert {tap.module_name for tap in PerExampleGradients(model, mse_loss).taps(batch)} == {"embed", "norm", "head"}
    assert_same_per_example_grads(model, mse_loss, batch)


def test_a_loss_that_vmaps_the_model_itself_is_told_to_use_the_exact_strategy():
    def inner_vmap_loss(model_call, example):
        out = torch.vmap(lambda row: model_call(row[None])[0])(example["x"])
        return F.mse_loss(out, example["target"].expand_as(out))

    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    batch = {"x": torch.randn(4, 3, 6), "target": torch.randn(4, 1)}
    with pytest.raises(RuntimeError, match="use strategy 'exact'"):
        PerExampleGradients(model, inner_vmap_loss)(batch)
    assert_same_per_example_grads(model, inner_vmap_loss, batch, strategies=("exact",))


def engine_update(model: nn.Module, loss, batch: dict, strategy: str, physical: int) -> torch.Tensor:
    """One engine step's parameter change (the strategies test's), with a clip small enough to bind."""
    return update(model, loss, batch, strategy, physical, clip=0.05)


def test_refinenet_update_with_k_copies_and_virtual_batches_matches_the_exact_path():
    from dpsynth.models.refinenet import build_refinenet

    g = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    sigmas = torch.logspace(0, -2, 4)
    model = build_refinenet("cpu", 1, sigmas, width=4)

    def dsm(model_call, example):  # denoising score matching, sigma^2-weighted, averaged over the K copies
        sigma = sigmas[example["level"]].view(-1, 1, 1, 1)
        return (sigma * model_call(example["x"] + sigma * example["z"], example["level"]) + example["z"]).pow(2).mean()

    batch = {
        "x": torch.rand(3, 2, 1, 8, 8, generator=g),
        "z": torch.randn(3, 2, 1, 8, 8, generator=g),
        "level": torch.randint(0, 4, (3, 2), generator=g),
    }
    taps = PerExampleGradients(model, dsm).taps(batch)
    assert {type(tap.module) for tap in taps} == {nn.Conv2d}  # the CIN++ tables take the fallback
    want = engine_update(model, dsm, batch, "exact", 3)
    for strategy, physical in (("auto", 2), ("ghost", 3), ("instantiate", 1)):
        assert torch.allclose(engine_update(model, dsm, batch, strategy, physical), want, atol=1e-6), strategy


def test_every_unet_and_cnn_parameter_is_tapped():
    from dpsynth.diffusion.losses import make_loss_fn, make_multiplicity_batch
    from dpsynth.diffusion.schedules import build_schedule, build_timestep_sampler
    from dpsynth.models.classifiers import build_classifier
    from dpsynth.models.unet import build_unet

    g = torch.Generator().manual_seed(7)
    unet = build_unet({"base_channels": 8, "channel_mult": (1, 2), "attention_levels": (1,)}, 8, 1, 3)
    batch = make_multiplicity_batch(
        torch.rand(2, 1, 8, 8, generator=g), torch.tensor([0, 2]), 2, build_timestep_sampler(None, 50), g
    )
    loss = make_loss_fn(build_schedule("cosine", 50), "simple")
    tapped = {name for tap in PerExampleGradients(unet, loss).taps(batch) for name in tap.params.values()}
    assert tapped == {name for name, p in unet.named_parameters() if p.requires_grad}

    cnn = build_classifier("cnn", 1, 3, 8)

    def cnn_loss(model_call, example):
        return F.cross_entropy(model_call(example["x"]), example["y"])

    images = {"x": torch.randn(2, 2, 1, 8, 8, generator=g), "y": torch.zeros(2, 2, dtype=torch.long)}
    tapped = {name for tap in PerExampleGradients(cnn, cnn_loss).taps(images) for name in tap.params.values()}
    assert tapped == {name for name, _ in cnn.named_parameters()}


def test_a_model_that_modifies_a_tapped_output_in_place_gets_the_same_gradients():
    torch.manual_seed(9)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(48, 2), nn.ReLU(inplace=True)
    )
    batch = {"x": torch.randn(4, 2, 1, 4, 4), "target": torch.randn(4, 1)}
    assert_same_per_example_grads(model, mse_loss, batch)


@pytest.mark.parametrize(
    "channels,kernel,stride,padding,dilation,copies",
    [(1, 3, 1, 1, 1, 1), (32, 3, 1, 1, 2, 2), (32, 3, 1, 2, 1, 1), (32, 2, 2, 0, 2, 2), (32, 1, 1, 0, 1, 1)],
)
@pytest.mark.parametrize("block_bytes", [None, 1])
def test_conv_ghost_norm_from_the_pixel_gram_equals_the_instantiated_norm(
    channels, kernel, stride, padding, dilation, copies, block_bytes, monkeypatch
):
    """1 channel, a strided or a 1x1 conv take the im2col Gram; 32 channels at stride 1 the pixel Gram. With
    ``GRAM_BLOCK_BYTES`` of 1 every example's Gram is taken alone, and the norms are the same."""
    from dpsynth.dpsgd import taps
    from dpsynth.dpsgd.taps import FactoredConv, _Conv

    if block_bytes is not None:
        monkeypatch.setattr(taps, "GRAM_BLOCK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(channels + kernel + stride)
    conv = nn.Conv2d(channels, 3, kernel, stride=stride, padding=padding, dilation=dilation)
    batch = 3
    a = torch.randn(batch * copies, channels, 12, 11, generator=g)
    out = conv(a)
    factored = FactoredConv(_Conv.of(conv), a, torch.randn(out.shape, generator=g), batch)
    want = factored.materialise().flatten(1).pow(2).sum(1)
    assert torch.allclose(factored.squared, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "stride,dilation,padding", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 3, 0), ((2, 1), (1, 2), (0, 2))]
)
def test_the_pixel_gram_route_gives_the_im2col_gram_for_any_stride_and_dilation(stride, dilation, padding, monkeypatch):
    """The shifted sums of the pixel Gram (columns, then rows) against the Gram of the im2col rows themselves."""
    from dpsynth.dpsgd import taps
    from dpsynth.dpsgd.taps import _Conv

    g = torch.Generator().manual_seed(5)
    conv = nn.Conv2d(4, 3, 3, stride=stride, padding=padding, dilation=dilation)
    a = torch.randn(2 * 3, 4, 11, 9, generator=g, dtype=torch.float64)  # 3 examples of 2 copies
    out_size = conv(a.float()).shape[-2:]
    grams = []
    for cost in (0, 10**18):  # 0: the pixel Gram always looks cheaper; 10^18: never
        monkeypatch.setattr(taps, "pixel_gram_cost", lambda *args, cost=cost: cost)
        grams.append(_Conv.of(conv).block_input_gram(a, 3, out_size))
    assert grams[0].shape == (3, 2 * out_size[0] * out_size[1], 2 * out_size[0] * out_size[1])
    assert torch.allclose(grams[0], grams[1], rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("conv", [nn.Conv2d(5, 3, 1), nn.Conv1d(4, 6, 1, bias=False)], ids=["conv2d", "conv1d"])
@pytest.mark.parametrize("copies", [1, 3])
def test_pointwise_convolutions_take_the_bmm_path_and_match_the_exact_path(conv, copies):
    from dpsynth.dpsgd.taps import _Conv

    assert _Conv.of(conv).pointwise
    torch.manual_seed(copies)
    spatial = (4, 5) if isinstance(conv, nn.Conv2d) else (7,)
    batch = {"x": torch.randn(3, copies, conv.in_channels, *spatial), "target": torch.randn(3, 1)}
    assert_same_per_example_grads(ConvNet(conv), mse_loss, batch, strategies=("auto", "instantiate"))


@pytest.mark.parametrize(
    "conv", [nn.Conv2d(8, 3, 3, padding=1), nn.Conv1d(16, 1, 3, bias=False), nn.Conv2d(9, 10, 3, stride=2)]
)
@pytest.mark.parametrize("copies", [1, 2])
def test_narrow_outputs_padded_to_a_channel_block_match_the_exact_path(conv, copies):
    from dpsynth.dpsgd.taps import OUTPUT_CHANNEL_BLOCK, _Conv

    padded = _Conv.of(conv).padded_outputs
    assert padded > conv.out_channels and padded % OUTPUT_CHANNEL_BLOCK == 0  # the padded route is the one tested
    torch.manual_seed(copies)
    spatial = (6, 7) if isinstance(conv, nn.Conv2d) else (9,)
    batch = {"x": torch.randn(3, copies, conv.in_channels, *spatial), "target": torch.randn(3, 1)}
    assert_same_per_example_grads(ConvNet(conv), mse_loss, batch, strategies=("instantiate",))


def test_a_conv_whose_gradient_outweighs_its_factors_keeps_the_factors_after_taking_the_norm():
    torch.manual_seed(10)
    # 5x5 kernels on 6x6 maps: instantiating is cheaper, and the gradient over 3x the factors' size
    model = ConvNet(nn.Conv2d(32, 32, 5, padding=2))
    batch = {"x": torch.randn(3, 2, 32, 6, 6), "target": torch.randn(3, 1)}
    (tap,) = PerExampleGradients(model, mse_loss).taps(batch)
    assert not tap.ghost
    result = PerExampleGradients(model, mse_loss).compute(batch)
    assert not result.factored["conv.weight"].ghost and "conv.weight" not in result.materialised
    assert_same_per_example_grads(model, mse_loss, batch, strategies=("auto",))
    want = engine_update(model, mse_loss, batch, "exact", 3)
    assert torch.allclose(engine_update(model, mse_loss, batch, "auto", 2), want, atol=1e-6)


def test_cost_model_counts_the_pixel_gram_for_convolutions():
    from dpsynth.dpsgd.taps import choose_ghost

    wide = nn.Conv2d(128, 128, 3, padding=1)  # 14x14: pixel Gram 13.6M < instantiating 28.9M per example
    assert choose_ghost(wide, (1, 128, 14, 14), (1, 128, 14, 14), "auto")
    narrow = nn.Conv2d(32, 32, 3, padding=1)  # 28x28: instantiating (7.2M) is far cheaper than any Gram
    assert not choose_ghost(narrow, (1, 32, 28, 28), (1, 32, 28, 28), "auto")
    assert choose_ghost(narrow, (1, 32, 28, 28), (1, 32, 28, 28), "ghost")
    assert not choose_ghost(wide, (1, 128, 14, 14), (1, 128, 14, 14), "instantiate")


def test_grams_taken_a_block_of_examples_at_a_time_give_the_same_per_example_gradients(monkeypatch):
    """The float64 copies behind the ghost norms are bounded by taking the examples in blocks
    (``GRAM_BLOCK_BYTES``); blocks of one example give the exact path's gradients for convolutions (with K
    copies), linear rows and embeddings, and the same clipped update."""
    from dpsynth.dpsgd import taps

    monkeypatch.setattr(taps, "GRAM_BLOCK_BYTES", 1)
    torch.manual_seed(5)
    model = ConvNet(nn.Conv2d(3, 4, 3, stride=2, padding=1))
    batch = {"x": torch.randn(5, 2, 3, 9, 9), "target": torch.randn(5, 1)}
    assert_same_per_example_grads(model, mse_loss, batch, strategies=("ghost",))
    want = engine_update(model, mse_loss, batch, "exact", 5)
    assert torch.allclose(engine_update(model, mse_loss, batch, "ghost", 2), want, atol=1e-6)
    norm_net = NormNet(4, 2, True)
    norm_batch = {"x": torch.randn(4, 2, 4, 3, 3), "target": torch.randn(4, 1)}
    assert_same_per_example_grads(norm_net, mse_loss, norm_batch, strategies=("ghost",))
    tokens = {"x": torch.randint(0, 7, (5, 2, 6)), "target": torch.randn(5, 1)}
    assert_same_per_example_grads(EmbedNet(None), mse_loss, tokens, strategies=("ghost",))
