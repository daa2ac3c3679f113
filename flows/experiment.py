"""Experiment files: a pipeline config written as TOML, read by `trainflow run FILE`.

A file holds the same keys as ``--set`` (sections ``[preprocess]``, ``[train]``,
``[train.model_args]``...), optionally ``preset = "tiny"`` to start from a preset other than
the demo. The command applies the preset, then the file, then ``--set``. Every key is validated
as a ``--set`` is; a mistake is reported with the file and line it is on.

The parent run of every pipeline logs its resolved config as ``experiment.toml`` (`render`):
`trainflow run experiment.toml`, from the run's code snapshot, trains the same run again.
"""

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from trainflow.config_base import StrictModel, submodel
from trainflow.errors import ConfigError

PRESET_KEY = "preset"
"""The one key of a file that is not a config key: the preset the file starts from."""


@dataclass(frozen=True)
class Experiment:
    """An experiment file, read: its keys, the preset it names, where each key is written."""

    path: Path
    tree: dict[str, Any]
    """The config keys, nested as in the file (without `preset`)."""
    preset: str | None = None
    """The preset the file names, if any."""
    lines: dict[str, int] = field(default_factory=dict)
    """Dotted key -> the line (1-based) that sets it or opens its section."""

    def where(self, dotted: str) -> str:
        """``file:line`` of `dotted` (or of its nearest section written in the file)."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            line = self.lines.get(".".join(parts[:n]))
            if line is not None:
                return f"{self.path}:{line}"
        return str(self.path)


def read(path: Path | str) -> Experiment:
    """Read and parse an experiment file; one line naming the file when it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"experiment file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"experiment file {path} cannot be read: {err}") from None
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    preset = tree.pop(PRESET_KEY, None)
    lines = key_lines(text)
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"{path}:{lines.get(PRESET_KEY, 1)}: preset must be a preset's name")
    return Experiment(path, tree, preset, lines)


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_ASSIGN = re.compile(
    r"^\s*((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*="
)


def _key_path(text: str) -> list[str]:
    return [
        part.strip().strip("\"'")
        for part in re.split(r"\.(?=(?:[^\"']|\"[^\"]*\"|'[^']*')*$)", text)
    ]


def key_lines(text: str) -> dict[str, int]:
    """Dotted key -> line number of where it is set (``key =``) or its table opened
    (``[a.b]``), for the lines of a TOML document (keys inside inline tables map to the line
    of the key that holds the table)."""
    lines: dict[str, int] = {}
    section: list[str] = []
    depth = 0  # open brackets of a multi-line array: its lines assign nothing
    for number, line in enumerate(text.splitlines(), start=1):
        if depth:
            depth = max(0, depth + line.count("[") - line.count("]"))
            continue
        header = _HEADER.match(line)
        if header:
            section = _key_path(header.group(1))
            lines.setdefault(".".join(section), number)
            continue
        assign = _ASSIGN.match(line)
        if assign:
            dotted = ".".join([*section, *_key_path(assign.group(1))])
            lines.setdefault(dotted, number)
            value = line[assign.end() :]
            depth = max(0, value.count("[") - value.count("]"))
    return lines


def leaves(tree: dict[str, Any], model: type[StrictModel]) -> dict[str, Any]:
    """The file's keys as dotted ``--set`` items: sections of `model` are walked into, any
    other value (a dict such as ``train.model_args`` included) is one item, as ``--set`` sets
    it. Keys `model` does not have stay items too, for validation to refuse by name."""
    items: dict[str, Any] = {}
    for key, value in tree.items():
        info = model.model_fields.get(key)
        sub = submodel(info.annotation) if info is not None else None
        if isinstance(value, dict) and sub is not None:
            items.update({f"{key}.{k}": v for k, v in leaves(value, sub).items()})
        else:
            items[key] = value
    return items


def render(cfg: StrictModel, header: str = "") -> str:
    """The config as an experiment file: every key, as resolved (keys left unset, None, are
    left out: their default is None in every preset a file can start from)."""
    tree = _without_none(cfg.model_dump(mode="json"))
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + tomli_w.dumps(tree)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value
