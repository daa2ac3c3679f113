"""The base for every component's config model."""

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Frozen, typo-proof config: unknown keys are errors, defaults are validated."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        use_attribute_docstrings=True,
    )


def submodel(annotation: Any) -> type[StrictModel] | None:
    """The config section a field's annotation holds (`Section` or `Section | None`), or
    None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, StrictModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(found) == 1:
            return submodel(found[0])
    return None
