"""A search space: config keys and the values a trial may give them.

Written the same on the command line and in Python, one ``key=kind(args)`` per key:

    train.lr=loguniform(1e-4,1e-1)      a float, log scale (both bounds > 0)
    train.dropout=uniform(0,0.5)        a float, linear scale
    train.width=int(16,128)             an int, bounds included
    train.width=logint(16,256)          an int, log scale
    train.batch_size=choice(32,64,128)  one of the listed values (JSON each: 1e-3, "adamw", true)

In Python the same texts are the values of a dict: ``{"train.lr": "loguniform(1e-4,1e-1)"}``;
a list there is a choice. Each parameter becomes an Optuna distribution (the sampler draws).
"""

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainflow.errors import ConfigError

KINDS = ("uniform", "loguniform", "int", "logint", "choice")
"""The kinds of parameter a space may hold."""
_FORM = re.compile(r"^\s*([a-z]+)\s*\((.*)\)\s*$", re.DOTALL)


class Param(BaseModel):
    """One searched key: a range or a list of choices."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    """The dotted config key (train.lr)."""
    kind: Literal["uniform", "loguniform", "int", "logint", "choice"]
    """How values are drawn."""
    low: float | int | None = None
    """Smallest value of a range (included)."""
    high: float | int | None = None
    """Largest value of a range (included)."""
    choices: tuple[Any, ...] = ()
    """The values of a choice."""

    @property
    def log(self) -> bool:
        """Whether the range is drawn on a log scale."""
        return self.kind in ("loguniform", "logint")

    def samples(self) -> list[Any]:
        """Values to build a config with when checking the key: both bounds (and, for a
        float range, the float just above low, so an int key given one is caught), or every
        choice."""
        if self.kind == "choice":
            return list(self.choices)
        assert self.low is not None and self.high is not None
        if self.kind in ("int", "logint"):
            return [int(self.low), int(self.high)]
        low, high = float(self.low), float(self.high)
        return [low, high, math.nextafter(low, high)]  # never integral: an int key refuses it

    def distribution(self) -> Any:
        """The Optuna distribution the sampler draws this key from."""
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if self.kind == "choice":
            return CategoricalDistribution(list(self.choices))
        assert self.low is not None and self.high is not None
        if self.kind in ("int", "logint"):
            return IntDistribution(int(self.low), int(self.high), log=self.log)
        return FloatDistribution(float(self.low), float(self.high), log=self.log)

    def text(self) -> str:
        """The parameter as written: ``loguniform(0.0001,0.1)``."""
        args = self.choices if self.kind == "choice" else (self.low, self.high)
        return f"{self.kind}({','.join(json.dumps(a) for a in args)})"


def parse_param(key: str, spec: Any) -> Param:
    """One key's parameter from its text (``int(16,128)``) or a Python list (a choice)."""
    if isinstance(spec, list | tuple):
        return _checked(Param(key=key, kind="choice", choices=tuple(spec)))
    match = _FORM.match(str(spec))
    if not match or match.group(1) not in KINDS:
        raise ConfigError(
            f"search space {key}={spec}: write one of {', '.join(k + '(...)' for k in KINDS)}, "
            f"e.g. {key}=loguniform(1e-4,1e-1) or {key}=choice(32,64)"
        )
    kind, raw = match.groups()
    try:
        args = json.loads(f"[{raw}]")
    except json.JSONDecodeError:
        raise ConfigError(
            f"search space {key}={spec}: the arguments must be JSON values separated by commas "
            '(numbers, "text", true/false)'
        ) from None
    if kind == "choice":
        return _checked(Param(key=key, kind="choice", choices=tuple(args)))
    return _checked(_range(key, kind, args, spec))


def _range(key: str, kind: str, args: list[Any], spec: Any) -> Param:
    numeric = all(isinstance(a, int | float) and not isinstance(a, bool) for a in args)
    if len(args) != 2 or not numeric:
        raise ConfigError(f"search space {key}={spec}: {kind} takes two numbers, low and high")
    if kind in ("int", "logint") and not all(float(a).is_integer() for a in args):
        raise ConfigError(f"search space {key}={spec}: {kind} takes two integers")
    return Param(key=key, kind=kind, low=args[0], high=args[1])


def _checked(param: Param) -> Param:
    """The parameter, or ConfigError for a range that holds nothing or a log range that
    reaches 0."""
    where = f"search space {param.key}={param.text()}"
    if param.kind == "choice":
        if not param.choices:
            raise ConfigError(f"{where}: a choice needs at least one value")
        if len({json.dumps(c) for c in param.choices}) != len(param.choices):
            raise ConfigError(f"{where}: a value is listed twice")
        return param
    assert param.low is not None and param.high is not None
    if param.low >= param.high:
        raise ConfigError(
            f"{where}: the range is empty or inverted (low must be below high); "
            f"for a single value use --set {param.key}={param.low}"
        )
    if param.log and param.low <= 0:
        raise ConfigError(f"{where}: a log range needs both bounds above 0")
    return param


def parse_space(space: Mapping[str, Any] | list[str]) -> list[Param]:
    """A whole space, from ``key=kind(args)`` texts or a dict of key to text (or list)."""
    if isinstance(space, Mapping):
        items = list(space.items())
    else:
        items = []
        for text in space:
            key, sep, spec = text.partition("=")
            if not sep or not key.strip():
                raise ConfigError(
                    f"--space {text!r} is not of the form key=kind(args), "
                    "e.g. train.lr=loguniform(1e-4,1e-1)"
                )
            items.append((key.strip(), spec))
    if not items:
        raise ConfigError("a search needs a space, e.g. --space 'train.lr=loguniform(1e-4,1e-1)'")
    keys = [k for k, _ in items]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"search space: a key is given twice ({', '.join(keys)})")
    for key in keys:
        if not key.startswith("train."):
            raise ConfigError(
                f"search space key {key!r}: only train.* keys can vary in a search (one "
                "dataset, one job array); set other keys with --set"
            )
    return [parse_param(k, v) for k, v in items]


def distributions(params: list[Param]) -> dict[str, Any]:
    """Key -> Optuna distribution, for `study.ask`."""
    return {p.key: p.distribution() for p in params}


def grid_values(params: list[Param]) -> dict[str, list[Any]]:
    """Key -> every value, for Optuna's GridSampler: choices, or every int of an int range;
    ConfigError for a float range, which has no grid."""
    out: dict[str, list[Any]] = {}
    for p in params:
        if p.kind == "choice":
            out[p.key] = list(p.choices)
        elif p.kind == "int" and p.low is not None and p.high is not None:
            out[p.key] = list(range(int(p.low), int(p.high) + 1))
        else:
            raise ConfigError(
                f"search space {p.key}={p.text()}: the grid sampler needs choice(...) or "
                "int(...) for every key; use --sampler tpe or random for a float range"
            )
    return out
