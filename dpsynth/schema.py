"""The base of every config section schema (common sections and each method's own)."""

from __future__ import annotations

import pydantic


class Section(pydantic.BaseModel):
    """A config section: unknown keys are errors, and defaults are validated like given values."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_default=True)
