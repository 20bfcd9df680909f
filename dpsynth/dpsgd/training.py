"""The one private training loop every method calls (docs/architecture.md: "a method never owns a private
training loop"): σ calibration against the ledger, Poisson sampling, the DP-SGD engine, learning-rate
schedule, optional public clip norm, checkpoints, curves and a progress bar.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dpsynth.dpsgd.fixed_shape import (
    DevicePoissonSampler,
    FixedShapeStep,
    capacity_summary,
    graph_mode,
    masked_loss,
    step_form,
)
from dpsynth.errors import ConfigError
from dpsynth.privacy.device_draws import DeviceRecordRandomness
from dpsynth.privacy.plan import PrivacyPlan, plan_with_dpsgd
from dpsynth.privacy.record_draws import Draws, RecordRandomness

OPTIMIZERS = ("sgd", "adam", "adamw")
#: ``make_batch(indices, draws)``: the per-example inputs of the records at dataset positions ``indices``;
#: every random input of record ``indices[i]`` comes from row ``i`` of ``draws``.
BatchBuilder = Callable[[torch.Tensor, Draws], dict[str, torch.Tensor]]


@dataclasses.dataclass
class PrivateTraining:
    """Settings of one DP-SGD training (from a config section: :meth:`dpsynth.dpsgd.section.DPSGDSection.training`)."""

    batch_size: int  # expected logical batch size B; sample rate q = B / N
    lr: float
    steps: int | None = None  # exactly one of steps / epochs
    epochs: float | None = None
    optimizer: str = "adam"
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip_norm: float = 1.0  # C, the per-example clip norm (the engine's max_grad_norm)
    noise_multiplier: float | None = None  # None: calibrated to the remaining budget
    physical_batch_size: int = 64
    ema_decay: float | None = None
    checkpoint_every: int = 50
    per_layer_clipping: bool = False
    strategy: str = "auto"  # per-example gradients: one of dpsynth.dpsgd.per_example.STRATEGIES
    precision: str = "fp32"  # forward/backward dtype: fp32 | bf16 | fp16 (CUDA) (dpsynth.dpsgd.precision)
    graph: str | bool = "auto"  # the fixed-shape step, captured on CUDA (dpsynth.dpsgd.fixed_shape.graph_mode)

    def total_steps(self, num_examples: int) -> int:
        if (self.steps is None) == (self.epochs is None):
            raise ConfigError("set exactly one of 'steps' and 'epochs' for private training")
        if self.steps is not None:
            return int(self.steps)
        return max(1, math.ceil(self.epochs * num_examples / self.batch_size))

    def check_batch(self, num_examples: int, key: str) -> None:
        """ConfigError naming ``key.batch_size`` unless 0 < B <= N (a sample rate in (0, 1])."""
        if not 0 < self.batch_size <= num_examples:
            raise ConfigError(
                f"{key}.batch_size must be in [1, {num_examples}] (the private train size), got {self.batch_size}"
            )

    def plan(self, privacy: Any, num_examples: int, *, name: str, key: str, fixed: Sequence[Any] = ()) -> PrivacyPlan:
        """The plan of this training as one DP-SGD mechanism ``name`` (``total_steps`` at q = B/N, σ calibrated
        unless given) after the ``fixed`` mechanisms; ``key`` is the config section named by a bad batch size."""
        self.check_batch(num_examples, key)
        return plan_with_dpsgd(
            privacy,
            tuple(fixed),
            name=name,
            sample_rate=self.batch_size / num_examples,
            steps=self.total_steps(num_examples),
            noise_multiplier=self.noise_multiplier,
        )


def make_optimizer(params: Sequence[torch.nn.Parameter], settings: PrivateTraining) -> torch.optim.Optimizer:
    name = settings.optimizer.lower()
    if name == "sgd":
        return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    raise ConfigError(f"unknown optimizer {settings.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def train_private(
    ctx: Any,
    model: torch.nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    make_batch: BatchBuilder,
    record_keys: np.ndarray,
    settings: PrivateTraining,
    *,
    mechanism: str = "dpsgd",
    reserve: Sequence[Any] = (),
    lr_lambda: Callable[[int], float] | None = None,
    clip_norm_fn: Callable[[int, Any], float] | None = None,
    after_step: Callable[[int, Any], None] | None = None,
    state_extra: Callable[[], dict[str, Any]] | None = None,
    monitor: Callable[[], dict[str, float]] | None = None,
    desc: str = "DP-SGD",
    device_batch: Callable[[torch.Tensor, Any], dict[str, torch.Tensor]] | None = None,
) -> Any:
    """Train ``model`` with DP-SGD on the private records whose content keys are ``record_keys``; return the engine.

    ``make_batch(indices, draws)`` builds the per-example inputs of a Poisson-sampled batch. Every
    random input of a record (timesteps, noise, crops, latents) must come from its row of ``draws``
    (:mod:`dpsynth.privacy.record_draws`): keyed on a secret, the step and the record's content, so a
    record's inputs are the same whatever other records are sampled with it, and the clipped sums of
    neighbouring batches differ by one record's term (docs/privacy.md, "Per-record randomness").
    ``reserve`` lists mechanisms the method charges after training; they enter the calibration so
    the final composed ε meets the target (docs/contract.md, privacy rule 2). ``monitor()`` returns values
    for the training curves (e.g. the loss on a fixed *public* batch); it must not read private data.
    ``after_step(step, engine)`` runs after each noisy update (``step`` counts from 0), before that
    step's curves and checkpoint, so state it changes (kept through ``state_extra``) is saved with
    the step. It may read only released state and public data: it is post-processing, not a
    mechanism (PrivImage+G: the generator follows the discriminator released so far).
    The returned engine's ``nonfinite_examples`` (examples dropped for a NaN/Inf gradient) is a
    private diagnostic: when non-zero it is logged with ``private=True`` (``diagnostics/log.txt`` only).

    Under torchrun (a process group is up) every rank calls this with the same arguments: the engine is
    :class:`~dpsynth.dpsgd.distributed.DistributedDPSGDEngine`, each rank Poisson-samples its own disjoint
    shard at the global rate q, and only rank 0 charges the ledger and adds the noise; the method code
    is the same as with one process.

    ``device_batch(indices, draws)``, when given, is ``make_batch`` over data resident on the model's device
    (indices a device tensor, draws a :class:`~dpsynth.privacy.device_draws.DeviceRecordDraws`): with
    ``settings.graph`` on, each step is the fixed-shape step of :mod:`dpsynth.dpsgd.fixed_shape` (captured as a
    CUDA graph on CUDA). Without it, under torchrun or with ``privacy.secure_rng`` the step stays eager and
    the log says why in one line.
    """
    from dpsynth.dpsgd import DPSGDEngine, distributed
    from dpsynth.privacy import SubsampledGaussian, calibrate_noise

    num_examples = len(record_keys)
    if not 0 < settings.batch_size <= num_examples:
        raise ConfigError(
            f"batch_size must be in [1, {num_examples}] (the private train size), got {settings.batch_size}"
        )
    total = settings.total_steps(num_examples)
    sample_rate = settings.batch_size / num_examples
    ledger = ctx.ledger
    recorded = [m for m in ledger.mechanisms() if m.name == mechanism]
    if recorded:  # resuming: keep the σ the ledger already accounts for
        sigma = recorded[0].noise_multiplier
    else:
        sigma = settings.noise_multiplier
        if sigma is None:
            sigma = calibrate_noise(
                ledger.target_epsilon,
                ledger.delta,
                sample_rate,
                total,
                prior=[*ledger.mechanisms(), *reserve],
                accountant=ledger.accountant,
            )
    # planned=total: the spends up to the plan are checked against it once (a resumed ledger keeps its steps)
    ledger.register(SubsampledGaussian(mechanism, sigma, sample_rate, 0), planned=total)
    ctx.log(
        f"{desc}: {total} steps, q={sample_rate:.4g}, sigma={sigma:.4f}, C={settings.clip_norm}, "
        f"B={settings.batch_size}, target eps={ledger.target_epsilon}"
        + (f", precision={settings.precision}" if settings.precision != "fp32" else "")
    )

    # One DP randomness source for the whole mechanism: the Gaussian noise *and* the Poisson batch
    # draws (secure with privacy.secure_rng); never the run seed. Under torchrun every rank has its
    # own entropy-seeded source, so the ranks' coins are independent (distributed.ShardedPoissonSampler).
    noise = ctx.noise_source()
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda) if lr_lambda else None
    rank, world = distributed.rank(), distributed.world_size()
    # Across ranks: rank 0 charges its ledger and adds the noise once; the other ranks' ledgers mirror it.
    engine_class = distributed.DistributedDPSGDEngine if world > 1 else DPSGDEngine
    fixed, form = step_form(
        settings.graph,
        next(model.parameters()).device,
        secure_rng=noise.secure,
        world=world,
        device_batch=device_batch is not None,
    )
    if not fixed and form.startswith("graph:"):  # asked for and not had: say why
        ctx.log(f"{desc}: {form}")
    engine = engine_class(
        model,
        optimizer,
        masked_loss(loss_fn) if fixed else loss_fn,
        ledger,
        noise_multiplier=sigma,
        max_grad_norm=settings.clip_norm,
        sample_rate=sample_rate,
        expected_batch_size=settings.batch_size,
        max_physical_batch_size=settings.physical_batch_size,
        mechanism_name=mechanism,
        per_layer_clipping=settings.per_layer_clipping,
        ema_decay=settings.ema_decay,
        noise=noise,
        strategy=settings.strategy,
        precision=settings.precision,
    )
    start = _resume(ctx, engine, scheduler, mechanism)
    if start >= total:
        ctx.log(f"{desc}: already complete ({total} steps), nothing to resume")
        return engine
    sampler = distributed.ShardedPoissonSampler(num_examples, sample_rate, noise, shard=rank, shards=world)
    # The per-record draws' key is secret and fresh in every process (never the run seed); each record
    # lives on one rank's shard, so the ranks need no common key.
    randomness = RecordRandomness(record_keys)
    fixed_step = None
    if fixed:
        fixed_step = _fixed_shape_step(engine, randomness, device_batch, num_examples, sample_rate, settings, noise)
        how = "captured" if fixed_step.capture else "uncaptured"
        ctx.log(f"{desc}: {how} {capacity_summary(num_examples, sample_rate)}")

    def checkpoint(step: int) -> None:
        state = {
            "step": step,
            "engine": engine.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler else None,
        }
        if state_extra is not None:
            state["extra"] = state_extra()
        ctx.checkpoints.save(state, phase=mechanism)

    device, physical = next(model.parameters()).device, settings.physical_batch_size
    quiet = not distributed.is_main()  # one progress bar, rank 0's
    postfix: dict[str, Any] = {}  # what the bar shows after the step count: public values only
    shown_epsilon = EpsilonTicker(ledger)
    with tqdm(
        total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True, leave=False, disable=quiet
    ) as bar:
        for step in range(start, total):
            if clip_norm_fn is not None:
                engine.max_grad_norm = float(clip_norm_fn(step, engine))
            if fixed_step is not None:
                fixed_step()
            else:
                # Keyed on the updates released so far, which equals ``step`` (and survives a resume).
                batch = _micro_batches(make_batch, sampler.sample(), randomness, engine.steps, physical, device)
                engine.step(batch)
            if scheduler is not None:
                scheduler.step()
            if after_step is not None:
                after_step(step, engine)
            bar.update(1)
            if (step + 1) % settings.checkpoint_every == 0 or step + 1 == total or step == 0:
                # Sampled, not every step: one ε costs an accountant call. Only public values go into
                # the curves; the private loss and the realised Poisson batch size are functions of
                # private data (docs/contract.md, privacy rule 4).
                values = {
                    "epsilon": ledger.epsilon(),
                    "clip_norm": engine.max_grad_norm,
                    **(monitor() if monitor is not None else {}),
                }
                ctx.curves.log(step + 1, **values)
                shown_epsilon.fresh()
                postfix.update(values)
                bar.set_postfix({k: _short(v) for k, v in postfix.items()})
            elif not quiet and shown_epsilon.due():
                postfix["epsilon"] = shown_epsilon.measure()  # eps after this step: sigma, q and steps only
                bar.set_postfix({k: _short(v) for k, v in postfix.items()})
            if (step + 1) % settings.checkpoint_every == 0 or step + 1 == total:
                checkpoint(step + 1)
    if engine.nonfinite_examples:
        # How many gradients were NaN/Inf depends on the private data: a diagnostic, never the release.
        ctx.log(
            f"{desc}: {engine.nonfinite_examples} non-finite per-example gradient(s) contributed zero", private=True
        )
    ctx.log(f"{desc}: done, eps spent so far {ledger.epsilon():.4f} of {ledger.target_epsilon}")
    return engine


def _fixed_shape_step(
    engine: Any,
    randomness: RecordRandomness,
    device_batch: Any,
    num_examples: int,
    sample_rate: float,
    settings: PrivateTraining,
    noise: Any,
) -> Any:
    device = next(engine.model.parameters()).device
    sampler = DevicePoissonSampler(num_examples, sample_rate, noise.generator(device))
    return FixedShapeStep(
        engine,
        DeviceRecordRandomness(randomness, device),
        device_batch,
        sampler,
        settings.physical_batch_size,
        capture=graph_mode(settings.graph, device),
    )


class EpsilonTicker:
    """The ledger's ε for the progress bar between checkpoints, kept cheap by measuring its own cost.

    ε after a step is a function of public quantities (σ, q, the step count, the other mechanisms), so
    the bar may show it; but one PRV accountant call takes tens to hundreds of milliseconds, more than
    a small model's DP step on a CPU. So ε is recomputed only when at least ``interval`` seconds, and
    at least ``1 / share`` times the last call's cost, have passed since it was last known: the
    accounting then takes at most ``share`` of the training time, and the bar moves about once a
    second on fast accountants. The number is the ledger's own (no second accountant), the one
    ``privacy.json`` and the curves report.
    """

    def __init__(self, ledger: Any, share: float = 0.05, interval: float = 1.0) -> None:
        self.ledger, self.share, self.interval = ledger, share, interval
        self.cost, self.last = 0.0, time.monotonic()

    def due(self) -> bool:
        """Whether the bar's ε is old enough to be worth an accountant call."""
        return time.monotonic() - self.last >= max(self.interval, self.cost / self.share)

    def fresh(self) -> None:
        """ε was just computed elsewhere (a checkpoint step): the bar's value is fresh again."""
        self.last = time.monotonic()

    def measure(self) -> float | None:
        """The ledger's ε now, timing the call so that the next one waits in proportion."""
        started = time.monotonic()
        epsilon = self.ledger.epsilon()
        self.last = time.monotonic()
        self.cost = self.last - started
        return epsilon


def _short(value: Any) -> str:
    """A progress-bar value: four significant digits, ``none`` for a ledger that claims no ε."""
    return "none" if value is None else f"{value:.4g}"


def _micro_batches(
    make_batch: BatchBuilder,
    indices: torch.Tensor,
    randomness: RecordRandomness,
    step: int,
    size: int,
    device: torch.device,
) -> Any:
    """The logical batch as lazily built micro-batches, so K-copy inputs (K noises, crops, flips per
    example) exist for one micro-batch at a time rather than for a logical batch of thousands."""

    def build(chunk: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in make_batch(chunk, randomness.draws(step, chunk)).items()}

    if len(indices) == 0:  # an empty Poisson batch still takes a (noise-only) step
        return build(indices)
    return (build(chunk) for chunk in indices.split(size))


def _resume(ctx: Any, engine: Any, scheduler: Any, mechanism: str) -> int:
    """Restore engine and scheduler from the last checkpoint of this phase; return the next step.

    The step comes from :meth:`~dpsynth.contract.RunContext.resume`, the contract's one check of the ledger
    against the checkpoint: a run killed after a step was charged but before it was checkpointed continues at
    the ledger's count, so that step stays spent and is not taken again. Under torchrun rank 0 reads the
    checkpoint and hands it to the others: the state holds nothing that depends on the world size, so a run
    may resume with a different number of processes.
    """
    from dpsynth.dpsgd.distributed import from_main

    start, state = from_main(lambda: ctx.resume(mechanism, phase=mechanism))
    if state:
        engine.load_state_dict(state["engine"])
        if scheduler is not None and state.get("scheduler"):
            scheduler.load_state_dict(state["scheduler"])
    engine.steps = int(start)  # a record's draws are keyed on the step: the next one is step `start`
    return int(start)
