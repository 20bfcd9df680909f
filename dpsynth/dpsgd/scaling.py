"""The scaling rule of the ``auto`` presets: DP-SGD batch, steps, model size and sample count from N and the
image shape, within a stated time budget on 2 CPU cores.

Inputs are public only: the private train size N (public by dpsynth's one stated assumption,
docs/privacy.md "What is treated as public"; :mod:`dpsynth.data.sizes` gives it from metadata) and the
image shape (declared, or read from headers), plus the preset's ``auto`` section: the time budget and
the method's measured costs. No private value and no score enters it, so it spends no privacy.

The rule (docs/own-data.md, "The scaling rule"):

1. time: the DP training share is ``SAFETY · time_budget_s − fixed_s − generate.num · sample_s · f``,
   where ``f = max(MIN_PIXEL_FACTOR, C·H·W / 784)`` scales the 28×28 grey costs to the image;
   ``generate.num = clamp(N, min_samples, max_samples)``.
2. model: the first ``models`` tier whose ``up_to`` is at least N. With few examples the noise of a
   DP step (the same whatever N) swamps a large model's gradient, so small sets get small models
   (Tramèr & Boneh, arXiv:2011.11660, §3).
3. batch: ``E`` example-steps fit in the training share (cost ``example_step_s · f`` each); the expected
   batch is ``B = clamp(√E, min_batch, max_batch)``, at most ``max_sample_rate · N``: √E balances steps
   and batch, and larger batches lower the noise of the mean gradient (De et al., arXiv:2204.13650, §4).
4. steps: ``T = E' / B`` where ``E'`` counts a per-step overhead ``step_s`` too, at most ``max_epochs``
   epochs (past that, more steps at a fixed ε only add noise); the sample rate is ``q = B / N``.
5. δ: at most ``1/(10 N)`` (the largest power of ten below it when the preset's δ is larger): a δ near
   ``1/N`` would be met by a mechanism that publishes one record in the clear.
6. one-pass release (``release_rate``): a release that reads every record once (DP-ImgSyn's statistics)
   costs ``N · pass_record_s · f``; past ``release_pass_s`` its Poisson rate is lowered to
   ``release_pass_s / (N · pass_record_s · f)``, so the pass reads as many records as that time allows
   whatever N is (a subsampled Gaussian, amplified by the rate). Its time comes off the training share.

:func:`scale` returns each setting with the dotted key it sets and why; :func:`check_scaled` refuses,
at load, a config whose batch exceeds N or whose estimated time exceeds the budget, naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pydantic
from pydantic import Field

from dpsynth.errors import ConfigError
from dpsynth.schema import Section

#: the share of the time budget the estimate may fill (the rest absorbs a shared machine's slowness)
SAFETY = 0.7
#: costs are measured at 28×28 grey; smaller images do not get cheaper than this share of them
MIN_PIXEL_FACTOR = 0.25
REFERENCE_PIXELS = 28 * 28
#: never fewer samples than this (the evaluation needs some of every class)
MIN_SAMPLES = 100


class ModelTier(Section):
    up_to: int | None = Field(None, ge=1, description="the largest N this model is used for; null: any N")
    example_step_s: float = Field(gt=0, description="seconds per example per DP step at 28x28 grey on 2 CPU cores")
    pass_record_s: float | None = Field(
        None, gt=0, description="seconds per record of the one-pass release (auto.release_rate) at 28x28 grey"
    )
    keys: dict[str, Any] = Field(default_factory=dict, description="dotted config keys that set this model's size")


class AutoSection(Section):
    """The ``auto`` section of an ``auto`` preset: the budget and the method's measured costs (inputs),
    then what the rule planned (written at load)."""

    time_budget_s: float = Field(gt=0, description="the whole run (train, generate, evaluate) on 2 CPU cores")
    dpsgd: str | None = Field(
        description="dotted key of the DP-SGD section the rule sizes, e.g. 'dpdm'; null: a method without DP "
        "steps (one noisy release): only the samples, the model and the public set are sized"
    )
    models: list[ModelTier] = Field(min_length=1, description="model sizes by N, smallest first")
    fixed_s: float = Field(0.0, ge=0, description="seconds outside DP training and sampling (pre-training, eval)")
    sample_s: float = Field(0.0, ge=0, description="seconds per generated image at 28x28 grey")
    step_s: float = Field(0.02, ge=0, description="overhead seconds per DP step (sampling, noise, optimizer)")
    max_samples: int = Field(2000, ge=MIN_SAMPLES, description="cap on generate.num")
    min_samples: int = Field(
        MIN_SAMPLES,
        ge=MIN_SAMPLES,
        description="floor of generate.num (samples are post-processing: a small private set may get more)",
    )
    releases_samples: bool = Field(True, description="false for a method that releases a model: no generate.num")
    min_batch: int = Field(8, ge=1, description="smallest expected batch the rule picks")
    max_batch: int = Field(256, ge=1, description="largest expected batch the rule picks")
    max_sample_rate: float = Field(0.25, gt=0, le=1, description="the batch is at most this share of N")
    max_epochs: float = Field(30.0, gt=0, description="the steps cover at most this many epochs")
    physical_batch: int | None = Field(
        64,
        ge=1,
        description="examples per vectorised gradient call (memory only); null: the section has no physical "
        "batch (a per-step release such as DP-Kernel's)",
    )
    side_multiple: int = Field(1, ge=1, description="the network needs an image side divisible by this (UNet: 4)")
    min_side: int = Field(
        1,
        ge=1,
        description="the network needs an image side of at least this (a GAN generator from 4x4 upsampled twice: 16)",
    )
    public: dict[int, str] | None = Field(
        None, description="built-in public set per channel count (1, 3), used when data.public is unset"
    )
    release_rate: str | None = Field(
        None,
        description="dotted key of the Poisson rate of a release that reads every record once (e.g. "
        "'dp-imgsyn.stats.sample_rate'); the rule lowers it so the pass takes at most release_pass_s",
    )
    release_pass_s: float = Field(60.0, gt=0, description="seconds the one-pass release may take on 2 CPU cores")
    why: str = Field("", description="why this method is the default for own data (logged by `dpsynth run auto`)")
    num_examples: int | None = Field(None, ge=1, description="written at load: the N the rule planned for")
    image_shape: list[int] | None = Field(None, description="written at load: the (C, H, W) it planned for")
    user_keys: list[str] = Field(default_factory=list, description="written at load: rule keys you set yourself")
    applied: list[dict[str, Any]] = Field(
        default_factory=list, description="written at load: each key the rule set, its value and why"
    )

    @pydantic.model_validator(mode="after")
    def _sample_floor_below_cap(self) -> AutoSection:
        if self.min_samples > self.max_samples:
            raise ValueError(
                f"auto.min_samples = {self.min_samples} is above auto.max_samples = {self.max_samples}; lower it"
            )
        return self


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    why: str


def pixel_factor(shape: tuple[int, int, int]) -> float:
    channels, height, width = shape
    return max(MIN_PIXEL_FACTOR, channels * height * width / REFERENCE_PIXELS)


def model_tier(auto: AutoSection, num_examples: int) -> ModelTier:
    return next((tier for tier in auto.models if tier.up_to is None or num_examples <= tier.up_to), auto.models[-1])


def sample_count(auto: AutoSection, num_examples: int) -> int:
    return min(max(num_examples, auto.min_samples), auto.max_samples)


def scale(
    num_examples: int, shape: tuple[int, int, int], auto: AutoSection, has_public: bool, delta: float | None = None
) -> list[Setting]:
    """Every setting the rule makes for N = ``num_examples`` images of ``shape`` (C, H, W); ``delta`` is the
    preset's δ (None: δ is not sized)."""
    n = int(num_examples)
    settings, shape = _side_settings(auto, shape)
    if delta is not None and delta > 1 / (10 * n):
        smaller = 10.0 ** math.floor(math.log10(1 / (10 * n)))
        settings.append(Setting("privacy.delta", smaller, f"at most 1/(10 N) = {1 / (10 * n):.3g} for N={n}"))
    factor = pixel_factor(shape)
    tier = model_tier(auto, n)
    samples = sample_count(auto, n) if auto.releases_samples else 0
    release = _release_setting(auto, n, tier, factor)
    pass_s = 0.0 if release is None else pass_seconds(auto, n, factor, float(release.value))
    train_s = SAFETY * auto.time_budget_s - auto.fixed_s - pass_s - samples * auto.sample_s * factor
    if train_s <= 0:
        raise ConfigError(
            f"config key 'auto.time_budget_s' = {auto.time_budget_s:g}: too short for this method's fixed costs "
            f"({auto.fixed_s + pass_s:g} s) and {samples} samples; give at least "
            f"{math.ceil((auto.fixed_s + pass_s + samples * auto.sample_s * factor) / SAFETY * 1.5)}"
        )
    if release is not None:
        settings.append(release)
    if auto.dpsgd is not None:
        settings += _dpsgd_settings(auto, n, train_s, tier.example_step_s * factor, shape)
    if auto.releases_samples:
        why = (
            f"clamp(N, {auto.min_samples}, {auto.max_samples}): as many samples as private images, within the "
            "budget (more for a small set: sampling spends no privacy)"
        )
        settings.append(Setting("generate.num", samples, why))
    limit = "any N" if tier.up_to is None else f"N <= {tier.up_to}"
    why = f"model for {limit} (N={n}): a DP step's noise does not shrink with N, so fewer examples get fewer parameters"
    settings += [Setting(key, value, why) for key, value in tier.keys.items()]
    if auto.public is not None and not has_public:
        settings.append(_public_setting(auto, shape))
    return settings


def pass_seconds(auto: AutoSection, n: int, factor: float, rate: float) -> float:
    """Seconds of the one-pass release reading a Poisson share ``rate`` of ``n`` records (0 without one)."""
    record_s = model_tier(auto, n).pass_record_s
    return 0.0 if auto.release_rate is None or record_s is None else rate * n * record_s * factor


def _release_setting(auto: AutoSection, n: int, tier: ModelTier, factor: float) -> Setting | None:
    """The one-pass release's Poisson rate (rule step 6), or None for a method without such a release."""
    if auto.release_rate is None:
        return None
    if tier.pass_record_s is None:
        raise ConfigError(f"auto.release_rate is set but the model tier for N={n} gives no pass_record_s")
    full_s = n * tier.pass_record_s * factor
    if full_s <= auto.release_pass_s:
        return Setting(auto.release_rate, 1.0, f"every record: one pass over N={n} takes about {full_s:.0f} s")
    rate = float(f"{auto.release_pass_s / full_s:.4g}")
    why = (
        f"one pass over N={n} would take about {full_s:.0f} s, over auto.release_pass_s = {auto.release_pass_s:g}: "
        f"a Poisson subsample of rate {rate:g} (about {rate * n:.0f} records) fits it, accounted as one "
        "subsampled Gaussian"
    )
    return Setting(auto.release_rate, rate, why)


def _side_settings(auto: AutoSection, shape: tuple[int, int, int]) -> tuple[list[Setting], tuple[int, int, int]]:
    """``data.image_size`` when the network needs a side divisible by ``side_multiple`` and at least ``min_side``,
    and the shape it gives."""
    fits = not (shape[1] % auto.side_multiple or shape[2] % auto.side_multiple)
    if fits and min(shape[1], shape[2]) >= auto.min_side:
        return [], shape
    side = math.ceil(max(auto.min_side, shape[1], shape[2]) / auto.side_multiple) * auto.side_multiple
    why = (
        f"the network halves the side of its input, so it needs a multiple of {auto.side_multiple}"
        + (f" of at least {auto.min_side}" if auto.min_side > 1 else "")
        + f": {shape[1]}x{shape[2]} is resized to {side}x{side} (the release has that size)"
    )
    return [Setting("data.image_size", side, why)], (shape[0], side, side)


def _dpsgd_settings(
    auto: AutoSection, n: int, train_s: float, cost: float, shape: tuple[int, int, int]
) -> list[Setting]:
    """Batch, steps, physical batch and checkpoints of the DP-SGD section ``auto.dpsgd`` (rule steps 3 and 4)."""
    affordable = train_s / cost
    batch = min(auto.max_batch, max(auto.min_batch, round(math.sqrt(affordable))))
    batch = min(batch, math.floor(auto.max_sample_rate * n))
    if batch < 1:
        raise ConfigError(
            f"the private train split has N={n} records: too few for DP-SGD batches of at least one record at "
            f"sample rate {auto.max_sample_rate}; give more images"
        )
    steps = min(math.floor(train_s / (batch * cost + auto.step_s)), math.floor(auto.max_epochs * n / batch))
    if steps < 1:
        raise ConfigError(
            f"config key 'auto.time_budget_s' = {auto.time_budget_s:g}: leaves no time for one DP step; raise it"
        )
    section, size = auto.dpsgd, "x".join(str(v) for v in shape)
    physical = (
        []
        if auto.physical_batch is None
        else [Setting(f"{section}.physical_batch_size", min(batch, auto.physical_batch), "memory only: min(B, 64)")]
    )
    return [
        Setting(
            f"{section}.batch_size",
            batch,
            f"expected batch B = clamp(sqrt(E), {auto.min_batch}, {auto.max_batch}) <= {auto.max_sample_rate:g}*N, "
            f"E = {affordable:.3g} example-steps fit {train_s:.0f} s at {cost:.2g} s each ({size}); "
            f"sample rate q = B/N = {batch / n:.4g}",
        ),
        Setting(
            f"{section}.steps",
            steps,
            f"T = {train_s:.0f} s / (B*{cost:.2g} s + {auto.step_s:g} s per step), at most {auto.max_epochs:g} "
            f"epochs of N={n}: {steps * batch / n:.3g} epochs",
        ),
        *physical,
        Setting(f"{section}.checkpoint_every", max(1, steps // 4), "four checkpoints per run (resume granularity)"),
    ]


def _public_setting(auto: AutoSection, shape: tuple[int, int, int]) -> Setting:
    channels = shape[0]
    public = (auto.public or {}).get(channels)
    if public is None:
        raise ConfigError(
            f"config key 'data.public' is unset and this method has no built-in public set for {channels}-channel "
            f"images; pass one with --set data.public=NAME_OR_PATH (see `dpsynth datasets`)"
        )
    return Setting(
        "data.public",
        public,
        f"the method needs public data; {public} is built in, has {channels} channel(s) and is resized to "
        f"{shape[1]}x{shape[2]}",
    )


def check_scaled(config: dict[str, Any], auto: AutoSection) -> None:
    """ConfigError, naming the key, value and fix, for a sized config that cannot work on this data:
    a batch larger than N (sample rate above the rule's cap or 1), or an estimate over the time budget."""
    n = auto.num_examples
    if n is None or auto.image_shape is None:
        return
    section = auto.dpsgd
    samples = int(get_key(config, "generate.num")) if auto.releases_samples else 0
    rate = 1.0 if auto.release_rate is None else float(get_key(config, auto.release_rate))
    pass_s = pass_seconds(auto, n, pixel_factor(_shape(auto)), rate)
    if section is None:
        _check_budget(auto, auto.fixed_s + pass_s + samples * auto.sample_s * pixel_factor(_shape(auto)), config)
        return
    batch = int(get_key(config, f"{section}.batch_size"))
    if batch > n or batch / n > max(auto.max_sample_rate, 0.5):
        raise ConfigError(
            f"config key '{section}.batch_size' = {batch}: the sample rate B/N = {batch / n:.3g} on N={n} train "
            f"records is too high (at most {max(auto.max_sample_rate, 0.5):g}); set it to at most "
            f"{math.floor(max(auto.max_sample_rate, 0.5) * n)} or drop it and let the auto rule size it"
        )
    steps = get_key(config, f"{section}.steps")
    if steps is None:
        steps = math.ceil(float(get_key(config, f"{section}.epochs")) * n / batch)
    _check_budget(auto, pass_s + estimated_seconds(auto, n, _shape(auto), batch, int(steps), samples), config)


def _shape(auto: AutoSection) -> tuple[int, int, int]:
    channels, height, width = auto.image_shape or (1, 28, 28)
    return channels, height, width


def _check_budget(auto: AutoSection, estimate: float, config: dict[str, Any]) -> None:
    """ConfigError naming the key you set (else the budget) when the estimate exceeds the time budget."""
    section = auto.dpsgd or ""
    if estimate > auto.time_budget_s:
        keys = (f"{section}.steps", f"{section}.batch_size", "generate.num", auto.release_rate)
        key = next(
            (k for k in keys if k is not None and k in auto.user_keys),
            "auto.time_budget_s",
        )
        value = get_key(config, key)
        raise ConfigError(
            f"config key '{key}' = {value}: the plan needs about {estimate:.0f} s on 2 CPU cores, over "
            f"auto.time_budget_s = {auto.time_budget_s:g}; lower {key} or raise auto.time_budget_s"
        )


def estimated_seconds(auto: AutoSection, n: int, shape: tuple[int, ...], batch: int, steps: int, samples: int) -> float:
    """The run's wall-clock estimate on 2 CPU cores, from the preset's measured costs."""
    factor = pixel_factor((shape[0], shape[1], shape[2]))
    cost = model_tier(auto, n).example_step_s * factor
    return auto.fixed_s + steps * (batch * cost + auto.step_s) + samples * auto.sample_s * factor


def get_key(tree: dict[str, Any], dotted: str) -> Any:
    """The value of a dotted key of the nested ``tree``; ConfigError naming it when absent."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"the auto rule sizes '{dotted}', which this config does not have (auto.dpsgd)")
        node = node[part]
    return node


def has_key(tree: dict[str, Any], dotted: str) -> bool:
    """Whether the nested ``tree`` sets the dotted key (a user's overrides, say)."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
