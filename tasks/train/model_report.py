"""What the preflight check learnt about a model: small, picklable, free of torch (the flows
import it to hand the check's outcome on to the stages)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelReport:
    """What preflight learnt about the model without allocating it."""

    target: str
    """`module:factory` that train.model resolved to."""
    file: str
    """The factory's module file."""
    parameters: int
    """Number of parameters."""
    parameter_bytes: int
    """Bytes of the parameters in their dtypes."""

    @property
    def module(self) -> str:
        """The factory's module (what the run's code snapshot starts from)."""
        return self.target.partition(":")[0]

    def params(self) -> dict[str, str]:
        """MLflow params of the train run."""
        return {
            "model_factory": self.target,
            "model_parameters": str(self.parameters),
            "model_parameter_bytes": str(self.parameter_bytes),
        }

    def line(self) -> str:
        """One log line."""
        mib = self.parameter_bytes / 2**20
        return f"model {self.target}: {self.parameters:,} parameters, {mib:.2f} MiB ({self.file})"
