"""The run's privacy ledger: every read of private data, composed against a fixed budget.

docs/contract.md, privacy rules 1-2: every mechanism that touches private examples is recorded here; the
budget ``(target_epsilon, delta)`` is fixed up front; a mechanism that would push the composed
epsilon past the target is refused before it runs (a hard stop); ``--resume`` restores the ledger
from the run directory's ``ledger.json`` (:meth:`PrivacyLedger.state_dict`, see :mod:`dpsynth.rundir`)
so steps are neither forgotten nor counted twice.

Two kinds of entries:

- one-off mechanisms, added with :meth:`PrivacyLedger.charge` (a histogram, statistics, a noisy
  validation pass); charging the same name again with the same parameters adds repeats;
- repeated mechanisms, declared with :meth:`PrivacyLedger.register` at zero steps and advanced with
  :meth:`PrivacyLedger.spend` (DP-SGD). ``spend`` compares against :meth:`max_steps`, computed once
  per state of the *other* mechanisms, so a training step costs a dictionary look-up.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dp_accounting import dp_event as dpe

from dpsynth.errors import BudgetExceededError, PrivacyError
from dpsynth.privacy.accountants import DELTA_ERROR_FRACTION, EPS_ERROR, check_accountant, compute_epsilon
from dpsynth.privacy.calibration import calibrate_noise
from dpsynth.privacy.dp_event_json import FORMAT as DP_EVENT_FORMAT
from dpsynth.privacy.dp_event_json import event_to_json
from dpsynth.privacy.mechanisms import (
    MECHANISM_TYPES,
    Mechanism,
    ShardSampledGaussian,
    canonical_composition,
    check_count,
    check_delta,
    check_positive,
    composed_dp_event,
    mechanism_from_dict,
)

GUARANTEES = ("dp", "none")
STATE_FORMAT = "dpsynth.privacy_ledger/1"
NO_GUARANTEE_NOTE = (
    "No differential privacy guarantee holds for this run: it used an explicitly unsound opt-in "
    "(e.g. DPPM's randomized-response training, whose loss reads every private image without "
    "clipping or noise). The mechanisms below are listed for transparency only."
)
# The one policy every method follows (docs/privacy.md, "Trust boundary"): the private dataset's size
# sets DP-SGD's sample rate q = B / N and appears in the log, so it is released exactly. Nothing else
# derived from the private data (per-class counts, pixel ranges, the class count) is covered by this. The
# second: the declared data format is public and neighbouring datasets are taken within it, which is what
# makes the loaders' remaining refusals harmless (docs/privacy.md, "Refusals that depend on the data").
ASSUMPTIONS = (
    (
        "the private dataset size N is public (it sets the sample rate q = B/N and is released exactly); "
        "no other quantity derived from the private data, per-class counts included, is assumed public"
    ),
    (
        "the private data's declared format is public and every record conforms to it: images of the declared "
        "shape (or resized to data.image_size), decodable files, labels in the declared classes, pixel values in "
        "the declared pixel_range, none identical to a public image (unless data.allow_overlap); neighbouring "
        "datasets are taken within that format, so a run refused for a record outside it reveals nothing about "
        "conforming data. A declared class with no training record is not refused"
    ),
)
# What the dp_event record is a guarantee about (privacy.json's "neighbouring"; docs/privacy.md, "The
# machine-readable record"). Same policy as ASSUMPTIONS: N is public for every method.
NEIGHBOURING = {
    "relation": "add/remove one record",
    "dp_accounting_relation": "ADD_OR_REMOVE_ONE",
    "record": "one private training example (an image with its label)",
    "dataset_size_public": True,
    "dataset_size_note": (
        "the private dataset size N is assumed public: DP-SGD's Poisson sample rate is q = B/N and its "
        "noisy gradient sum is divided by the expected batch size qN = B, a public constant, never by "
        "the realised batch size; any other count that enters a released value is its own mechanism"
    ),
}
# privacy.json's "neighbouring" gains this entry when a shard-sampled Gaussian (GS-WGAN) is recorded: what its
# shard steps sample, and how the record-level add/remove guarantee is accounted through them. The text never
# names a record-level relation other than add/remove (tests/privacy/test_shard_sampled.py): a change of one
# record's content can move it to another shard, so only add/remove maps to a change of ONE shard's contents.
SHARD_SAMPLING = (
    "the record-level guarantee is add/remove one record. Each shard step in dp_event (sample size 1 of K) is "
    "a uniform draw of one of K shards of a fixed partition of the private records by a function of each "
    "record's content (K public, independent of N), and a Gaussian on a block computed from the drawn shard "
    "alone. Adding or removing one record changes the contents of exactly one shard and moves no other record, "
    "so a record-level add/remove neighbour is a change of one shard's contents. The shard steps are accounted "
    "by dp_accounting's RDP bound for a uniform draw of one of K shards over any change of one shard's contents "
    "(a relation between the K shards, used as an accounting device only), and their RDP curve is added order "
    "by order to the ADD_OR_REMOVE_ONE curve of the other events"
)
_ACCOUNTANT_NAMES = {"prv": "PRV accountant (Gopi et al. 2021), upper bound", "rdp": "RDP accountant (Mironov 2017)"}


class PrivacyLedger:
    """Records and composes every private mechanism of one run against a fixed budget.

    Args:
        target_epsilon: the budget; composed epsilon never exceeds it. Optional when
            ``guarantee="none"``.
        delta: the delta of the guarantee, in (0, 1).
        accountant: ``"prv"`` (default) or ``"rdp"``.
        guarantee: ``"dp"``, or ``"none"`` for an explicit unsound opt-in: the ledger then records
            without enforcing a budget and never states an epsilon.
    """

    def __init__(
        self, target_epsilon: float | None, delta: float, accountant: str = "prv", guarantee: str = "dp"
    ) -> None:
        if guarantee not in GUARANTEES:
            raise PrivacyError(f"guarantee must be one of {', '.join(GUARANTEES)}, got {guarantee!r}")
        if guarantee == "dp" or target_epsilon is not None:
            target_epsilon = check_positive(target_epsilon, "target epsilon")
        self.target_epsilon = target_epsilon
        self.delta = check_delta(delta)
        self.notes: list[str] = []
        self.accountant = check_accountant(accountant)
        self.guarantee = guarantee
        self._mechanisms: dict[str, Mechanism] = {}
        self._repeated: set[str] = set()
        self._max_steps_cache: dict[str, tuple[tuple, int]] = {}
        self._planned: dict[str, int] = {}
        self._planned_fits: dict[str, tuple[tuple, bool]] = {}  # per state of the others, like max_steps

    # ------------------------------------------------------------------------------ recording

    def charge(self, mechanism: Mechanism) -> float | None:
        """Record a one-off mechanism (or more repeats of one); return the new total epsilon.

        Raises BudgetExceededError, recording nothing, if the total would pass the target.
        """
        _check_mechanism(mechanism)
        check_count(mechanism.repeats, f"repeats of '{mechanism.name}'", minimum=1)
        name = mechanism.name
        if name in self._repeated:
            raise PrivacyError(f"'{name}' is a registered repeated mechanism; advance it with spend()")
        if name in self._mechanisms:
            existing = self._mechanisms[name]
            _check_same_parameters(existing, mechanism)
            mechanism = existing.with_repeats(existing.repeats + mechanism.repeats)
        if self.guarantee == "dp":
            total = self._epsilon_with(mechanism)
            if total > self.target_epsilon:
                raise BudgetExceededError(
                    f"privacy budget exceeded: charging '{name}' would bring epsilon to {total:.4g}, "
                    f"past the target {self.target_epsilon:g} (delta={self.delta:g})"
                )
        self._mechanisms[name] = mechanism
        return self.epsilon()

    def register(self, mechanism: Mechanism, planned: int | None = None) -> None:
        """Declare a repeated mechanism at zero steps; advance it with :meth:`spend`.

        Registering again with the same parameters (e.g. after ``load_state_dict`` on resume) keeps
        the steps already recorded. ``planned``, the steps the caller means to take in all, only saves
        work: while that many fit the budget (one epsilon, already cached when the plan was calibrated
        to it), :meth:`spend` up to it needs no search for the exact step limit.
        """
        _check_mechanism(mechanism)
        name = mechanism.name
        if planned is not None:
            planned = check_count(planned, f"planned steps of '{name}'", minimum=1)
        if name in self._mechanisms:
            if name not in self._repeated:
                raise PrivacyError(f"'{name}' is already recorded as a one-off mechanism")
            _check_same_parameters(self._mechanisms[name], mechanism)
        elif mechanism.repeats != 0:
            raise PrivacyError(f"register '{name}' with zero steps; spend() then records each step")
        else:
            self._mechanisms[name] = mechanism
            self._repeated.add(name)
        if planned is not None:
            self._planned[name] = planned

    def spend(self, name: str, steps: int = 1) -> None:
        """Record ``steps`` more applications of registered mechanism ``name``.

        Raises BudgetExceededError, recording nothing, if they would pass the budget: training
        stops hard at the budget.
        """
        mechanism = self._registered(name)
        steps = check_count(steps, "steps", minimum=1)
        done = mechanism.repeats
        if self.guarantee == "dp" and not self._within_planned(name, done + steps):
            limit = self.max_steps(name)
            if done + steps > limit:
                raise BudgetExceededError(
                    f"privacy budget exhausted: '{name}' may run {limit} steps within epsilon="
                    f"{self.target_epsilon:g} (delta={self.delta:g}); refusing steps {done + 1}..{done + steps}"
                )
        self._mechanisms[name] = mechanism.with_repeats(done + steps)

    # ------------------------------------------------------------------------------ queries

    def max_steps(self, name: str) -> int:
        """Largest total step count of ``name`` that keeps the composition within the target.

        Cached per state of the other mechanisms, so it is recomputed only when they change.
        """
        mechanism = self._registered(name)
        if self.guarantee != "dp":
            raise PrivacyError("a ledger with guarantee 'none' has no budget, hence no step limit")
        others = self._others(name)
        key = (mechanism.with_repeats(0), canonical_composition(others))
        cached = self._max_steps_cache.get(name)
        if cached is None or cached[0] != key:
            cached = (key, self._search_max_steps(mechanism, others))
            self._max_steps_cache[name] = cached
        return cached[1]

    def epsilon(self) -> float | None:
        """Composed epsilon of everything recorded so far; None under guarantee 'none'."""
        if self.guarantee != "dp":
            return None
        return compute_epsilon(self._mechanisms.values(), self.delta, self.accountant)

    def dp_event(self) -> dpe.ComposedDpEvent:
        """The run's composition as one dp_accounting ``ComposedDpEvent`` (every mechanism's ``dp_event()``).

        Under guarantee 'none' a ``NonPrivateDpEvent`` comes first: the run did something no event
        describes, so no accountant may certify an epsilon for it.
        """
        composed = composed_dp_event(self._mechanisms.values())
        if self.guarantee != "dp":
            return dpe.ComposedDpEvent([dpe.NonPrivateDpEvent(), *composed.events])
        return composed

    def remaining_epsilon(self) -> float | None:
        """Target minus the epsilon spent so far (None under guarantee 'none')."""
        spent = self.epsilon()
        return None if spent is None else self.target_epsilon - spent

    def note(self, text: str) -> None:
        """Attach a plain-language note to ``privacy.json`` (e.g. where a paper's claim was unsound and
        the sound version was implemented instead); kept in checkpoints, stated once."""
        if text not in self.notes:
            self.notes.append(text)

    def mechanisms(self) -> list[Mechanism]:
        """All recorded mechanisms, in the order they were first recorded."""
        return list(self._mechanisms.values())

    def calibrate(self, sample_rate: float, steps: int) -> float:
        """Noise multiplier for ``steps`` DP-SGD steps that spend what the recorded mechanisms left."""
        if self.guarantee != "dp":
            raise PrivacyError("a ledger with guarantee 'none' has no budget to calibrate against")
        return calibrate_noise(
            self.target_epsilon, self.delta, sample_rate, steps, prior=self.mechanisms(), accountant=self.accountant
        )

    def check_delta(self, num_examples: int) -> str | None:
        """Warn, and return the warning, when delta >= 1/n for a private dataset of n examples."""
        num_examples = check_count(num_examples, "dataset size", minimum=1)
        if self.delta < 1.0 / num_examples:
            return None
        message = (
            f"delta={self.delta:g} is not below 1/n={1.0 / num_examples:.3g} for n={num_examples} "
            f"private examples: a mechanism that publishes one random example would meet it"
        )
        warnings.warn(message, stacklevel=2)
        return message

    # ------------------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Plain-data state for checkpoints (JSON-serialisable)."""
        return {
            "format": STATE_FORMAT,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "guarantee": self.guarantee,
            "mechanisms": [m.to_dict() for m in self._mechanisms.values()],
            "repeated": sorted(self._repeated),
            "notes": list(self.notes),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a checkpointed ledger: same budget, same mechanisms and step counts.

        Must be called before anything is charged or spent in this ledger (so nothing is counted
        twice); mechanisms registered already must match the checkpoint's parameters.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise PrivacyError("not a privacy ledger state (format mismatch)")
        for field in ("target_epsilon", "delta", "accountant", "guarantee"):
            if state[field] != getattr(self, field):
                raise PrivacyError(
                    f"the checkpoint's ledger has {field}={state[field]!r} but this run has "
                    f"{getattr(self, field)!r}; a resumed run must keep its budget"
                )
        if any(m.repeats > 0 for m in self._mechanisms.values()):
            raise PrivacyError("load the ledger state before charging or spending anything")
        restored = {record["name"]: mechanism_from_dict(record) for record in state["mechanisms"]}
        for name, mechanism in self._mechanisms.items():
            if name in restored:
                _check_same_parameters(restored[name], mechanism)
        repeated = set(state["repeated"]) | self._repeated
        for name, mechanism in self._mechanisms.items():
            restored.setdefault(name, mechanism)
        self._mechanisms = restored
        self._repeated = repeated
        self._max_steps_cache.clear()
        self._planned_fits.clear()
        for text in state.get("notes", ()):
            self.note(text)

    def to_json(self) -> dict:
        """The ``privacy.json`` object (docs/contract.md, interface contract) with a human statement."""
        record: dict[str, Any] = {
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "accountant": self.accountant,
            "guarantee": self.guarantee,
            "target_epsilon": self.target_epsilon,
            "adjacency": "add/remove one example",
            "assumptions": list(ASSUMPTIONS),
            "mechanisms": [m.to_dict() for m in self._mechanisms.values()],
            "dp_event_format": DP_EVENT_FORMAT,
            "dp_event": event_to_json(self.dp_event()),
            "neighbouring": dict(NEIGHBOURING),
        }
        if any(isinstance(m, ShardSampledGaussian) and m.num_shards > 1 for m in self._mechanisms.values()):
            record["neighbouring"]["shard_sampling"] = SHARD_SAMPLING
        if self.accountant == "prv":
            record["accountant_error"] = {"epsilon": EPS_ERROR, "delta_fraction": DELTA_ERROR_FRACTION}
        if self.guarantee == "none":
            record["note"] = NO_GUARANTEE_NOTE
        if self.notes:
            record["notes"] = list(self.notes)
        record["statement"] = self._statement(record["epsilon"])
        return record

    def write(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` atomically (temporary file, then ``os.replace``)."""
        from dpsynth.checkpoint import atomic_write_json

        atomic_write_json(path, self.to_json())
        return Path(path)

    # ------------------------------------------------------------------------------ internals

    def _registered(self, name: str) -> Mechanism:
        if name not in self._repeated:
            raise PrivacyError(f"unknown repeated mechanism '{name}'; register() it first")
        return self._mechanisms[name]

    def _epsilon_with(self, mechanism: Mechanism) -> float:
        mechanisms = dict(self._mechanisms)
        mechanisms[mechanism.name] = mechanism
        return compute_epsilon(mechanisms.values(), self.delta, self.accountant)

    def _within_planned(self, name: str, total: int) -> bool:
        """Whether ``total`` steps of ``name`` are at most its planned count and that count fits the budget with
        the other mechanisms as they are now (epsilon grows with the steps, as the exact search assumes too)."""
        planned = self._planned.get(name)
        if planned is None or total > planned:
            return False
        key = (self._mechanisms[name].with_repeats(planned), canonical_composition(self._others(name)))
        cached = self._planned_fits.get(name)
        if cached is None or cached[0] != key:
            cached = self._planned_fits[name] = (key, self._epsilon_with(key[0]) <= self.target_epsilon)
        return cached[1]

    def _others(self, name: str) -> tuple[Mechanism, ...]:
        """Every recorded mechanism but ``name``: the state the step-limit caches are kept for."""
        return tuple(m for other, m in self._mechanisms.items() if other != name)

    def _search_max_steps(self, mechanism: Mechanism, others: tuple[Mechanism, ...]) -> int:
        """Largest n with epsilon(others + mechanism x n) <= target.

        RDP (cheap) gives a first guess, then the ledger's own accountant finishes the search, so
        that only a handful of PRV grids are built.
        """

        def epsilon_for(accountant: str):
            def epsilon(steps: int) -> float:
                composition = others + (mechanism.with_repeats(steps),)
                return compute_epsilon(composition, self.delta, accountant)

            return epsilon

        start = mechanism.repeats
        accountant_epsilon = epsilon_for(self.accountant)
        if accountant_epsilon(start) > self.target_epsilon:
            return start  # already at (or, after a changed prior, past) the budget: no more steps
        guess = None
        if self.accountant != "rdp" and epsilon_for("rdp")(start) <= self.target_epsilon:
            guess = _largest_fitting(epsilon_for("rdp"), self.target_epsilon, start)
        return _largest_fitting(accountant_epsilon, self.target_epsilon, start, guess)

    def _statement(self, epsilon: float | None) -> str:
        names = ", ".join(f"{m.name} ({m.kind} x{m.repeats})" for m in self._mechanisms.values()) or "nothing"
        if self.guarantee == "none":
            return f"No differential privacy guarantee (explicit unsound opt-in). Recorded mechanisms: {names}."
        return (
            f"({epsilon:.4g}, {self.delta:g})-DP under add/remove-one adjacency, within the target "
            f"epsilon {self.target_epsilon:g}; composed by the {_ACCOUNTANT_NAMES[self.accountant]} "
            f"over: {names}."
        )


_STEP_LIMIT = 2**40  # beyond this many steps a mechanism is practically unlimited


def _largest_fitting(epsilon: Callable[[int], float], target: float, start: int, guess: int | None = None) -> int:
    """Largest n >= start with epsilon(n) <= target, for epsilon increasing in n; epsilon(start) fits.

    Until the answer is bracketed, steps extrapolate with epsilon - epsilon(0) ~ sqrt(n) (the
    composition of many subsampled Gaussians); inside the bracket, linear interpolation aimed at
    the target, with a bisection whenever the same end moved twice in a row.
    """
    floor = epsilon(0)
    low, epsilon_low = start, epsilon(start)
    high, epsilon_high = None, math.inf
    probe = guess if guess is not None and guess > start else max(1, 2 * start)
    moved = []
    while high is None or high - low > 1:
        probe = min(max(probe, low + 1), _STEP_LIMIT if high is None else high - 1)
        value = epsilon(probe)
        if value <= target:
            low, epsilon_low = probe, value
            moved.append("low")
            if low >= _STEP_LIMIT:
                return low
        else:
            high, epsilon_high = probe, value
            moved.append("high")
        if high is None:
            growth = (target - floor) / max(epsilon_low - floor, 1e-12)
            probe = max(low + 1, int(low * min(growth**2, 1e6) * 1.01) + 1)
        elif len(moved) >= 2 and moved[-1] == moved[-2]:
            probe = (low + high) // 2
        else:
            fraction = (target - epsilon_low) / (epsilon_high - epsilon_low)
            probe = low + int(fraction * (high - low))
    return low


def _check_mechanism(mechanism: Any) -> None:
    if not isinstance(mechanism, MECHANISM_TYPES):
        raise PrivacyError(f"not a privacy mechanism: {mechanism!r}")


def _check_same_parameters(existing: Mechanism, new: Mechanism) -> None:
    if existing.with_repeats(0) != new.with_repeats(0):
        raise PrivacyError(
            f"mechanism '{new.name}' is already recorded with other parameters ({existing.to_dict()}); use a new name"
        )
