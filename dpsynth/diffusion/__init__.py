"""Gaussian diffusion: noise schedules, timestep samplers, training losses and samplers.

See docs/diffusion.md for what is implemented and the paper sections behind each part.
"""

from dpsynth.diffusion.losses import (
    diffusion_loss,
    make_loss_fn,
    make_multiplicity_batch,
    make_multiplicity_example,
)
from dpsynth.diffusion.samplers import guided_model_output, sample
from dpsynth.diffusion.schedules import (
    DiffusionSchedule,
    MixtureOfUniformTimesteps,
    TimestepSampler,
    UniformTimesteps,
    build_schedule,
    build_timestep_sampler,
)

__all__ = [
    "DiffusionSchedule",
    "build_schedule",
    "TimestepSampler",
    "UniformTimesteps",
    "MixtureOfUniformTimesteps",
    "build_timestep_sampler",
    "diffusion_loss",
    "make_loss_fn",
    "make_multiplicity_batch",
    "make_multiplicity_example",
    "sample",
    "guided_model_output",
]
