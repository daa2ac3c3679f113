"""Config of the evaluation stage."""

import re
from typing import Any

from pydantic import Field, field_serializer, field_validator, model_validator

from trainflow.config_base import StrictModel

# Stricter than MLflow (which also allows spaces and most punctuation): these names travel in
# shell commands and in `models:/<name>@<alias>` URIs unquoted.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,255}$")
# MLflow's own alias rules: word characters and dashes; `latest` and `v<number>` are reserved.
_ALIAS = re.compile(r"^[A-Za-z0-9_\-]{1,255}$")
_VERSION_ALIAS = re.compile(r"^[vV]\d+$")


class EvaluateConfig(StrictModel):
    """How the best checkpoint is evaluated, logged and registered."""

    batch_size: int = Field(512, ge=1, le=65_536)
    """Samples per inference batch."""
    log_model: bool = True
    """Log the model to MLflow with signature, input example and pip requirements."""
    min_accuracy: float | None = Field(None, ge=0.0, le=1.0)
    """Fail the pipeline when test accuracy is below this (None: never fail)."""
    registered_model: str | None = "auto"
    """MLflow registered model that gets a new version per evaluated model. auto: a name of the
    model and the objective, `<model>-<objective>` (gpt2-sequence, mlp-regression,
    reference_cnn-classification; tasks.evaluate.naming); false (in a file or a --set; null
    too on the command line): do not register, kept as None. Registration needs a logged model:
    with log_model=false and this left at its default, nothing is registered; setting both
    explicitly is a config error."""
    champion_alias: str = "champion"
    """Alias moved to the new version only when its champion_metric strictly beats the current
    holder's (a tie keeps the current champion). Serve `models:/<registered_model>@<alias>`."""
    champion_metric: str | None = None
    """Test metric that decides the champion, in its objective's direction (higher accuracy or
    R², lower loss, RMSE or perplexity). None: the objective's headline (test_accuracy,
    test_r2, test_perplexity)."""

    @field_validator("registered_model", mode="before")
    @classmethod
    def _false_is_off(cls, name: Any) -> Any:
        # TOML has no null: `registered_model = false` is how an experiment file says "off".
        return None if name is False else name

    @field_serializer("registered_model", when_used="json")
    def _off_as_false(self, name: str | None) -> str | bool:
        # Written back as false, so `trainflow config --format toml` keeps it off (a None
        # would be left out of the file, and reading it back would register again).
        return False if name is None else name

    @field_validator("registered_model")
    @classmethod
    def _check_model_name(cls, name: str | None) -> str | None:
        if name is not None and not _MODEL_NAME.match(name):
            raise ValueError(
                f"registered model name {name!r} is not allowed: use 1-256 letters, digits, "
                "'_', '-' or '.', starting with a letter or digit (e.g. mnist-classifier), "
                "or false to skip registration"
            )
        return name

    @field_validator("champion_alias")
    @classmethod
    def _check_alias(cls, alias: str) -> str:
        if not _ALIAS.match(alias):
            raise ValueError(
                f"alias {alias!r} is not allowed: use 1-255 letters, digits, '_' or '-' "
                "(e.g. champion)"
            )
        if alias.lower() == "latest" or _VERSION_ALIAS.match(alias):
            raise ValueError(
                f"alias {alias!r} is reserved by MLflow ('latest' and v<number> name versions); "
                "choose another, e.g. champion"
            )
        return alias

    @model_validator(mode="after")
    def _check_registration(self) -> "EvaluateConfig":
        explicit = "registered_model" in self.model_fields_set
        if explicit and self.registered_model is not None and not self.log_model:
            raise ValueError(
                f"registered_model={self.registered_model!r} needs log_model=true (only a logged "
                "model can be registered): set evaluate.log_model=true, or "
                "evaluate.registered_model=false to skip registration"
            )
        return self
