"""The base for every component's config model."""

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Frozen, typo-proof config: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        use_attribute_docstrings=True,
    )
