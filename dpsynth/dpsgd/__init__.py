"""DP-SGD: per-example gradients, clipping, noise, Poisson sampling, virtual batches, multiplicity K,
EMA, public clip norm and torch.distributed. The only private training loop of dpsynth."""

from dpsynth.dpsgd.clip_norm import public_clip_norm
from dpsynth.dpsgd.engine import DPSGDEngine, StepStats, reject_cross_example_layers
from dpsynth.dpsgd.per_example import STRATEGIES, PerExampleGradients, clip_scales, clipped_grad_sum, per_example_norms
from dpsynth.dpsgd.sampler import PoissonSampler, steps_per_epoch

__all__ = [
    "STRATEGIES",
    "DPSGDEngine",
    "PerExampleGradients",
    "PoissonSampler",
    "StepStats",
    "clip_scales",
    "clipped_grad_sum",
    "per_example_norms",
    "public_clip_norm",
    "reject_cross_example_layers",
    "steps_per_epoch",
]
