"""Content hashes of files (datasets, shards, checkpoints)."""

import functools
import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_folder(folder: Path, recursive: bool = False) -> str:
    """Hex sha256 over the relative names and bytes of a folder's files (sorted; with
    `recursive`, those of its sub-folders too). Hashed once per process while no file's size
    or modification time changes."""
    found = folder.rglob("*") if recursive else folder.iterdir()
    files = sorted(p for p in found if p.is_file())
    stamp = tuple(
        (p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files
    )
    return _folder_digest(str(folder.resolve()), stamp)


@functools.lru_cache(maxsize=64)
def _folder_digest(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _size, _mtime in stamp:
        encoded = name.encode()
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
        digest.update(bytes.fromhex(sha256_file(Path(folder) / name)))
    return digest.hexdigest()
