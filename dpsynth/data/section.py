"""The ``data`` section of a run config: which datasets, which splits, which preprocessing.

Declared here, beside the loaders that read it, so that the data layer takes the typed section
(:func:`dpsynth.data.loading.load_for_run`) and the config module composes it without restating it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import pydantic
from pydantic import Field

from dpsynth.schema import Section


class DataSection(Section):
    private: str = Field(
        "mnist10k", description="private dataset: a registered name or a path (.npz, image folder, ...)"
    )
    public: str | None = Field(None, description="public dataset (registered name or path), free to use; null: none")
    image_size: int | None = Field(
        None, ge=1, description="resize/centre-crop to this size; null keeps the native size"
    )
    channels: Literal[1, 3] | None = Field(None, description="1 or 3 channels; null keeps the native channels")
    val_size: int | float | None = Field(
        None, gt=0, description="validation hold-out (count or fraction); null: the dataset's documented split"
    )
    split_seed: int = Field(
        0, ge=0, description="key of the hold-out draws; each record's draw hashes this key with its own content"
    )
    max_train: int | float | None = Field(
        None, gt=0, description="train records kept: an expected count (registered datasets) or a fraction"
    )
    max_public: int | None = Field(None, ge=1, description="cap on the number of public examples")
    num_classes: int | None = Field(
        None, ge=1, description="class count when the private source declares none (never inferred from labels)"
    )
    class_names: list[str] | None = Field(
        None,
        min_length=1,
        description="class names in label order, when the private source names none (dataset.yaml 'classes')",
    )
    pixel_range: list[float] | None = Field(
        None, description="[low, high] of float .npz pixels, e.g. [0, 1]; integer formats are 0..255"
    )
    colour_to_grey: bool = Field(
        False, description="with channels 1, turn stored colour images into grey (BT.601); false: that is an error"
    )
    allow_overlap: bool = Field(False, description="proceed when private images also appear in the public set")

    @pydantic.model_validator(mode="after")
    def _names_match_count(self) -> DataSection:
        if self.class_names is not None and self.num_classes is not None and len(self.class_names) != self.num_classes:
            raise ValueError(
                f"config key 'data.class_names' names {len(self.class_names)} classes but data.num_classes is "
                f"{self.num_classes}; make them agree (or drop one)"
            )
        return self

    @pydantic.field_validator("pixel_range")
    @classmethod
    def _ordered_range(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (len(value) != 2 or not value[0] < value[1]):
            raise ValueError(f"pixel_range must be [low, high] with low < high, got {list(value)}")
        return value


def as_data_section(data: DataSection | Mapping[str, Any]) -> DataSection:
    """``data`` as a validated :class:`DataSection` (a plain mapping is validated, defaults filled in)."""
    return data if isinstance(data, DataSection) else DataSection.model_validate(dict(data))
