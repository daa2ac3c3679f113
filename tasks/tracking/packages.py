"""The installed package set as one hash: what a registered model's environment was.

Kept free of MLflow: the training job computes it on rank 0, where importing MLflow would
cost every rank a second of start-up.
"""

import hashlib
import importlib.metadata
import sysconfig


def installed_packages() -> list[str]:
    """'name==version' of every distribution installed in this interpreter's environment
    (its site-packages), sorted. Only there: folders a process adds to sys.path (its working
    folder, a plug-in's project, a code snapshot) differ between the flow and the ranks and
    are not the environment."""
    paths = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    found = {
        f"{(dist.metadata['Name'] or '').lower()}=={dist.version}"
        for dist in importlib.metadata.distributions(path=paths)
    }
    return sorted(found)


def package_lock_hash(packages: list[str] | None = None) -> str:
    """sha256 of the installed package set (`installed_packages()` unless given)."""
    lines = installed_packages() if packages is None else packages
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
