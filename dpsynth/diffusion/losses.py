"""Diffusion training losses, shaped for the per-example DP-SGD engine.

* ``"simple"``: L_simple = ‖ε - ε_θ(√ᾱ_t x_0 + √(1-ᾱ_t) ε, y, t)‖² averaged over pixels
  (Ho et al.; Chu et al. (IEEE Access 2023) eq. 8; Ghalebikesabi et al. (arXiv:2302.13861) eq. 1).
* ``"hybrid"``: L_hybrid = L_simple + λ L_vlb with λ = 0.001 and a learned variance (improved
  DDPM, used by Chu et al. (IEEE Access 2023) §III-A eq. 6-7). For one sampled t the unbiased
  estimate of L_vlb = Σ_t L_t is T·L_t, so the per-sample term is λ·T·L_t (= L_t at T = 1000,
  as in improved DDPM's "rescaled" loss). L_t is KL(q(x_{t-1}|x_t,x_0) ‖ p_θ(x_{t-1}|x_t)) in bits
  per dimension for t > 0 and the discretised-Gaussian decoder NLL -log p_θ(x_0|x_1) at t = 0.
  The model's mean enters L_vlb with a stop-gradient, so L_vlb trains only the variance and
  L_simple stays the sole signal for the mean (improved DDPM §3.1).

Randomness (timesteps, noise, flips, crops, label dropout) is drawn *outside* the loss and passed
in, as the engine requires (docs/architecture.md, DP-SGD): :func:`make_multiplicity_example`
builds the K-copy example of Ghalebikesabi et al. (arXiv:2302.13861) §4 (augmentation multiplicity with
timesteps, flips and crops, averaged inside the per-example loss before clipping).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dpsynth.diffusion.schedules import DiffusionSchedule, TimestepSampler, split_output
from dpsynth.errors import ConfigError
from dpsynth.privacy.record_draws import Draws, as_draws

__all__ = [
    "ModelCall",
    "diffusion_loss",
    "make_loss_fn",
    "normal_kl",
    "discretized_gaussian_log_likelihood",
    "vlb_terms",
    "make_multiplicity_batch",
    "make_multiplicity_example",
    "LOSS_KINDS",
]

ModelCall = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
LOSS_KINDS = ("simple", "hybrid")
HYBRID_VLB_WEIGHT = 0.001


def normal_kl(mean1: torch.Tensor, log_var1: torch.Tensor, mean2: torch.Tensor, log_var2: torch.Tensor) -> torch.Tensor:
    """Elementwise KL(N(mean1, e^log_var1) ‖ N(mean2, e^log_var2)) in nats."""
    return 0.5 * (
        -1.0 + log_var2 - log_var1 + torch.exp(log_var1 - log_var2) + (mean1 - mean2) ** 2 * torch.exp(-log_var2)
    )


def _standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """Elementwise log-probability of 8-bit data ``x`` in [-1, 1] under a Gaussian discretised into
    bins of width 2/255, with the edge bins extended to ±∞ (Ho et al. §3.3, the decoder L_0)."""
    centered = x - mean
    inv_std = torch.exp(-log_scale)
    cdf_plus = _standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_minus = _standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    # Clamps keep the log finite (and its gradient zero, not NaN) in the branches torch.where drops.
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_minus = torch.log((1.0 - cdf_minus).clamp(min=1e-12))
    log_bin = torch.log((cdf_plus - cdf_minus).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_minus, log_bin))


def _mean_over_pixels(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(start_dim=-3).mean(dim=-1)


def vlb_terms(
    schedule: DiffusionSchedule,
    eps: torch.Tensor,
    v: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
) -> torch.Tensor:
    """L_t in bits/dim for each copy ``[K]``: the posterior KL for t > 0, the decoder NLL at t = 0.

    The caller decides what to detach; :func:`diffusion_loss` passes ``eps.detach()``.
    """
    model = schedule.p_mean_log_variance(torch.cat([eps, v], dim=-3), x_t, t, variance="learned", learn_sigma=True)
    true_mean, true_log_var = schedule.q_posterior(x0, x_t, t)
    kl = _mean_over_pixels(normal_kl(true_mean, true_log_var, model["mean"], model["log_variance"])) / math.log(2.0)
    decoder_nll = -_mean_over_pixels(
        discretized_gaussian_log_likelihood(x0, model["mean"], 0.5 * model["log_variance"])
    ) / math.log(2.0)
    return torch.where(t == 0, decoder_nll, kl)


def diffusion_loss(
    model_call: ModelCall,
    x0: torch.Tensor,
    labels: torch.Tensor | None,
    t: torch.Tensor,
    noise: torch.Tensor,
    schedule: DiffusionSchedule,
    kind: str = "simple",
    vlb_weight: float = HYBRID_VLB_WEIGHT,
) -> torch.Tensor:
    """Mean loss over K copies of one example: ``x0 [K,C,H,W]``, ``labels [K]``, ``t [K]``, ``noise [K,C,H,W]``.

    ``model_call(x_t, t, labels)`` returns ε̂ ``[K,C,H,W]`` or, for a learned-variance model,
    ``[K,2C,H,W]`` (ε̂ then v). ``kind="simple"`` ignores v; ``kind="hybrid"`` needs it.
    Works the same for a batch of examples (leading dims are averaged).
    """
    if kind not in LOSS_KINDS:
        raise ConfigError(f"unknown diffusion loss {kind!r}; choose one of {list(LOSS_KINDS)}")
    x_t = schedule.q_sample(x0, t, noise)
    output = model_call(x_t, t, labels)
    learn_sigma = output.shape[-3] == 2 * x0.shape[-3]
    eps, v = split_output(output, learn_sigma)
    simple = _mean_over_pixels((noise - eps) ** 2)
    if kind == "simple":
        return simple.mean()
    if v is None:
        raise ConfigError("the hybrid loss needs a learned-variance model (learn_sigma=True)")
    # Stop-gradient on the mean: L_vlb only trains the variance (improved DDPM §3.1).
    vlb = vlb_terms(schedule, eps.detach(), v, x0, x_t, t)
    return (simple + vlb_weight * schedule.num_timesteps * vlb).mean()


def make_loss_fn(
    schedule: DiffusionSchedule, kind: str = "simple", vlb_weight: float = HYBRID_VLB_WEIGHT
) -> Callable[[ModelCall, dict[str, torch.Tensor]], torch.Tensor]:
    """``loss_fn(model_call, example)`` for the DP-SGD engine, reading the keys written by
    :func:`make_multiplicity_example` (``x0``, ``t``, ``noise`` and optionally ``label``)."""
    if kind not in LOSS_KINDS:
        raise ConfigError(f"unknown diffusion loss {kind!r}; choose one of {list(LOSS_KINDS)}")

    def loss_fn(model_call: ModelCall, example: dict[str, torch.Tensor]) -> torch.Tensor:
        return diffusion_loss(
            model_call,
            example["x0"],
            example.get("label"),
            example["t"],
            example["noise"],
            schedule,
            kind=kind,
            vlb_weight=vlb_weight,
        )

    return loss_fn


def _flip_where(x: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Mirror the copies of ``x [..., C, H, W]`` where ``flip [...]`` is true."""
    flip = flip.to(x.device)
    return torch.where(flip.reshape(flip.shape + (1, 1, 1)), x.flip(-1), x)


def _crop_at(x: torch.Tensor, padding: int, top: torch.Tensor, left: torch.Tensor, mode: str) -> torch.Tensor:
    """Pad ``x [..., C, H, W]`` by ``padding`` on every side, then crop back to the original size at
    offsets ``top``/``left [...]`` (one per copy)."""
    lead, (channels, height, width) = x.shape[:-3], x.shape[-3:]
    flat = x.reshape(-1, channels, height, width)
    padded = F.pad(flat, (padding,) * 4, mode=mode)
    n = flat.shape[0]
    rows = (top.reshape(n, 1) + torch.arange(height)).to(x.device)[:, None, :, None]
    cols = (left.reshape(n, 1) + torch.arange(width)).to(x.device)[:, None, None, :]
    index_n = torch.arange(n, device=x.device)[:, None, None, None]
    index_c = torch.arange(channels, device=x.device)[None, :, None, None]
    crops = padded[index_n, index_c, rows, cols]
    return crops.reshape(*lead, channels, height, width)


def make_multiplicity_batch(
    x0: torch.Tensor,
    labels: torch.Tensor | None,
    multiplicity: int,
    timestep_sampler: TimestepSampler,
    draws: Draws | torch.Generator | None = None,
    *,
    flip: bool = False,
    crop_padding: int = 0,
    crop_mode: str = "reflect",
    label_dropout: float = 0.0,
    null_label: int | None = None,
) -> dict[str, torch.Tensor]:
    """K-copy inputs for a batch ``x0 [B,C,H,W]``: ``{"x0": [B,K,C,H,W], "label": [B,K], "t": [B,K],
    "noise": [B,K,C,H,W]}`` (``label`` omitted when ``labels`` is None).

    Each copy gets its own timestep, noise and (optionally) horizontal flip, random crop after
    ``crop_padding`` pixels of padding, and label replaced by ``null_label`` with probability
    ``label_dropout`` (classifier-free guidance training). This is the augmentation multiplicity
    with timesteps of Ghalebikesabi et al. (arXiv:2302.13861) §4. All randomness comes from ``draws``,
    row ``i`` for example ``i``: for private batches these are the per-record draws of
    :mod:`dpsynth.privacy.record_draws`, so no example's inputs depend on which others are in the batch.
    """
    if multiplicity < 1:
        raise ConfigError(f"augmentation multiplicity must be at least 1, got {multiplicity}")
    if crop_padding < 0 or not 0.0 <= label_dropout <= 1.0:
        raise ConfigError("crop_padding must be >= 0 and label_dropout in [0, 1]")
    if label_dropout > 0 and null_label is None:
        raise ConfigError("label_dropout needs null_label (the model's num_classes)")
    batch = x0.shape[0]
    draws = as_draws(draws, batch)
    copies = x0.unsqueeze(1).expand(batch, multiplicity, *x0.shape[1:])
    t = timestep_sampler.from_uniform(draws.rand(multiplicity, dtype=torch.float64))
    # Drawn on the CPU, then moved: the same draws give the same inputs on any device.
    noise = draws.randn(multiplicity, *x0.shape[1:], dtype=x0.dtype)
    if flip:
        copies = _flip_where(copies, draws.rand(multiplicity) < 0.5)
    if crop_padding:
        offsets = draws.randint(0, 2 * crop_padding + 1, multiplicity, 2)
        copies = _crop_at(copies, crop_padding, offsets[..., 0], offsets[..., 1], crop_mode)
    example = {"x0": copies.contiguous(), "t": t.to(x0.device), "noise": noise.to(x0.device)}
    if labels is not None:
        copy_labels = labels.reshape(batch, 1).expand(batch, multiplicity).clone()
        if label_dropout > 0:
            dropped = (draws.rand(multiplicity) < label_dropout).to(copy_labels.device)
            copy_labels = torch.where(dropped, torch.full_like(copy_labels, int(null_label)), copy_labels)
        example["label"] = copy_labels
    return example


def resident_batch_builder(
    records: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
    multiplicity: int,
    timestep_sampler: TimestepSampler,
    device: torch.device | str,
    **augment: Any,
) -> Callable[[torch.Tensor, Draws], dict[str, torch.Tensor]]:
    """:func:`make_multiplicity_batch` over a private set resident on ``device`` (``records``, a
    :class:`~dpsynth.data.resident.ResidentRecords`): the ``device_batch`` of
    :func:`dpsynth.dpsgd.training.train_private`, so the fixed-shape step gathers its batch on the device.

    ``indices`` are device indices and ``draws`` a :class:`~dpsynth.privacy.device_draws.DeviceRecordDraws`; a
    record's inputs are exactly the host builder's (tests/diffusion/test_device_batch.py).
    """
    sampler = timestep_sampler.to(device)

    def build(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        inputs, labels = records(indices)
        return make_multiplicity_batch(inputs, labels, multiplicity, sampler, draws, **augment)

    return build


def make_multiplicity_example(
    x0: torch.Tensor,
    label: int | torch.Tensor | None,
    multiplicity: int,
    timestep_sampler: TimestepSampler,
    draws: Draws | torch.Generator | None = None,
    **augment: object,
) -> dict[str, torch.Tensor]:
    """The engine's per-example ``example`` dict for one image ``x0 [C,H,W]``: ``x0 [K,C,H,W]``,
    ``label [K]``, ``t [K]``, ``noise [K,C,H,W]``. Keyword options as :func:`make_multiplicity_batch`."""
    labels = None if label is None else torch.as_tensor(label, dtype=torch.long).reshape(1)
    batch = make_multiplicity_batch(x0.unsqueeze(0), labels, multiplicity, timestep_sampler, draws, **augment)
    return {key: value.squeeze(0) for key, value in batch.items()}
