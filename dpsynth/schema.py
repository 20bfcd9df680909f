"""The base of every config section schema (common sections and each method's own)."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
from pydantic.fields import FieldInfo


def _betas_in_unit_interval(betas: list[float]) -> list[float]:
    if not all(0 <= beta < 1 for beta in betas):
        raise ValueError(f"betas must lie in [0, 1), got {betas}")
    return betas


#: Adam's (beta1, beta2), each in [0, 1): a field type for every section with an Adam optimiser.
AdamBetas = Annotated[
    list[float], pydantic.Field(min_length=2, max_length=2), pydantic.AfterValidator(_betas_in_unit_interval)
]


class Section(pydantic.BaseModel):
    """A config section: unknown keys are errors, and defaults are validated like given values."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_default=True)


def with_defaults(base: type[pydantic.BaseModel], name: str, doc: str, **defaults: Any) -> type[pydantic.BaseModel]:
    """A subclass of ``base`` whose fields keep their types, ranges and descriptions but take new defaults.

    Methods that share a section layout (the diffusion methods) differ mostly in defaults; this
    keeps each key documented once.
    """
    fields: dict[str, Any] = {}
    for key, value in defaults.items():
        if key not in base.model_fields:
            raise TypeError(f"{base.__name__} has no field {key!r}")
        info = FieldInfo.merge_field_infos(base.model_fields[key], default=value)
        fields[key] = (base.model_fields[key].annotation, info)
    model = pydantic.create_model(name, __base__=base, __doc__=doc, **fields)
    return model
