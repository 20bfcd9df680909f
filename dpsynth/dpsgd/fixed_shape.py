"""The private step at a fixed shape: Poisson sampling on the device, packed into a masked buffer of
``capacity`` rows, so the whole step (sampling, gathering, per-record draws, clipped sum, noise, optimizer
and EMA) has the same tensor shapes every step and no host synchronisation, and can be captured once as a
CUDA graph and replayed (docs/architecture.md, "The fixed-shape step").

Privacy argument (Abadi et al., arXiv:1607.00133, Algorithm 1; the Poisson-subsampled Gaussian of
Mironov et al., arXiv:1908.10530):

- every record is included independently with probability q by one coin drawn on the device from a
  generator seeded from OS entropy (the run's DP :class:`~dpsynth.privacy.rng.NoiseSource`), never the
  published seed;
- the included rows are packed, in dataset order, into the first ``count`` of ``capacity`` slots; the
  other slots hold record 0 with mask 0. A masked row's loss is multiplied by 0, so its gradient, its norm
  and its clipped contribution are exactly zero for every per-example strategy: the clipped sum is the sum
  over the realised records alone, and adding or removing one record moves it by at most C;
- ``capacity`` is the smallest B_max with ``P(Binomial(N, q) > B_max) < 1e-9`` (:func:`poisson_capacity`,
  the exact binomial tail; N and q are public). A step whose sample overflows it is never truncated (which
  would break the subsampling analysis): it is taken by the exact, uncaptured path over all its records,
  and charged the same ledger entry;
- per-record randomness comes from :class:`~dpsynth.privacy.device_draws.DeviceRecordDraws`, bit for bit
  the host's ``RecordDraws``: a function of the secret key, the step, the content key and the call index.

The ledger is charged from the host before each step (a count; no device value is read). Deciding between
the captured and the exact path reads one device boolean, the overflow flag of the coins, which depends
on the coins alone and not on any record.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import torch

from dpsynth.dpsgd.per_example import Example, LossFn, PerExampleGradients, clip_scales, zeros_like_all
from dpsynth.dpsgd.precision import no_tf32
from dpsynth.errors import PrivacyError

#: The overflow probability per step that :func:`poisson_capacity` stays below.
OVERFLOW_PROBABILITY = 1e-9
#: The batch key that carries the 0/1 row mask through the per-example loss.
MASK = "fixed_shape_mask"


def poisson_capacity(num_examples: int, sample_rate: float, overflow: float = OVERFLOW_PROBABILITY) -> int:
    """The smallest ``B_max`` with ``P(Binomial(N, q) > B_max) < overflow``, from the exact binomial tail
    (``scipy.stats.binom.sf``); at most N. For N = 60,000 and q = 256/60,000 it is 357 (qN + 6.2 sd)."""
    from scipy.stats import binom

    if num_examples < 1 or not 0.0 < sample_rate <= 1.0:
        raise PrivacyError(f"need N >= 1 and q in (0, 1], got N={num_examples}, q={sample_rate}")
    if sample_rate >= 1.0:
        return int(num_examples)
    capacity = max(int(binom.isf(overflow, num_examples, sample_rate)), 0)
    while capacity < num_examples and binom.sf(capacity, num_examples, sample_rate) >= overflow:
        capacity += 1
    while capacity > 0 and binom.sf(capacity - 1, num_examples, sample_rate) < overflow:
        capacity -= 1
    return max(1, min(capacity, int(num_examples)))


@dataclasses.dataclass
class FixedBatch:
    """A Poisson sample packed at a fixed shape, all on the device: ``indices`` and ``mask`` ``[capacity]``
    (realised records first, in dataset order; padding is record 0 with mask 0), ``count`` the realised
    size and ``overflow`` whether it exceeded the capacity (0-d tensors; reading them is the caller's choice)."""

    indices: torch.Tensor
    mask: torch.Tensor
    count: torch.Tensor
    overflow: torch.Tensor


def pack_included(included: torch.Tensor, capacity: int) -> FixedBatch:
    """Pack the ``True`` positions of ``included`` ``[N]`` into ``capacity`` slots without a host sync
    (a cumulative sum gives each included record its slot; the rest, and any overflow, go to a dump slot)."""
    n = included.shape[0]
    position = torch.cumsum(included.to(torch.int64), 0) - 1
    count = position[-1] + 1 if n else torch.zeros((), dtype=torch.int64, device=included.device)
    slot = torch.where(included & (position < capacity), position, torch.full_like(position, capacity))
    packed = torch.zeros(capacity + 1, dtype=torch.int64, device=included.device)
    packed.scatter_(0, slot, torch.arange(n, dtype=torch.int64, device=included.device))
    mask = torch.arange(capacity, device=included.device) < count
    indices = torch.where(mask, packed[:capacity], torch.zeros((), dtype=torch.int64, device=included.device))
    return FixedBatch(indices=indices, mask=mask, count=count, overflow=count > capacity)


class DevicePoissonSampler:
    """Poisson sampling on the device: one float64 coin per record from ``generator`` (entropy-seeded:
    :meth:`dpsynth.privacy.rng.NoiseSource.generator`), included when below q, packed by :func:`pack_included`.

    Args:
        num_examples: N, the private records (or this process's shard of them) resident on ``device``.
        sample_rate: q.
        generator: a torch generator on ``device``.
        capacity: B_max; default :func:`poisson_capacity`.
    """

    def __init__(
        self,
        num_examples: int,
        sample_rate: float,
        generator: torch.Generator,
        capacity: int | None = None,
    ) -> None:
        self.num_examples = int(num_examples)
        self.sample_rate = float(sample_rate)
        self.generator = generator
        self.capacity = poisson_capacity(num_examples, sample_rate) if capacity is None else int(capacity)

    def sample(self) -> FixedBatch:
        coins = torch.rand(
            self.num_examples, generator=self.generator, device=self.generator.device, dtype=torch.float64
        )
        # Kept for the exact path of an overflowing step (one vector of N booleans, overwritten each step).
        self.last_included = coins < self.sample_rate
        return pack_included(self.last_included, self.capacity)


def masked_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` times the example's mask (batch key :data:`MASK`): a masked row's gradient is exactly zero.

    An example without a mask is not a row of the fixed-shape buffer (a public batch the engine scores, e.g. the
    clip-norm probe on public data): its loss is ``loss_fn``'s."""

    @functools.wraps(loss_fn)
    def loss(model_call: Callable, example: Example) -> torch.Tensor:
        if MASK not in example:
            return loss_fn(model_call, example)
        rest = {key: value for key, value in example.items() if key != MASK}
        value = loss_fn(model_call, rest)
        return value * example[MASK].to(value.dtype)

    loss.differentiates_input = getattr(loss_fn, "differentiates_input", False)  # type: ignore[attr-defined]
    return loss


def masked_clipped_sum(
    per_example: PerExampleGradients,
    micro_batches: list[Example],
    max_grad_norm: float,
    per_layer: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``sum_i clip_C(g_i)`` over fixed-shape micro-batches (built with :func:`masked_loss`) without a host
    sync: examples with a NaN/Inf gradient or an unreliable ghost norm are zeroed by ``torch.where`` instead of
    by a data-dependent branch. Returns the sum and the count of dropped examples as a device tensor (a PRIVATE
    diagnostic, as :attr:`dpsynth.dpsgd.engine.DPSGDEngine.nonfinite_examples`)."""
    with no_tf32():
        params = per_example.trainable()
        constants = per_example.constants()
        total = zeros_like_all(params)
        dropped = torch.zeros((), dtype=torch.int64, device=next(iter(params.values())).device)
        for micro_batch in micro_batches:
            result = per_example.compute(micro_batch, params, constants)
            squared, bad = result.zero_nonfinite()
            dropped = dropped + bad
            result.add_weighted_sum(total, clip_scales(squared, max_grad_norm, per_layer))
    return total, dropped


def fixed_micro_batches(batch: Mapping[str, torch.Tensor], mask: torch.Tensor, size: int) -> list[Example]:
    """The fixed-shape batch with its mask, split into micro-batches of ``size`` rows (fixed shapes too)."""
    full = {**batch, MASK: mask}
    capacity = mask.shape[0]
    return [{key: value[start : start + size] for key, value in full.items()} for start in range(0, capacity, size)]


def graph_mode(setting: str | bool, device: torch.device | str) -> bool:
    """Whether the step is captured: ``auto`` only on CUDA (on the CPU a graph saves nothing and the fixed shape
    costs the padded rows), ``true`` wherever CUDA is (elsewhere the fixed-shape path runs uncaptured)."""
    if setting in ("false", False):
        return False
    if setting not in ("auto", "true", True):
        raise ValueError(f"graph must be auto, true or false, got {setting!r}")
    return torch.device(device).type == "cuda"


def step_form(
    graph: str | bool, device: torch.device | str, *, secure_rng: bool, world: int = 1, device_batch: bool = True
) -> tuple[bool, str]:
    """``(fixed, line)``: whether a DP-SGD step with these settings takes the fixed-shape path, and one public line
    saying how it runs and, where a graph was asked for and cannot be had, why. The dry run prints it at plan time
    (:mod:`dpsynth.dpsgd.estimate`); ``train_private`` logs it again when training starts."""
    asked = graph in (True, "true") or graph_mode(graph, device)
    if not asked:
        return False, "eager step (graph: false, or auto without CUDA)"
    if not device_batch:
        return False, "graph: this step runs eagerly: its batch builder reads host data (no device-side builder)"
    if secure_rng:
        return False, "graph: privacy.secure_rng draws the noise on the host: the step is not captured (runs eagerly)"
    if world > 1:
        return False, "graph: under torchrun the step runs eagerly (the fixed-shape step is single-process)"
    how = "captured as one CUDA graph" if graph_mode(graph, device) else "uncaptured (no CUDA)"
    return True, f"fixed-shape step, {how}"


def capacity_summary(num_examples: int, sample_rate: float) -> str:
    """One public line for the plan: B_max and its overflow bound."""
    capacity = poisson_capacity(num_examples, sample_rate)
    mean = num_examples * sample_rate
    spread = (capacity - mean) / max(math.sqrt(mean * (1 - sample_rate)), 1e-12)
    return (
        f"fixed-shape batch of {capacity} rows (qN={mean:.1f}, +{spread:.1f} sd);"
        f" P(overflow) < {OVERFLOW_PROBABILITY:g} per step, an overflowing step runs uncaptured over all its records"
    )


#: ``build(indices, draws)``: the per-example inputs of the records at the device positions ``indices``, from
#: device-resident data and device ops only; every random input from ``draws`` (a ``DeviceRecordDraws``).
DeviceBatchBuilder = Callable[[torch.Tensor, object], dict[str, torch.Tensor]]


class FixedShapeStep:
    """One private step of ``engine`` at a fixed shape, captured as a CUDA graph when ``capture`` is set.

    Args:
        engine: a :class:`~dpsynth.dpsgd.engine.DPSGDEngine` built with :func:`masked_loss` of the loss.
        randomness: the records' :class:`~dpsynth.privacy.device_draws.DeviceRecordRandomness`.
        build: a :data:`DeviceBatchBuilder` over the private records resident on the device.
        sampler: the :class:`DevicePoissonSampler` over ``data``.
        physical: rows per micro-batch.
        capture: replay one CUDA graph per clip norm (CUDA only); otherwise the same ops run eagerly.
    """

    def __init__(
        self,
        engine,
        randomness,
        build: DeviceBatchBuilder,
        sampler: DevicePoissonSampler,
        physical: int,
        capture: bool = False,
    ) -> None:
        if capture and engine.noise.secure:
            raise PrivacyError("privacy.secure_rng draws the noise on the host: that step is not captured")
        self.engine, self.randomness, self.build = engine, randomness, build
        self.sampler, self.physical, self.capture = sampler, int(physical), bool(capture)
        device = sampler.generator.device
        self.exact_steps = 0  # overflowing steps taken by the exact path (public: a function of the coins)
        self._step = torch.zeros((), dtype=torch.int64, device=device)
        self._ema_weight = torch.zeros((), dtype=torch.float32, device=device)
        self._graphs: dict[float, torch.cuda.CUDAGraph] = {}
        self._static: FixedBatch | None = None
        if self.capture:
            for group in engine.optimizer.param_groups:
                group["capturable"] = True
                group["lr"] = torch.tensor(float(group["lr"]), device=device)

    def __call__(self, max_grad_norm: float | None = None):
        """Sample, charge and take one step; returns the engine's :class:`~dpsynth.dpsgd.engine.StepStats`."""
        from dpsynth.dpsgd.engine import StepStats

        engine = self.engine
        clip = engine.max_grad_norm if max_grad_norm is None else float(max_grad_norm)
        batch = self.sampler.sample()
        if bool(batch.overflow):  # P < 1e-9: the exact path over every sampled record, never truncated
            self.exact_steps += 1
            return self._exact(batch, clip)
        engine._charge()  # from the host, before anything is computed: a count, no device value read
        self._step.fill_(engine.steps)
        if engine._ema is not None:
            self._ema_weight.fill_(1.0 - engine._ema.current_decay())
        if self.capture:
            self._replay(batch, clip)
        else:
            self._update(batch, clip)
        if engine._ema is not None:
            engine._ema.num_updates += 1
        engine.steps += 1
        return StepStats(
            step=engine.steps, max_grad_norm=clip, noise_std=engine.noise_multiplier * clip / engine.expected_batch_size
        )

    def _inputs(self, batch: FixedBatch) -> list[Example]:
        inputs = self.build(batch.indices, self.randomness.draws(self._step, batch.indices))
        return fixed_micro_batches(inputs, batch.mask.to(torch.float32), self.physical)

    def _update(self, batch: FixedBatch, clip: float) -> None:
        engine = self.engine
        summed, dropped = masked_clipped_sum(engine._per_example, self._inputs(batch), clip, engine.per_layer_clipping)
        self.dropped = dropped
        noisy = engine._add_noise(summed, clip)
        parameters = dict(engine.model.named_parameters())
        torch._foreach_div_(list(noisy.values()), engine.expected_batch_size)
        for name, total in noisy.items():
            parameters[name].grad = total
        engine.optimizer.step()
        if engine._ema is not None:  # the decay is read from a device scalar, so a replay uses the current one
            with torch.no_grad():
                ema = list(engine._ema.model.parameters())
                delta = torch._foreach_sub([p.detach() for p in engine.model.parameters()], ema)
                torch._foreach_mul_(delta, self._ema_weight)
                torch._foreach_add_(ema, delta)

    def _exact(self, batch: FixedBatch, clip: float):
        engine = self.engine
        indices = torch.nonzero(self.sampler.last_included).flatten()
        self._step.fill_(engine.steps)
        inputs = self.build(indices, self.randomness.draws(self._step, indices))
        inputs[MASK] = torch.ones(len(indices), device=indices.device)
        return engine.step(inputs, max_grad_norm=clip)

    def _replay(self, batch: FixedBatch, clip: float) -> None:
        if self._static is None:
            self._static = FixedBatch(*(t.clone() for t in dataclasses.astuple(batch)))
        for target, source in zip(dataclasses.astuple(self._static), dataclasses.astuple(batch)):
            target.copy_(source)
        if clip not in self._graphs:
            self._graphs[clip] = self._capture(clip)
        self._graphs[clip].replay()

    def _capture(self, clip: float) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (state restored in place afterwards: nothing of it is released), then capture."""
        engine = self.engine
        saved = _snapshot(engine)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._update(self._static, clip)
        torch.cuda.current_stream().wait_stream(side)
        _restore(engine, saved)
        graph = torch.cuda.CUDAGraph()
        generator = engine.noise._on(self.sampler.generator.device)
        graph.register_generator_state(generator)
        with torch.cuda.graph(graph):
            self._update(self._static, clip)
        return graph


def _snapshot(engine) -> dict[str, object]:
    ema = [p.detach().clone() for p in engine._ema.model.parameters()] if engine._ema is not None else []
    optimizer = {
        (id(param), key): value.clone()
        for param, state in engine.optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }
    return {"params": [p.detach().clone() for p in engine.model.parameters()], "ema": ema, "optimizer": optimizer}


def _restore(engine, saved: dict[str, object]) -> None:
    """Copy the snapshot back *in place* (the captured graph keeps the tensors' addresses); optimizer state
    created during the warm-up (absent from the snapshot) is zeroed, which is a fresh state (step 0)."""
    with torch.no_grad():
        for param, value in zip(engine.model.parameters(), saved["params"]):
            param.copy_(value)
        if engine._ema is not None:
            for param, value in zip(engine._ema.model.parameters(), saved["ema"]):
                param.copy_(value)
        for param, state in engine.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    old = saved["optimizer"].get((id(param), key))
                    value.copy_(old) if old is not None else value.zero_()
