"""The diffusion batch built from device draws equals the host one (the fixed-shape step's input, docs/privacy.md,
"Per-record randomness"), and schedules and timestep samplers moved to a device read no host table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpsynth.data.resident import ResidentRecords
from dpsynth.diffusion.losses import make_multiplicity_batch, resident_batch_builder
from dpsynth.diffusion.schedules import MixtureOfUniformTimesteps, UniformTimesteps, build_schedule, tensors_on
from dpsynth.privacy.device_draws import DeviceRecordRandomness
from dpsynth.privacy.record_draws import RecordRandomness

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampler", [UniformTimesteps(1000), MixtureOfUniformTimesteps()], ids=["uniform", "mixture"])
def test_a_device_batch_is_the_host_batch(device, sampler):
    keys = np.arange(40, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(7)
    host = RecordRandomness.for_tests(keys, key=11)
    on_device = DeviceRecordRandomness(host, device)
    images = torch.randn(40, 1, 8, 8)
    labels = torch.arange(40) % 10
    indices = torch.tensor([3, 17, 0, 39, 21])
    augment = dict(flip=True, crop_padding=2, label_dropout=0.3, null_label=10)
    expected = make_multiplicity_batch(images[indices], labels[indices], 3, sampler, host.draws(5, indices), **augment)
    step = torch.tensor(5, dtype=torch.int64, device=device)
    loads = []
    records = ResidentRecords(lambda: loads.append(1) or (images, labels), device)
    build = resident_batch_builder(records, 3, sampler, device, **augment)
    got = build(indices.to(device), on_device.draws(step, indices.to(device)))
    build(indices.to(device), on_device.draws(step, indices.to(device)))
    assert loads == [1]  # the set is copied to the device once
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].device.type == device
        torch.testing.assert_close(got[name].cpu(), value, rtol=0, atol=1e-6 if value.is_floating_point() else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_schedule_on_a_device_gives_the_same_forward_process_and_leaves_the_host_copy(device):
    schedule = build_schedule("linear", 100)
    moved = schedule.to(device)
    assert moved.sqrt_alphas_cumprod.device.type == device and moved.timestep_map.device.type == device
    assert schedule.sqrt_alphas_cumprod.device.type == "cpu"  # the host path keeps its own tables
    x0, noise, t = torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8), torch.tensor([0, 5, 50, 99])
    expected = schedule.q_sample(x0, t, noise)
    got = moved.q_sample(x0.to(device), t.to(device), noise.to(device))
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(moved.to_model_timesteps(t.to(device)).cpu(), schedule.to_model_timesteps(t))


def test_tensors_on_moves_only_tensors_and_copies_the_holder():
    sampler = MixtureOfUniformTimesteps()
    moved = tensors_on(sampler, "meta")
    assert moved is not sampler and moved.weights.device.type == "meta" and sampler.weights.device.type == "cpu"
    assert moved.num_timesteps == sampler.num_timesteps
