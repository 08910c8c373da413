"""Checkpoints verified when written and when read: a ``manifest.json`` written last lists
every file of a checkpoint with its size and SHA-256, and `damage` says what, if anything,
is wrong with a checkpoint on disk.

`damage` checks, in order: the manifest's files (present, of their size, of their checksum;
checksums skipped right after writing, when the bytes were just hashed), ``progress.json``
(JSON with the step count), DCP's ``.metadata`` (it unpickles) and every shard file that
``.metadata`` reads from (present, and as long as the bytes it reads). A checkpoint saved
before manifests were written has only the last three checks.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
_CHUNK = 1 << 20  # bytes read at a time while hashing


def _sha256(path: Path, *, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        if sync:  # the bytes listed are on disk before the manifest that lists them
            os.fsync(f.fileno())
    return digest.hexdigest()


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(path: Path) -> None:
    """List every file of the checkpoint ``path`` with its size and checksum, atomically."""
    files = {
        p.relative_to(path).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p, sync=True)}
        for p in _files(path)
    }
    tmp = path / f".{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path / MANIFEST)


def damage(path: Path, *, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint ``path`` (a file of it named, and how), or None if
    it is intact."""
    return _manifest_damage(path, checksums) or _progress_damage(path) or _dcp_damage(path)


def _manifest_damage(path: Path, checksums: bool) -> str | None:
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None  # saved before manifests: the other checks only
    try:
        files: dict[str, Any] = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} cannot be read ({type(e).__name__}: {e})"
    for name, listed in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != listed["bytes"]:
            return f"{name} is {size} bytes, but was written with {listed['bytes']}"
        if checksums and _sha256(file) != listed["sha256"]:
            return f"{name} does not have the checksum it was written with"
    return None


def _progress_damage(path: Path) -> str | None:
    progress = path / PROGRESS
    if not progress.is_file():
        return None  # a DCP checkpoint that autoplan did not save: refused when loaded
    try:
        step = json.loads(progress.read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{PROGRESS} cannot be read ({type(e).__name__}: {e})"
    if not isinstance(step, int):
        return f"{PROGRESS} has step {step!r}, not a number of steps"
    return None


def _dcp_damage(path: Path) -> str | None:
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a truncated pickle raises any of several types
        return f".metadata cannot be read ({type(e).__name__}: {e})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < end:
            return f"{name} is {file.stat().st_size} bytes, but .metadata reads up to {end}"
    return None
