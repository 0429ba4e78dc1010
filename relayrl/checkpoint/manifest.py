"""The COMPLETE marker: the list of a checkpoint's files with each one's size and CRC-32, written last.

    COMPLETE   {"format": "relayrl-manifest", "version": 1,
                "files": {"__0_0.distcp": {"size": 1234, "crc32": 305419896}, ".metadata": {...}, ...}}

Its presence says the writer finished (the directory was renamed into place after it was written); its
contents let a reader tell a sound checkpoint from one that was truncated, corrupted on disk, or had a
file replaced or added since. `verify_checkpoint` checks a directory against it, sizes only (a stat per
file, for every load) or sizes and checksums (a full read, before resuming a run or exporting).

The checksum is zlib's CRC-32 over 4 MiB reads: it finds truncation and bit rot at disk speed, and it is
not a signature (whoever can write the files can rewrite COMPLETE too). What keeps a crafted checkpoint
from running code is that every file is parsed as data (see statefile and safe_dcp). This module imports
only the standard library and the checkpoint errors; it must never import the trainer, engine or
controller (they import it).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from pathlib import Path

from relayrl.checkpoint.errors import CheckpointError

COMPLETE_MARKER = "COMPLETE"
FORMAT = "relayrl-manifest"
VERSION = 1
_CHUNK = 4 << 20


def file_digest(path: Path) -> dict[str, int]:
    """{"size": bytes, "crc32": CRC-32} of one file, streamed."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, "crc32": crc}


def manifest_bytes(directory: Path, known: Mapping[str, Mapping[str, int]] | None = None) -> bytes:
    """The COMPLETE marker for every file in `directory` (a flat directory, COMPLETE itself excluded).
    `known`: digests already computed (each rank's own shard files, read while still in its page cache)."""
    known = dict(known or {})
    files = {}
    for p in sorted(directory.iterdir()):
        if p.name == COMPLETE_MARKER:
            continue
        if not p.is_file():
            raise RuntimeError(f"checkpoint directory {directory} holds {p.name}, which is not a plain file")
        files[p.name] = dict(known[p.name]) if p.name in known else file_digest(p)
    return (json.dumps({"format": FORMAT, "version": VERSION, "files": files}, indent=1, sort_keys=True)
            + "\n").encode()


def read_manifest(path: Path) -> dict[str, dict[str, int]]:
    """The file table of checkpoint `path`'s COMPLETE marker; a CheckpointError naming COMPLETE if it is
    missing, not JSON, or not a manifest (an empty COMPLETE is an older relayrl's, without checksums)."""
    marker = path / COMPLETE_MARKER
    try:
        raw = marker.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker): it was interrupted "
                              "while being written, or copied halfway") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint file {marker} cannot be read: {e.strerror or e}") from None
    if not raw.strip():
        raise CheckpointError(f"checkpoint file {marker} is empty: the checkpoint was written by an older relayrl "
                              "without checksums and data-only run state, and cannot be loaded safely")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError(f"checkpoint file {marker} is not valid JSON: it is corrupt or not written by "
                              "relayrl") from None
    files = doc.get("files") if type(doc) is dict and doc.get("format") == FORMAT else None
    if type(files) is not dict or doc.get("version") != VERSION:
        raise CheckpointError(f"checkpoint file {marker} is not a relayrl manifest (format {FORMAT!r}, "
                              f"version {VERSION})")
    for name, entry in files.items():
        ok = (type(entry) is dict and type(entry.get("size")) is int and type(entry.get("crc32")) is int
              and "/" not in name and "\\" not in name and name not in ("", ".", "..", COMPLETE_MARKER))
        if not ok:
            raise CheckpointError(f"checkpoint file {marker} has a malformed entry for {name!r}")
    return files


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> dict[str, dict[str, int]]:
    """Check checkpoint directory `path` against its COMPLETE marker: every listed file present with its
    size (and CRC-32 when `checksums`), and no file it does not list. Returns the file table; raises a
    CheckpointError whose one line names the first file at fault."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    files = read_manifest(path)
    present = {p.name for p in path.iterdir()} - {COMPLETE_MARKER}
    unlisted = sorted(present - set(files))
    if unlisted:
        raise CheckpointError(f"checkpoint file {path / unlisted[0]} is not listed in {COMPLETE_MARKER}: it was "
                              "added after the checkpoint was written")
    for name, want in sorted(files.items()):
        file = path / name
        if name not in present or not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing (listed in {COMPLETE_MARKER})")
        size = file.stat().st_size
        if size != want["size"]:
            what = "truncated or replaced" if size < want["size"] else "changed"
            raise CheckpointError(f"checkpoint file {file} has {size} bytes, {COMPLETE_MARKER} says {want['size']}: "
                                  f"it was {what} after it was written")
        if checksums:
            try:
                got = file_digest(file)
            except OSError as e:
                raise CheckpointError(f"checkpoint file {file} cannot be read: {e.strerror or e}") from None
            if got["crc32"] != want["crc32"]:
                raise CheckpointError(f"checkpoint file {file} fails its checksum (CRC-32 {got['crc32']:08x}, "
                                      f"{COMPLETE_MARKER} says {want['crc32']:08x}): it is corrupt")
    return files
