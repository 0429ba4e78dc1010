"""Reading torch.distributed.checkpoint (DCP) files as data: its pickled index, and the values in its shards.

DCP (torch 2.13) reads a checkpoint in three ways, two of which would run code from a crafted file:

    .metadata        pickle.load (FileSystemReader.read_metadata)                        -> unsafe
    tensor items     torch.load(weights_only=True) of each item's slice of a .distcp file -> safe
    "bytes" items    torch.load(weights_only=False) (DefaultLoadPlanner.load_bytes): the
                     non-tensor values, e.g. the optimizer's param_groups (lr, betas, ...) -> unsafe

`load_dcp_metadata` reads .metadata with relayrl.checkpoint.dcp_index (a pickle interpreter that can only
build DCP's metadata records, then a check of their structure). `SafeReader` hands DCP that checked index
and reads each shard file under a guard that names the file in a one-line CheckpointError; `SafePlanner`
loads bytes items with weights_only=True. `dcp_load` runs dcp.load with both and unwraps the errors DCP
gathers from the ranks. This module imports only torch and the checkpoint modules dcp_index and
errors; it must never import the trainer, engine or controller (they import it).
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.futures import Future

from relayrl.checkpoint.dcp_index import SHARD_FILE, IndexRefused, read_dcp_index
from relayrl.checkpoint.errors import CheckpointError

__all__ = ["METADATA_FILE", "SHARD_FILE", "SafePlanner", "SafeReader", "dcp_load", "load_dcp_metadata"]

METADATA_FILE = ".metadata"


def load_dcp_metadata(path: Path, shard_files: set[str]) -> md.Metadata:
    """DCP's index of checkpoint `path`, read as data and checked; `shard_files`: the .distcp file names the
    checkpoint's manifest lists. A CheckpointError naming .metadata for anything else."""
    file = Path(path) / METADATA_FILE
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {e.strerror or e}") from None
    try:
        return read_dcp_index(data, shard_files)
    except IndexRefused as e:
        raise CheckpointError(f"checkpoint file {file} is not a DCP index relayrl reads (it holds {e}); it is "
                              "corrupt or crafted, and was not loaded") from None


# ---------------------------------------------------------------- reader and planner


def _one_line(e: BaseException) -> str:
    if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
        # torch's own text goes on to suggest weights_only=False, the one thing not to do with such a file
        return "it holds pickled objects other than tensors and plain values, refused by the weights-only loader"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


class SafeReader(FileSystemReader):
    """A FileSystemReader that serves an index checked by load_dcp_metadata (never pickle.load) and names
    the shard file in a CheckpointError when one of its items cannot be read."""

    def __init__(self, path: Path, metadata: md.Metadata) -> None:
        super().__init__(path)
        self.checked_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback index: relayrl never writes one
            raise CheckpointError(f"checkpoint {self.path} has no readable {METADATA_FILE}")
        meta = self.checked_metadata
        if meta.storage_meta is None:
            meta.storage_meta = md.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as e:  # any failure to read a file is that file's fault
                raise CheckpointError(f"checkpoint file {Path(self.path) / rel} cannot be loaded as data "
                                      f"({_one_line(e)}); it is corrupt or crafted, and was not loaded") from None
        fut: Future = Future()
        fut.set_result(None)
        return fut


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values load with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, map_location="cpu", weights_only=True)
        if not self.flatten_state_dict:
            self.state_dict[read_item.dest_index.fqn] = obj
            return
        # The flattened key's path in the caller's nested dict; every container on it exists already,
        # because DCP only reads the keys that dict asks for.
        *parents, last = self.mappings[read_item.dest_index.fqn]
        node = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = obj


def dcp_load(state: dict, path: Path, metadata: md.Metadata, *, no_dist: bool) -> None:
    """dcp.load of `state` in place from checkpoint `path` whose index was checked by load_dcp_metadata.
    A CheckpointError on any rank is raised (with its one line) on every rank."""
    try:
        with warnings.catch_warnings():
            if no_dist:  # one process holds every shard: the intended case, which DCP warns about
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as e:
        for failure in e.failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, CheckpointError):
                raise CheckpointError(str(exc)) from None
        raise
