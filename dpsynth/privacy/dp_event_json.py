"""``dp_accounting`` ``DpEvent`` to and from plain JSON: the machine-readable record in ``privacy.json``.

An event is one JSON object: ``{"type": <DpEvent class name>, <field>: <value>, ...}`` with exactly the
fields of that ``dp_accounting.dp_event`` class; a field that holds an event holds such an object, a
field that holds events a list of them. Only the classes in :data:`FIELDS` are written or read, and
each field is type-checked when read, so a record names nothing but plain numbers and these classes
(no pickle, no import by name). Example, 69 DP-SGD steps after one histogram::

    {"type": "ComposedDpEvent", "events": [
      {"type": "SelfComposedDpEvent", "count": 1, "event": {"type": "GaussianDpEvent", "noise_multiplier": 10.0}},
      {"type": "SelfComposedDpEvent", "count": 69, "event": {"type": "PoissonSampledDpEvent",
        "sampling_probability": 0.05, "event": {"type": "GaussianDpEvent", "noise_multiplier": 2.0}}}]}
"""

from __future__ import annotations

import math
from typing import Any

from dp_accounting import dp_event as dpe

from dpsynth.errors import PrivacyError

#: Format of the record, stated beside it in ``privacy.json`` (``dp_event_format``).
FORMAT = "dpsynth.dp_event/1"

# Each class written or read, with its fields and their kinds: "float", "int", "event" or "events".
FIELDS: dict[str, tuple[type, tuple[tuple[str, str], ...]]] = {
    "NoOpDpEvent": (dpe.NoOpDpEvent, ()),
    "NonPrivateDpEvent": (dpe.NonPrivateDpEvent, ()),
    "UnsupportedDpEvent": (dpe.UnsupportedDpEvent, ()),
    "GaussianDpEvent": (dpe.GaussianDpEvent, (("noise_multiplier", "float"),)),
    "LaplaceDpEvent": (dpe.LaplaceDpEvent, (("noise_multiplier", "float"),)),
    "RandomizedResponseDpEvent": (
        dpe.RandomizedResponseDpEvent,
        (("noise_parameter", "float"), ("num_buckets", "int")),
    ),
    "PoissonSampledDpEvent": (dpe.PoissonSampledDpEvent, (("sampling_probability", "float"), ("event", "event"))),
    "SampledWithoutReplacementDpEvent": (
        dpe.SampledWithoutReplacementDpEvent,
        (("source_dataset_size", "int"), ("sample_size", "int"), ("event", "event")),
    ),
    "SelfComposedDpEvent": (dpe.SelfComposedDpEvent, (("event", "event"), ("count", "int"))),
    "ComposedDpEvent": (dpe.ComposedDpEvent, (("events", "events"),)),
}
_NAMES = {cls: name for name, (cls, _) in FIELDS.items()}


def event_to_json(event: dpe.DpEvent) -> dict[str, Any]:
    """The JSON object of ``event`` (see the module docstring); refuses a class not in :data:`FIELDS`."""
    name = _NAMES.get(type(event))
    if name is None:
        raise PrivacyError(f"cannot record {type(event).__name__} in privacy.json")
    record: dict[str, Any] = {"type": name}
    for field, kind in FIELDS[name][1]:
        value = getattr(event, field)
        if kind == "event":
            value = event_to_json(value)
        elif kind == "events":
            value = [event_to_json(item) for item in value]
        elif kind == "int":
            value = int(value)
        else:
            value = float(value)
        record[field] = value
    return record


def event_from_json(record: Any) -> dpe.DpEvent:
    """The ``DpEvent`` of a JSON object written by :func:`event_to_json`; PrivacyError when malformed."""
    if not isinstance(record, dict) or record.get("type") not in FIELDS:
        kind = record.get("type") if isinstance(record, dict) else type(record).__name__
        raise PrivacyError(f"not a recorded dp_accounting event: {kind!r}")
    name = record["type"]
    cls, fields = FIELDS[name]
    expected = {"type"} | {field for field, _ in fields}
    if set(record) != expected:
        raise PrivacyError(f"{name} record has fields {sorted(record)}, expected {sorted(expected)}")
    values = {field: _read(name, field, kind, record[field]) for field, kind in fields}
    return cls(**values)


def _read(name: str, field: str, kind: str, value: Any) -> Any:
    if kind == "event":
        return event_from_json(value)
    if kind == "events":
        if not isinstance(value, list):
            raise PrivacyError(f"{name}.{field} must be a list of events, got {value!r}")
        return [event_from_json(item) for item in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PrivacyError(f"{name}.{field} must be a number, got {value!r}")
    if kind == "int":
        if isinstance(value, float) or value < 0:
            raise PrivacyError(f"{name}.{field} must be an integer >= 0, got {value!r}")
        return int(value)
    if not math.isfinite(value):
        raise PrivacyError(f"{name}.{field} must be finite, got {value!r}")
    return float(value)
