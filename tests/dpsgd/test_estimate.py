"""The dry run's private-training estimate (dpsynth.dpsgd.estimate): closed forms on tiny networks, the method
hook on every built-in method, and what `dpsynth run --dry-run` prints."""

import dataclasses
import json

import pydantic
import pytest
import torch
from torch import nn

from dpsynth.cli import main
from dpsynth.config import load_config
from dpsynth.contract import Method, PrivateNetwork
from dpsynth.data.section import DataSection
from dpsynth.dpsgd.estimate import (
    FLOAT_BYTES,
    GPU_CLASSES,
    estimate_network,
    estimate_run,
    estimate_training,
    planned_image_geometry,
    profile_network,
    state_bytes,
)
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import PrivateTraining
from dpsynth.errors import ConfigError
from dpsynth.methods import METHODS


def mlp_network(
    width_in=6, hidden=5, out=3, rows=1, physical=4, batch=10, steps=7, optimizer="adam", ema=None, strategy="auto"
):
    training = PrivateTraining(
        batch_size=batch,
        lr=0.1,
        steps=steps,
        optimizer=optimizer,
        momentum=0.0,
        physical_batch_size=physical,
        ema_decay=ema,
        strategy=strategy,
    )
    return PrivateNetwork(
        key="toy",
        build=lambda: nn.Sequential(nn.Linear(width_in, hidden), nn.ReLU(), nn.Linear(hidden, out)),
        inputs=lambda count: (torch.zeros(count, width_in),),
        training=training,
        rows_per_example=rows,
    )


def test_parameters_and_flops_follow_the_layer_shapes():
    profile = profile_network(mlp_network())
    assert profile.parameters == (6 * 5 + 5) + (5 * 3 + 3)
    # forward 2*in*out per Linear; backward: the weight gradients of both and the input gradient of the second
    # (the network's input needs no gradient): 2*in*out each
    forward = 2 * (6 * 5 + 5 * 3)
    backward = 2 * (6 * 5) + 2 * (5 * 3) * 2
    assert profile.flops_per_row == forward + backward


def test_saved_activations_count_the_layer_inputs_not_the_weights():
    profile = profile_network(mlp_network())
    # Linear 1 saves its input (6 floats) for its weight gradient; ReLU its output and Linear 2 its input, the same
    # 5-float tensor, counted once; the weights (and their transposes) are saved by reference and not counted.
    assert profile.activation_bytes_per_row == (6 + 5) * FLOAT_BYTES


def test_state_counts_weights_gradient_optimizer_and_ema():
    adam = PrivateTraining(batch_size=8, lr=1.0, steps=1, optimizer="adam", ema_decay=0.99)
    sgd = PrivateTraining(batch_size=8, lr=1.0, steps=1, optimizer="sgd", momentum=0.0)
    momentum = PrivateTraining(batch_size=8, lr=1.0, steps=1, optimizer="sgd", momentum=0.9)
    assert state_bytes(100, adam) == 100 * FLOAT_BYTES * 5
    assert state_bytes(100, sgd) == 100 * FLOAT_BYTES * 2
    assert state_bytes(100, momentum) == 100 * FLOAT_BYTES * 3


def test_peak_grows_by_one_example_per_physical_slot_and_time_by_steps():
    small, large = estimate_network(mlp_network(physical=2), 100), estimate_network(mlp_network(physical=5), 100)
    # plus one block of the ghost norms' float64 copies: at most GRAM_BLOCK_BYTES, and on this tiny MLP the
    # whole micro-batch's Grams
    grams = profile_network(mlp_network()).ghost_gram_bytes_per_example
    assert grams > 0
    assert large.peak_bytes - small.peak_bytes == 3 * small.activation_bytes_per_example + 3 * grams
    assert small.peak_bytes == small.state_bytes + 2 * small.activation_bytes_per_example + 2 * grams
    assert (small.micro_batches, large.micro_batches) == (5, 2)
    longer = estimate_network(mlp_network(steps=70), 100)
    for gpu in GPU_CLASSES:
        assert longer.gpu_hours[gpu] == pytest.approx(10 * estimate_network(mlp_network(), 100).gpu_hours[gpu])


def test_multiplicity_multiplies_flops_and_activations():
    one, four = estimate_network(mlp_network(rows=1), 100), estimate_network(mlp_network(rows=4), 100)
    assert four.flops_per_step == 4 * one.flops_per_step
    assert four.activation_bytes_per_example > 3 * one.activation_bytes_per_example


def test_epochs_give_the_plans_steps():
    network = mlp_network()
    epochs = PrivateNetwork(
        key="toy",
        build=network.build,
        inputs=network.inputs,
        training=PrivateTraining(batch_size=10, lr=0.1, epochs=2.0),
    )
    assert estimate_network(epochs, 95).steps == 19  # ceil(2 * 95 / 10), as the privacy plan counts them


def test_geometry_comes_from_the_registry_and_the_data_keys():
    assert planned_image_geometry(DataSection(private="mnist")) == ((1, 28, 28), 10)
    assert planned_image_geometry(DataSection(private="cifar10", image_size=16, channels=1)) == ((1, 16, 16), 10)
    declared = DataSection(private="/no/such/images", image_size=8, channels=3, num_classes=4)
    assert planned_image_geometry(declared) == ((3, 8, 8), 4)
    with pytest.raises(ConfigError, match="data.image_size, data.channels and data.num_classes"):
        planned_image_geometry(DataSection(private="/no/such/images"))


def smoke_config(method: str):
    return load_config(f"{method}/smoke")


# the package's methods: tests register toy methods (tests/fake_methods.py) that ship no smoke preset, and whether
# they are in METHODS at collection depends on which test module was collected first
PACKAGED = sorted(name for name, cls in METHODS.items() if cls.__module__.startswith("dpsynth."))


@pytest.mark.parametrize("method", PACKAGED)
def test_every_method_declares_the_networks_it_trains_with_dpsgd(method):
    config = smoke_config(method)
    estimate = estimate_run(METHODS[method](), config, 500)
    assert estimate.undeclared == ()
    # None: the method trains no network with DP-SGD (one release, or non-private critics): nothing to size
    declared_networks = METHODS[method]().private_networks(config) or []
    assert len(estimate.networks) == len(declared_networks)
    for network, declared in zip(estimate.networks, declared_networks):
        built = declared.build()
        assert network.parameters == sum(p.numel() for p in built.parameters() if p.requires_grad)
        assert network.peak_bytes > network.state_bytes > 0
        assert all(hours > 0 for hours in network.gpu_hours.values())


class _Section(DPSGDSection):
    width: int = pydantic.Field(4, description="a setting")


class _Undeclared(Method):
    name = "undeclared-toy"
    config_schema = _Section

    def plan(self, config, num_examples):
        raise NotImplementedError

    def fit(self, ctx):
        raise NotImplementedError

    def generate(self, ctx, num):
        raise NotImplementedError


def test_a_method_that_declares_nothing_has_its_dpsgd_sections_listed():
    class Config:
        method = "undeclared-toy"
        section = _Section()
        device = "cpu"
        privacy = type("Privacy", (), {"secure_rng": False})()

    estimate = estimate_run(_Undeclared(), Config(), 100)
    assert estimate.networks == () and estimate.undeclared == ("undeclared-toy",)
    assert "declares no network" in estimate.text()


def test_dry_run_prints_the_estimate_and_json_carries_it(capsys):
    assert main(["run", "dpdm/smoke", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "ESTIMATES, not measurements" in text
    for label in ("parameters", "activation memory per example", "peak memory per device", "estimated DP training"):
        assert label in text
    assert main(["run", "dpdm/smoke", "--dry-run", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (network,) = result["estimate"]["networks"]
    assert network["key"] == "dpdm" and network["steps"] == result["plan"]["mechanisms"][0]["steps"]
    assert set(network["gpu_hours"]) == set(GPU_CLASSES)


def test_dry_run_of_a_path_dataset_says_why_there_is_no_estimate(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"method: dpsgd-classifier\ndata:\n  private: {tmp_path / 'images.npz'}\n")
    (tmp_path / "images.npz").write_bytes(b"")  # exists: only its size is needed, and --num-examples gives it
    assert main(["run", str(config), "--dry-run", "--num-examples", "1000", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)["estimate"]
    assert "data.image_size, data.channels and data.num_classes" in estimate["unavailable"]


class _Table(nn.Module):
    """A layer whose parameter shape does not show in its repr (a bare nn.Parameter, as RefineNet's tables)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.table = nn.Parameter(torch.zeros(rows, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.table.sum(0)


def test_networks_alike_in_repr_but_not_in_parameter_shapes_get_their_own_profiles():
    def network(rows: int) -> PrivateNetwork:
        return PrivateNetwork(
            key="toy",
            build=lambda: _Table(rows),
            inputs=lambda n: (torch.zeros(n, 3),),
            training=PrivateTraining(batch_size=4, lr=0.1, steps=1),
        )

    small, large = profile_network(network(2)), profile_network(network(50))
    assert repr(_Table(2)) == repr(_Table(50))
    assert (small.parameters, large.parameters) == (12 + 6, 12 + 150)


@pytest.mark.parametrize(
    ("device", "graph", "secure", "expected"),
    [
        ("cpu", "auto", False, "eager step"),
        ("cpu", True, False, "fixed-shape step, uncaptured"),
        ("cuda", "auto", False, "fixed-shape step, captured as one CUDA graph"),
        ("cuda", "auto", True, "graph: privacy.secure_rng draws the noise on the host"),
        ("cuda", False, False, "eager step"),
    ],
)
def test_the_dry_run_says_at_plan_time_how_each_step_runs(device, graph, secure, expected):
    training = dataclasses.replace(mlp_network().training, graph=graph)
    network = dataclasses.replace(mlp_network(), training=training)
    estimate = estimate_training([network], 100, device=device, secure_rng=secure)
    assert estimate.networks[0].step.startswith(expected)
    assert f"step: {estimate.networks[0].step}" in estimate.text()
