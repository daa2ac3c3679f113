"""Resolving what a user brings: `package.module:attr` import paths and entry-point names.

One code path for every seam (models, data sources): our own built-ins are import paths into
trainflow, registered under a short name, and go through here like a user's. Every way a user's
reference can fail to resolve, or their code can raise, becomes one `PluginError` line naming
the reference, their file and the fix; the traceback stays out of the user's way.
"""

import importlib
import os
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from trainflow.errors import ConfigError, DataError


class PluginError(ConfigError):
    """A user's plug-in cannot be used: the message names the setting, the file and the fix."""


@dataclass(frozen=True)
class Resolved:
    """A resolved reference: the object, its import path and the file that defines it."""

    obj: Any
    target: str
    """`module:attr` the reference resolved to."""
    file: str
    """The module's file (or its name when it has none)."""


def resolve(ref: str, *, setting: str, group: str, builtins: Mapping[str, str]) -> Resolved:
    """The callable `ref` names: a built-in name, `package.module:attr`, or an entry point of
    `group`. `setting` (e.g. "train.model") is named in every error."""
    target = builtins.get(ref) or (ref if ":" in ref else _entry_point(ref, setting, group))
    if target is None:
        raise PluginError(
            f"{setting}={ref!r} is not a built-in ({', '.join(sorted(builtins))}), not an "
            f"import path 'package.module:name', and no installed package registers it under "
            f"the entry-point group {group!r}: fix {setting}"
        )
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{setting}={ref!r}: write an import path as 'package.module:name'")
    module = _import(module_name, setting, ref)
    file = getattr(module, "__file__", None) or module_name
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(
                f"{setting}={ref!r}: {file} has no {attr!r}: define it there or fix {setting}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(
            f"{setting}={ref!r}: {attr!r} in {file} is a {type(obj).__name__}, not a callable: "
            f"point {setting} at a function or class"
        )
    return Resolved(obj=obj, target=target, file=file)


def call(resolved: Resolved, what: str, *args: Any, **kwargs: Any) -> Any:
    """resolved.obj(*args, **kwargs); an exception raised in it becomes one PluginError line
    naming `what` (e.g. "the model factory 'my_models:build'"), the user's file and line.
    A ConfigError or DataError (trainflow's own one-line refusal, e.g. a built-in model
    refusing the data, a built-in source its arguments) passes unchanged."""
    try:
        return resolved.obj(*args, **kwargs)
    except (ConfigError, DataError):
        raise
    except Exception as exc:
        raise PluginError(
            f"{what} raised {describe(exc)} at {user_frame(exc, resolved.file)}: fix it in "
            f"{resolved.file}"
        ) from exc


def describe(exc: BaseException) -> str:
    """`Type: message` on one line."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def user_frame(exc: BaseException, file: str) -> str:
    """`file:line` of the deepest frame of exc's traceback in `file` (else the deepest frame
    outside trainflow and the standard library; else the deepest frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = str(Path(__file__).resolve().parents[1])
    for keep in (
        lambda f: f.filename == file,
        lambda f: not f.filename.startswith((ours, sys.prefix, sys.base_prefix)),
        lambda f: True,
    ):
        hits = [f for f in frames if keep(f)]
        if hits:
            return f"{hits[-1].filename}:{hits[-1].lineno}"
    return file


def search_working_folder() -> None:
    """Let `trainflow run` started in a project folder import that folder's modules, as
    `python -m` would; searched last, so it never shadows an installed package."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def _entry_point(name: str, setting: str, group: str) -> str | None:
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if len(found) > 1:
        dists = ", ".join(sorted({ep.dist.name if ep.dist else "?" for ep in found}))
        raise PluginError(
            f"{setting}={name!r}: several installed packages register it under {group!r} "
            f"({dists}): use an import path 'package.module:name' instead"
        )
    return found[0].value if found else None


def _import(module_name: str, setting: str, ref: str) -> Any:
    search_working_folder()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.split(".")[0] != exc.name.split(".")[0]:
            # The user's module exists but imports something that is not installed.
            raise PluginError(
                f"{setting}={ref!r}: importing {module_name!r} failed at "
                f"{user_frame(exc, '')}: no module named {exc.name!r}: install it "
                f"(pip install {exc.name.split('.')[0]}) in the environment trainflow runs in"
            ) from exc
        looked = ", ".join(repr(p or ".") for p in sys.path[:4])
        raise PluginError(
            f"{setting}={ref!r}: no module named {module_name!r} (Python looked in {looked}, "
            "...): run trainflow from the folder that holds it, add that folder to PYTHONPATH, "
            "or pip install your package"
        ) from exc
    except Exception as exc:
        raise PluginError(
            f"{setting}={ref!r}: importing {module_name!r} raised {describe(exc)} at "
            f"{user_frame(exc, '')}: fix that module"
        ) from exc
