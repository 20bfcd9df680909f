"""The DP-SGD engine: the only private training step in dpsynth.

One call of :meth:`DPSGDEngine.step` releases one noisy gradient (Ghalebikesabi et al. (arXiv:2302.13861)
§3.3 and Algorithm 1; Chu et al. (IEEE Access 2023) Algorithm 1):

    g_hat = (1 / B) * ( sum_{i in batch} clip_C(grad L_i) + sigma * C * xi ),   xi ~ N(0, I)

where L_i is the loss of example i averaged over its K augmentations/timesteps (averaging before
clipping keeps the per-example sensitivity at C), the batch is Poisson sampled with rate q, and B
is the *expected* batch size q N (dividing by the realised size would leak it). The step is
charged to the ledger before anything is computed, so a refused step changes nothing.

A logical batch of any size is processed in micro-batches of at most ``max_physical_batch_size``
examples (virtual batching): clipped per-example gradients are summed across micro-batches, and
the noise draw and the optimizer step happen once per logical batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from dpsynth.dpsgd.ema import EMA
from dpsynth.dpsgd.per_example import Example, LossFn, PerExampleGradients, clipped_grad_sum, micro_batches
from dpsynth.dpsgd.precision import Precision
from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.privacy.rng import NoiseSource

# Normalisation layers whose batch statistics mix examples (and whose running statistics would be
# released un-noised): per-example sensitivity is undefined with them.
_CROSS_EXAMPLE_NORMS = (nn.modules.batchnorm._BatchNorm,)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step reveals: only public quantities (no private loss, no realised batch size)."""

    step: int  # logical steps taken so far, this one included
    max_grad_norm: float  # the clip norm C used in this step
    noise_std: float  # std of the noise on each coordinate of the averaged gradient, sigma C / B


class DPSGDEngine:
    """Poisson-subsampled Gaussian gradient descent with any torch optimizer (SGD, Adam, AdamW).

    Args:
        model: the network; BatchNorm is rejected (use GroupNorm/LayerNorm). Parameters with
            ``requires_grad=False`` stay fixed; buffers are read but never updated.
        optimizer: a torch optimizer over the model's trainable parameters.
        loss_fn: ``loss_fn(model_call, example) -> scalar``, the loss of one example; see
            :mod:`dpsynth.dpsgd.per_example`.
        ledger: the run's ``PrivacyLedger``. The mechanism ``mechanism_name`` is registered on it
            (``SubsampledGaussian(name, sigma, q, 0)``); the ledger keeps the steps of an identical
            earlier registration and refuses a different sigma or q.
        noise_multiplier: sigma; the noise std on the clipped sum is ``sigma * C``.
        max_grad_norm: the clip norm C (may change every step, see :meth:`step`).
        sample_rate: Poisson rate q used to draw the batches (declared to the accountant).
        expected_batch_size: q N; the noisy sum is divided by it.
        max_physical_batch_size: examples per forward/backward (bounds memory, not the logical batch).
        per_layer_clipping: clip each parameter tensor to ``C / sqrt(L)`` instead of the whole
            gradient to C; the total sensitivity stays C.
        strategy: how per-example gradients are formed, one of ``STRATEGIES`` of
            :mod:`dpsynth.dpsgd.per_example` (``"auto"``: per layer by the book-keeping cost model
            of :mod:`dpsynth.dpsgd.taps`; ``"timed"``: close calls timed at ``max_physical_batch_size``,
            :mod:`dpsynth.dpsgd.form_trial`; a loss with ``differentiates_input = True`` always gets
            ``"exact"``). The released update is the same for every strategy up to float rounding.
        ema_decay: keep an EMA of the weights in :attr:`ema_model` when set.
        noise: the DP noise source (entropy-seeded by default, docs/contract.md, privacy rule 5).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (CUDA only; :mod:`dpsynth.dpsgd.precision`): the
            forward and backward under autocast; norms, clipping, the sum and the noise stay in the
            parameters' dtype, so the sensitivity is C exactly as in fp32.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        ledger: Any,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float,
        expected_batch_size: float,
        max_physical_batch_size: int,
        mechanism_name: str = "dpsgd",
        per_layer_clipping: bool = False,
        ema_decay: float | None = None,
        noise: NoiseSource | None = None,
        strategy: str = "auto",
        precision: str = "fp32",
    ) -> None:
        reject_cross_example_layers(model)
        reject_dropout(model)
        mixed = Precision(precision)
        mixed.check_device(_model_device(model))
        if noise_multiplier < 0:
            raise PrivacyError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        if not 0.0 < sample_rate <= 1.0:
            raise PrivacyError(f"sample rate must be in (0, 1], got {sample_rate}")
        if expected_batch_size <= 0:
            raise ConfigError(f"expected batch size must be positive, got {expected_batch_size}")
        if max_physical_batch_size < 1:
            raise ConfigError(f"max physical batch size must be >= 1, got {max_physical_batch_size}")
        self.model = model
        self.optimizer = optimizer
        self.ledger = ledger
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = max_grad_norm
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.mechanism_name = mechanism_name
        self.per_layer_clipping = per_layer_clipping
        self.noise = noise if noise is not None else NoiseSource()
        self.steps = 0
        self._per_example = PerExampleGradients(
            model, loss_fn, strategy=strategy, precision=mixed, trial_batch=self.max_physical_batch_size
        )
        self._ema = EMA(model, ema_decay) if ema_decay is not None else None
        if ledger is not None:
            self._ensure_registered()

    # -- configuration -------------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> float:
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        value = float(value)
        if not (value > 0 and math.isfinite(value)):
            raise PrivacyError(f"clip norm must be a positive finite number, got {value}")
        self._max_grad_norm = value

    @property
    def ema_model(self) -> nn.Module | None:
        """The EMA copy of the model (None without ``ema_decay``)."""
        return self._ema.model if self._ema is not None else None

    @property
    def strategy(self) -> str:
        """The per-example gradient strategy in use (``"exact"`` for input-differentiating losses)."""
        return self._per_example.strategy

    @property
    def precision(self) -> str:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``: the dtype of the forward and backward (never of the clipping)."""
        return self._per_example.precision.name

    @property
    def nonfinite_examples(self) -> int:
        """Examples whose NaN/Inf gradient was dropped (contributed zero) so far in this process.

        PRIVATE diagnostic: the count is a function of the private data and is not covered by the
        privacy guarantee. It is for the data custodian's diagnostics only; never put it in
        curves, logs, ``StepStats`` or anything released.
        """
        return self._per_example.nonfinite_examples

    def ema_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self._ema.state_dict() if self._ema is not None else None

    def _ensure_registered(self) -> None:
        # Registering again with the same sigma and q (a resumed ledger) keeps the steps spent;
        # different parameters raise PrivacyError in the ledger.
        from dpsynth.privacy.mechanisms import SubsampledGaussian

        if self.noise_multiplier == 0:
            # σ = 0 is no DP mechanism (only the audit's non-private sanity mode uses it): nothing is
            # registered, so a real ledger refuses to spend an unknown mechanism.
            return
        self.ledger.register(SubsampledGaussian(self.mechanism_name, self.noise_multiplier, self.sample_rate, 0))

    # -- the step ------------------------------------------------------------------------------

    def step(self, batch: Example | Iterable[Example], max_grad_norm: float | None = None) -> StepStats:
        """Charge one step, then apply one noisy update computed from a Poisson-sampled batch.

        Args:
            batch: a dict of tensors with the examples on dim 0 (possibly zero examples), or an
                iterable of such micro-batch dicts (e.g. built lazily) that together form the batch.
            max_grad_norm: clip norm C for this step only (e.g. from :func:`public_clip_norm`);
                the noise scales with it, so the accounting is unchanged.
        """
        clip = self._agreed_clip(self.max_grad_norm if max_grad_norm is None else _positive(max_grad_norm))
        self._charge()  # first: a refused step must leave the model untouched
        if isinstance(batch, Mapping):
            stream: Iterable[Example] = micro_batches(batch, self.max_physical_batch_size)
        else:
            stream = batch
        summed, _ = clipped_grad_sum(self._per_example, stream, clip, self.per_layer_clipping)
        noisy_sum = self._aggregate(self._add_noise(summed, clip))
        self._apply(noisy_sum)
        self.steps += 1
        return StepStats(
            step=self.steps, max_grad_norm=clip, noise_std=self.noise_multiplier * clip / self.expected_batch_size
        )

    def _agreed_clip(self, clip: float) -> float:
        """The clip norm every worker uses this step; a single process has nothing to agree on."""
        return clip

    def _charge(self) -> None:
        self.ledger.spend(self.mechanism_name)

    def _add_noise(self, summed: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
        std = self.noise_multiplier * clip
        # One draw of i.i.d. N(0, std^2) per group of parameter tensors (one device and dtype, at most
        # max(largest tensor, 2^22) numbers: the extra memory a draw needs), split into views and added by one
        # foreach op: a few ops per group instead of a draw's three per tensor (BENCHMARKS.md, "GPU: H100").
        for group in _noise_groups(list(summed.values())):
            sizes = [t.numel() for t in group]
            flat = self.noise.normal((sum(sizes),), std, device=group[0].device, dtype=group[0].dtype)
            torch._foreach_add_(group, [chunk.view(t.shape) for t, chunk in zip(group, flat.split(sizes))])
        return summed

    def _aggregate(self, noisy_sum: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Combine the noisy sums of all workers; a single process has nothing to combine."""
        return noisy_sum

    def _apply(self, noisy_sum: dict[str, torch.Tensor]) -> None:
        parameters = dict(self.model.named_parameters())
        if noisy_sum:
            torch._foreach_div_(list(noisy_sum.values()), self.expected_batch_size)
        for name, total in noisy_sum.items():
            parameters[name].grad = total
        self.optimizer.step()
        if self._ema is not None:
            self._ema.update(self.model)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, EMA and step count (the ledger is saved by its owner)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema_state_dict(),
            "steps": self.steps,
            "max_grad_norm": self.max_grad_norm,
            "mechanism": {
                "name": self.mechanism_name,
                "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate,
                "expected_batch_size": self.expected_batch_size,
            },
            "noise": self.noise.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["mechanism"]
        if not (
            math.isclose(saved["noise_multiplier"], self.noise_multiplier, rel_tol=1e-9)
            and math.isclose(saved["sample_rate"], self.sample_rate, rel_tol=1e-9)
        ):
            raise PrivacyError("checkpoint was trained with a different noise multiplier or sample rate")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self._ema is not None:
            if state.get("ema") is None:
                raise ConfigError("checkpoint has no EMA weights but the engine keeps an EMA")
            self._ema.load_state_dict(state["ema"])
        self.steps = int(state["steps"])
        self.max_grad_norm = state["max_grad_norm"]


def reject_cross_example_layers(model: nn.Module) -> None:
    """Raise ``ConfigError`` for BatchNorm (and InstanceNorm tracking running statistics)."""
    for name, module in model.named_modules():
        tracks_stats = isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats
        if isinstance(module, _CROSS_EXAMPLE_NORMS) or tracks_stats:
            raise ConfigError(
                f"layer {name or type(module).__name__!r} ({type(module).__name__}) mixes examples or keeps "
                "running statistics of private data, which breaks per-example DP; use GroupNorm or LayerNorm"
            )


def reject_dropout(model: nn.Module) -> None:
    """Raise ``ConfigError`` for dropout with p > 0: its masks are drawn from torch's global generator by
    batch position, so a record's mask would depend on the other records of the batch (and on the run
    seed), which breaks the per-record sensitivity argument (docs/privacy.md, "Per-record randomness")."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise ConfigError(
                f"layer {name!r} is dropout with p={module.p:g}; private training refuses dropout, whose masks "
                "would depend on the other records in the batch: set the model's dropout to 0"
            )


_NOISE_GROUP_NUMEL = 2**22


def _noise_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive groups of ``tensors`` of one device and dtype and at most ``max(largest numel, 2^22)`` numbers."""
    limit = max([_NOISE_GROUP_NUMEL, *(t.numel() for t in tensors)])
    groups: list[list[torch.Tensor]] = []
    size = limit + 1
    for tensor in tensors:
        kind = groups[-1][0] if groups else None
        if size + tensor.numel() > limit or (tensor.device, tensor.dtype) != (kind.device, kind.dtype):
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.numel()
    return groups


def _model_device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _positive(value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise PrivacyError(f"clip norm must be a positive finite number, got {value}")
    return value
