"""Reading torch.distributed.checkpoint (DCP) files as data: its pickled index, and the values in its shards.

DCP (torch 2.13) reads a checkpoint in three ways, two of which would run code from a crafted file:

    .metadata        pickle.load (FileSystemReader.read_metadata)                        -> unsafe
    tensor items     torch.load(weights_only=True) of each item's slice of a .distcp file -> safe
    "bytes" items    torch.load(weights_only=False) (DefaultLoadPlanner.load_bytes): the
                     non-tensor values, e.g. the optimizer's param_groups (lr, betas, ...) -> unsafe

`load_dcp_metadata` reads .metadata with a small pickle interpreter (over pickletools.genops) that knows
only DCP's metadata classes, torch.Size, dtypes / layouts / memory formats, pathlib paths (as strings) and
the builtin containers: it never imports a module, calls only those constructors, and BUILDs only instances
of those classes. It then checks the structure (every storage entry points at a shard file listed in the
manifest). `SafeReader` hands DCP that checked index and reads each shard file under a guard that names
the file in a one-line CheckpointError; `SafePlanner` loads bytes items with weights_only=True. `dcp_load`
runs dcp.load with both and unwraps the errors DCP gathers from the ranks. This module imports only
torch and the checkpoint errors.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import pickletools
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, filesystem
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.futures import Future

from relayrl.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"
SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_StorageInfo = filesystem._StorageInfo  # DCP's per-item storage record; pickled into .metadata by name

# ---------------------------------------------------------------- the restricted unpickler

_DATA_CLASSES = {md.Metadata, md.StorageMeta, md.MetadataIndex, md.TensorStorageMetadata, md.BytesStorageMetadata,
                 md.ChunkStorageMetadata, md.TensorProperties, _StorageInfo}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: Any) -> torch.layout:  # stands in for torch.serialization._get_layout
    if type(name) is not str or name not in _LAYOUTS:
        raise _Refused(f"unknown layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: Any) -> str:  # a pickled pathlib path (StorageMeta.checkpoint_id), kept as a string
    if not all(type(p) is str for p in parts):
        raise _Refused("a path with non-string parts")
    return str(pathlib.PurePath(*parts))


def _size(dims: Any = ()) -> torch.Size:
    if type(dims) not in (tuple, list) or not all(type(d) is int and d >= 0 for d in dims):
        raise _Refused(f"a malformed torch.Size {dims!r}")
    return torch.Size(dims)


def _mem_format(value: Any) -> md._MEM_FORMAT_ENCODING:
    if type(value) is not int:
        raise _Refused(f"a malformed memory format {value!r}")
    return md._MEM_FORMAT_ENCODING(value)


def _container(kind: type):
    def make(items: Any = ()) -> Any:
        if type(items) not in (list, tuple):
            raise _Refused(f"a {kind.__name__} built from a {type(items).__name__}")
        return kind(items)
    return make


# name in the pickle -> what it becomes; anything else is refused
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in _DATA_CLASSES},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    **{("pathlib", n): _path for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                                       "PureWindowsPath")},
    **{("builtins", k.__name__): _container(k) for k in (set, frozenset, list, tuple)},
    ("collections", "OrderedDict"): dict,
}
_CALLABLE = {v for v in _GLOBALS.values() if v not in _DATA_CLASSES} | {dict}


class _Refused(Exception):
    """Raised inside the interpreter; becomes a CheckpointError naming the file."""


def _resolve(module: Any, name: Any) -> Any:
    if type(module) is not str or type(name) is not str:
        raise _Refused("a global with a non-string name")
    if (module, name) in _GLOBALS:
        return _GLOBALS[(module, name)]
    value = getattr(torch, name, None) if module == "torch" else None
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    raise _Refused(f"a reference to {module}.{name}, which a DCP index never holds")


def _build(inst: Any, state: Any) -> None:
    if type(inst) not in _DATA_CLASSES:  # never a class object, never anything but DCP's own records
        raise _Refused(f"BUILD of a {type(inst).__name__}")
    if type(inst) is md.TensorProperties:
        inst.__setstate__(state)
        return
    if type(state) is not dict or not all(type(k) is str and not k.startswith("__") for k in state):
        raise _Refused(f"a malformed state for {type(inst).__name__}")
    inst.__dict__.update(state)


_PUSH_ARG = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "UNICODE",
             "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"}
_PUSH_CONST = {"NONE": lambda: None, "NEWTRUE": lambda: True, "NEWFALSE": lambda: False, "EMPTY_LIST": list,
               "EMPTY_TUPLE": tuple, "EMPTY_DICT": dict, "EMPTY_SET": set}
_FROM_MARK = {"LIST": list, "TUPLE": tuple, "FROZENSET": frozenset,
              "DICT": lambda items: dict(zip(items[::2], items[1::2], strict=True))}


def _target(stack: list, kind: type | tuple) -> Any:
    if not stack or type(stack[-1]) not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _Refused("a container operation on the wrong kind of object")
    return stack[-1]


def restricted_unpickle(data: bytes) -> Any:  # noqa: C901 - one branch per opcode reads best
    """Interpret a pickle that may only build DCP metadata (see the module docstring); _Refused otherwise."""
    stack: list = []
    marks: list[list] = []
    memo: dict[int, Any] = {}

    def pop_mark() -> list:
        nonlocal stack
        if not marks:
            raise _Refused("an unbalanced MARK")
        items, stack = stack, marks.pop()
        return items

    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _PUSH_CONST:
            stack.append(_PUSH_CONST[name]())
        elif name == "BYTEARRAY8":
            stack.append(bytearray(arg))
        elif name == "MARK":
            marks.append(stack)
            stack = []
        elif name in _FROM_MARK:
            items = pop_mark()  # before naming `stack`: pop_mark rebinds it to the enclosing one
            stack.append(_FROM_MARK[name](items))
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            pop_mark()
        elif name == "DUP":
            stack.append(stack[-1])
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(stack) < n:
                raise _Refused("a stack underflow")
            stack[-n:] = [tuple(stack[-n:])]
        elif name == "APPEND":
            value = stack.pop()
            _target(stack, list).append(value)
        elif name == "APPENDS":
            items = pop_mark()
            _target(stack, list).extend(items)
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            _target(stack, dict)[key] = value
        elif name == "SETITEMS":
            items = pop_mark()
            target = _target(stack, dict)
            for i in range(0, len(items) - 1, 2):
                target[items[i]] = items[i + 1]
        elif name == "ADDITEMS":
            items = pop_mark()
            _target(stack, set).update(items)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in memo:
                raise _Refused("a reference to an unknown memo entry")
            stack.append(memo[arg])
        elif name == "GLOBAL":
            module, _, attr = arg.partition(" ")
            stack.append(_resolve(module, attr))
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            stack.append(_resolve(module, attr))
        elif name == "REDUCE":
            args, func = stack.pop(), stack.pop()
            if not any(func is c for c in _CALLABLE) or type(args) is not tuple:
                raise _Refused(f"a call of {func!r}")
            stack.append(func(*args))
        elif name in ("NEWOBJ", "NEWOBJ_EX"):
            kwargs = stack.pop() if name == "NEWOBJ_EX" else {}
            args, cls = stack.pop(), stack.pop()
            if cls not in _DATA_CLASSES or args != () or kwargs != {}:
                raise _Refused(f"construction of {cls!r}")
            stack.append(cls.__new__(cls))
        elif name == "BUILD":
            state = stack.pop()
            _build(stack[-1], state)
        elif name == "STOP":
            if len(stack) != 1 or marks:
                raise _Refused("a malformed end")
            return stack[0]
        else:  # INST, OBJ, PERSID, EXT*, NEXT_BUFFER, py2 strings: never in a DCP index
            raise _Refused(f"the pickle opcode {name}")
    raise _Refused("no STOP opcode")


# ---------------------------------------------------------------- structure check


def _check_metadata(meta: Any, shard_files: set[str]) -> None:
    if type(meta) is not md.Metadata:
        raise _Refused(f"a {type(meta).__name__} instead of a DCP Metadata")
    entries = getattr(meta, "state_dict_metadata", None)
    if type(entries) is not dict:
        raise _Refused("no state_dict_metadata table")
    for key, entry in entries.items():
        if type(key) is not str:
            raise _Refused("a non-string state dict key")
        if type(entry) is md.TensorStorageMetadata:
            props = getattr(entry, "properties", None)
            ok = (type(props) is md.TensorProperties and isinstance(getattr(props, "dtype", None), torch.dtype)
                  and type(getattr(entry, "size", None)) is torch.Size and type(getattr(entry, "chunks", None)) is list)
            ok = ok and all(type(c) is md.ChunkStorageMetadata and type(getattr(c, "offsets", None)) is torch.Size
                            and type(getattr(c, "sizes", None)) is torch.Size
                            and len(c.offsets) == len(c.sizes) == len(entry.size) for c in entry.chunks)
            if not ok:
                raise _Refused(f"a malformed tensor entry {key!r}")
        elif type(entry) is not md.BytesStorageMetadata:
            raise _Refused(f"an entry {key!r} of type {type(entry).__name__}")
    storage = getattr(meta, "storage_data", None)
    if type(storage) is not dict:
        raise _Refused("no storage_data table")
    for index, info in storage.items():
        if type(index) is not md.MetadataIndex or type(getattr(index, "fqn", None)) is not str:
            raise _Refused("a malformed storage index")
        if type(info) is not _StorageInfo:
            raise _Refused(f"a storage record of type {type(info).__name__}")
        rel, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if type(rel) is not str or not SHARD_FILE.match(rel) or rel not in shard_files:
            raise _Refused(f"an item stored in {rel!r}, which is not a shard file of this checkpoint")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise _Refused(f"a malformed offset / length for {index.fqn!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (type(descriptors) in (list, tuple)
                                            and all(type(d) is str for d in descriptors)):
            raise _Refused(f"malformed transform descriptors for {index.fqn!r}")
    planner = getattr(meta, "planner_data", None)
    if planner is not None and not (type(planner) is dict and all(
            type(k) is str and type(v) in (tuple, list) and all(type(p) in (str, int) for p in v)
            for k, v in planner.items())):
        raise _Refused("malformed planner data")
    if getattr(meta, "storage_meta", None) is not None and type(meta.storage_meta) is not md.StorageMeta:
        raise _Refused("a malformed storage_meta")


def load_dcp_metadata(path: Path, shard_files: set[str]) -> md.Metadata:
    """DCP's index of checkpoint `path`, read as data and checked; `shard_files`: the .distcp file names the
    checkpoint's manifest lists. A CheckpointError naming .metadata for anything else."""
    file = Path(path) / METADATA_FILE
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {e.strerror or e}") from None
    try:
        meta = restricted_unpickle(data)
        _check_metadata(meta, shard_files)
    except (_Refused, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        # ValueError: pickletools on a truncated / non-pickle file; the others: a pickle of the wrong shape.
        raise CheckpointError(f"checkpoint file {file} is not a DCP index relayrl reads (it holds {e}); it is "
                              "corrupt or crafted, and was not loaded") from None
    return meta


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
            except Exception as e:  # noqa: BLE001 - any failure to read a file is that file's fault
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
