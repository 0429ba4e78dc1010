"""DCP's index (.metadata) read as data: a pickle interpreter that can only build DCP's metadata records.

torch.distributed.checkpoint writes its index with pickle.dump and reads it with pickle.load, which runs
whatever a crafted file names. `read_dcp_index` instead interprets the pickle itself, opcode by opcode
(binary protocols 2-5, what pickle.dump writes):

  - a global resolves only from a fixed table: DCP's metadata dataclasses (Metadata, StorageMeta,
    MetadataIndex, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
    _MEM_FORMAT_ENCODING, filesystem._StorageInfo), torch.Size, torch dtypes / layouts / memory formats,
    pathlib paths (kept as strings), builtins set / frozenset / list / tuple and collections.OrderedDict;
    no module is ever imported;
  - REDUCE calls only the constructors in that table, each checking its arguments; NEWOBJ only creates
    (empty) instances of the metadata classes; BUILD only fills such instances, never a class object;
  - the opcodes that reach code in other ways (INST, OBJ, PERSID, EXT*, out-of-band buffers) are refused.

The result is then checked field by field (every storage entry points at a shard file the manifest
lists, every tensor's chunks tile it exactly), so what DCP gets is a well-formed index. Anything else is
`IndexRefused`, which the caller reports as a CheckpointError naming the file. This module imports only
torch and the standard library; it must never import the trainer, engine or controller (they import it).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import struct
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as md

SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_StorageInfo = filesystem._StorageInfo  # DCP's per-item storage record, pickled into .metadata by name
_DATA_CLASSES = {md.Metadata, md.StorageMeta, md.MetadataIndex, md.TensorStorageMetadata, md.BytesStorageMetadata,
                 md.ChunkStorageMetadata, md.TensorProperties, _StorageInfo}
_FIELDS = {c: {f.name for f in dataclasses.fields(c)} for c in _DATA_CLASSES}  # what BUILD may set
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


class IndexRefused(Exception):
    """The file is not an index this reader accepts; the message says what it holds instead."""


def _layout(name: Any) -> torch.layout:  # what torch.serialization._get_layout resolves, from our own table
    if type(name) is not str or name not in _LAYOUTS:
        raise IndexRefused(f"an unknown layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: Any) -> str:  # a pickled pathlib path (StorageMeta.checkpoint_id), kept as a string
    if not all(type(p) is str for p in parts):
        raise IndexRefused("a path with non-string parts")
    return str(pathlib.PurePath(*parts))


def _size(dims: Any = ()) -> torch.Size:
    if type(dims) not in (tuple, list) or not all(type(d) is int and d >= 0 for d in dims):
        raise IndexRefused(f"a malformed torch.Size {dims!r}")
    return torch.Size(dims)


def _mem_format(value: Any) -> md._MEM_FORMAT_ENCODING:
    if type(value) is not int:
        raise IndexRefused(f"a malformed memory format {value!r}")
    return md._MEM_FORMAT_ENCODING(value)


def _container(kind: type):
    def make(items: Any = ()) -> Any:
        if type(items) not in (list, tuple, dict):
            raise IndexRefused(f"a {kind.__name__} built from a {type(items).__name__}")
        return kind(items)
    return make


# (module, name) in the pickle -> what it becomes; anything else is refused
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in _DATA_CLASSES},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    **{("pathlib", n): _path for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                                       "PureWindowsPath")},
    **{("builtins", k.__name__): _container(k) for k in (set, frozenset, list, tuple)},
    ("collections", "OrderedDict"): _container(dict),
}
# compared by identity: no hash or __eq__ of an object from the file is ever called
_CALLABLE_IDS = {id(v) for v in _GLOBALS.values() if v not in _DATA_CLASSES}
_CLASS_IDS = {id(c) for c in _DATA_CLASSES}


def _resolve(module: Any, name: Any) -> Any:
    if type(module) is not str or type(name) is not str:
        raise IndexRefused("a global with a non-string name")
    if (module, name) in _GLOBALS:
        return _GLOBALS[(module, name)]
    value = getattr(torch, name, None) if module == "torch" else None
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    raise IndexRefused(f"a reference to {module}.{name}, which a DCP index never holds")


def _build(inst: Any, state: Any) -> None:
    if type(inst) not in _DATA_CLASSES:  # never a class object, never anything but DCP's own records
        raise IndexRefused(f"BUILD of a {type(inst).__name__}")
    if type(inst) is md.TensorProperties:
        inst.__setstate__(state)  # its own tuple format; the fields are checked afterwards
        return
    if type(state) is not dict or not state.keys() <= _FIELDS[type(inst)]:
        raise IndexRefused(f"a malformed state for {type(inst).__name__}")
    inst.__dict__.update(state)  # what pickle does (frozen MetadataIndex included)


def _pop_mark(stack: list, marks: list) -> tuple[list, list]:
    """(items since the last MARK, the stack below it)."""
    if not marks:
        raise IndexRefused("an unbalanced MARK")
    return stack, marks.pop()


def _top(stack: list, kind: type) -> Any:
    if not stack or type(stack[-1]) is not kind:
        raise IndexRefused(f"a {kind.__name__} operation on a {type(stack[-1]).__name__ if stack else 'empty stack'}")
    return stack[-1]


def _unpickle(data: bytes) -> Any:  # one branch per opcode, the common ones first
    stack: list = []
    marks: list[list] = []
    memo: dict[int, Any] = {}
    i, n = 0, len(data)

    def take(k: int) -> bytes:
        nonlocal i
        if k < 0 or i + k > n:
            raise IndexRefused("a truncated pickle")
        i += k
        return data[i - k:i]

    def unsigned(fmt: str, k: int) -> int:
        return struct.unpack(fmt, take(k))[0]

    while True:
        # The hottest opcodes index `data` directly (an IndexError past the end is a truncated pickle).
        op = data[i]
        i += 1
        if op == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1]
        elif op == 0x8C:  # SHORT_BINUNICODE
            size = data[i]
            i += 1
            stack.append(str(take(size), "utf-8", "surrogatepass"))
        elif op == 0x6A:  # LONG_BINGET
            stack.append(memo[unsigned("<I", 4)])
        elif op == 0x68:  # BINGET
            stack.append(memo[data[i]])
            i += 1
        elif op == 0x4B:  # BININT1
            stack.append(data[i])
            i += 1
        elif op in (0x85, 0x86, 0x87):  # TUPLE1, TUPLE2, TUPLE3
            k = op - 0x84
            if len(stack) < k:
                raise IndexRefused("a stack underflow")
            stack[-k:] = [tuple(stack[-k:])]
        elif op == 0x52:  # REDUCE
            args, func = stack.pop(), stack.pop()
            if id(func) not in _CALLABLE_IDS or type(args) is not tuple:
                raise IndexRefused(f"a call of {func!r}")
            stack.append(func(*args))
        elif op == 0x93:  # STACK_GLOBAL
            name, module = stack.pop(), stack.pop()
            stack.append(_resolve(module, name))
        elif op in (0x81, 0x92):  # NEWOBJ, NEWOBJ_EX
            kwargs = stack.pop() if op == 0x92 else {}
            args, cls = stack.pop(), stack.pop()
            if id(cls) not in _CLASS_IDS or args != () or kwargs != {}:
                raise IndexRefused(f"construction of {cls!r}")
            stack.append(cls.__new__(cls))
        elif op == 0x62:  # BUILD
            state = stack.pop()
            _build(stack[-1], state)
        elif op == 0x28:  # MARK
            marks.append(stack)
            stack = []
        elif op == 0x75:  # SETITEMS
            items, stack = _pop_mark(stack, marks)
            target = _top(stack, dict)
            for k in range(0, len(items) - 1, 2):
                target[items[k]] = items[k + 1]
        elif op == 0x73:  # SETITEM
            value, key = stack.pop(), stack.pop()
            _top(stack, dict)[key] = value
        elif op == 0x65:  # APPENDS
            items, stack = _pop_mark(stack, marks)
            _top(stack, list).extend(items)
        elif op == 0x61:  # APPEND
            value = stack.pop()
            _top(stack, list).append(value)
        elif op == 0x90:  # ADDITEMS
            items, stack = _pop_mark(stack, marks)
            _top(stack, set).update(items)
        elif op in (0x74, 0x6C, 0x91):  # TUPLE, LIST, FROZENSET
            items, stack = _pop_mark(stack, marks)
            stack.append({0x74: tuple, 0x6C: list, 0x91: frozenset}[op](items))
        elif op == 0x64:  # DICT
            items, stack = _pop_mark(stack, marks)
            stack.append(dict(zip(items[::2], items[1::2], strict=True)))
        elif op in (0x5D, 0x29, 0x7D, 0x8F):  # EMPTY_LIST, EMPTY_TUPLE, EMPTY_DICT, EMPTY_SET
            stack.append({0x5D: list, 0x29: tuple, 0x7D: dict, 0x8F: set}[op]())
        elif op in (0x4E, 0x88, 0x89):  # NONE, NEWTRUE, NEWFALSE
            stack.append({0x4E: None, 0x88: True, 0x89: False}[op])
        elif op == 0x4D:  # BININT2
            stack.append(unsigned("<H", 2))
        elif op == 0x4A:  # BININT
            stack.append(struct.unpack("<i", take(4))[0])
        elif op in (0x8A, 0x8B):  # LONG1, LONG4
            size = take(1)[0] if op == 0x8A else unsigned("<i", 4)
            stack.append(int.from_bytes(take(size), "little", signed=True))  # take refuses a negative size
        elif op == 0x47:  # BINFLOAT
            stack.append(struct.unpack(">d", take(8))[0])
        elif op in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
            size = unsigned("<I", 4) if op == 0x58 else unsigned("<Q", 8)
            stack.append(str(take(size), "utf-8", "surrogatepass"))
        elif op in (0x43, 0x42, 0x8E):  # SHORT_BINBYTES, BINBYTES, BINBYTES8
            size = take(1)[0] if op == 0x43 else unsigned("<I", 4) if op == 0x42 else unsigned("<Q", 8)
            stack.append(bytes(take(size)))
        elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT
            memo[take(1)[0] if op == 0x71 else unsigned("<I", 4)] = stack[-1]
        elif op == 0x63:  # GLOBAL: "module\nname\n"
            end = data.find(b"\n", i)
            end2 = data.find(b"\n", end + 1) if end >= 0 else -1
            if end2 < 0:
                raise IndexRefused("a truncated pickle")
            module, name = str(data[i:end], "utf-8"), str(data[end + 1:end2], "utf-8")
            i = end2 + 1
            stack.append(_resolve(module, name))
        elif op == 0x30:  # POP
            stack.pop()
        elif op == 0x31:  # POP_MARK
            _, stack = _pop_mark(stack, marks)
        elif op == 0x32:  # DUP
            stack.append(stack[-1])
        elif op == 0x80:  # PROTO
            take(1)
        elif op == 0x95:  # FRAME: a length prefix only
            take(8)
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise IndexRefused("a malformed end")
            return stack[0]
        else:  # INST, OBJ, PERSID, EXT*, buffers, text-protocol opcodes: never in a DCP index
            raise IndexRefused(f"the pickle opcode {bytes([op])!r}")


# ---------------------------------------------------------------- structure check


def _check_tensor(key: str, entry: Any) -> None:
    props, size, chunks = (getattr(entry, a, None) for a in ("properties", "size", "chunks"))
    ok = (type(props) is md.TensorProperties and isinstance(getattr(props, "dtype", None), torch.dtype)
          and type(size) is torch.Size and type(chunks) is list)
    if not ok:
        raise IndexRefused(f"a malformed tensor entry {key!r}")
    volume = 0
    for c in chunks:
        offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
        if type(c) is not md.ChunkStorageMetadata or type(offsets) is not torch.Size or type(sizes) is not torch.Size \
                or not len(offsets) == len(sizes) == len(size) \
                or any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise IndexRefused(f"a chunk of {key!r} outside its shape {tuple(size)}")
        volume += math.prod(sizes)
    if volume < math.prod(size):  # too few chunks: a load would keep the model's values there, silently
        raise IndexRefused(f"chunks of {key!r} that cover {volume} of its {math.prod(size)} elements")


def _check_index(meta: Any, shard_files: set[str]) -> None:
    if type(meta) is not md.Metadata:
        raise IndexRefused(f"a {type(meta).__name__} instead of a DCP Metadata")
    entries = getattr(meta, "state_dict_metadata", None)
    if type(entries) is not dict:
        raise IndexRefused("no state_dict_metadata table")
    for key, entry in entries.items():
        if type(key) is not str:
            raise IndexRefused("a non-string state dict key")
        if type(entry) is md.TensorStorageMetadata:
            _check_tensor(key, entry)
        elif type(entry) is not md.BytesStorageMetadata:
            raise IndexRefused(f"an entry {key!r} of type {type(entry).__name__}")
    storage = getattr(meta, "storage_data", None)
    if type(storage) is not dict:
        raise IndexRefused("no storage_data table")
    for index, info in storage.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if type(index) is not md.MetadataIndex or type(fqn) is not str or offset is not None and type(offset) is not \
                torch.Size:
            raise IndexRefused("a malformed storage index")
        rel, start, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if (type(info) is not _StorageInfo or type(rel) is not str or not SHARD_FILE.match(rel)
                or rel not in shard_files):
            raise IndexRefused(f"an item of {fqn!r} stored in {rel!r}, which is not a shard file of this checkpoint")
        if type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise IndexRefused(f"a malformed offset / length for {fqn!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (type(descriptors) in (list, tuple) and all(type(d) is str
                                                                                        for d in descriptors)):
            raise IndexRefused(f"malformed transform descriptors for {fqn!r}")
    planner = getattr(meta, "planner_data", None)
    if planner is not None and not (type(planner) is dict and all(
            type(k) is str and type(v) in (tuple, list) and all(type(p) in (str, int) for p in v)
            for k, v in planner.items())):
        raise IndexRefused("malformed planner data")
    sm = getattr(meta, "storage_meta", None)
    if sm is not None and not (type(sm) is md.StorageMeta and all(
            getattr(sm, a, None) is None or type(getattr(sm, a)) is str
            for a in ("checkpoint_id", "save_id", "load_id"))
            and type(getattr(sm, "modules", [])) is list and all(type(m) is str for m in sm.modules)):
        raise IndexRefused("a malformed storage_meta")
    if getattr(meta, "version", None) is not None and type(meta.version) is not str:
        raise IndexRefused("a malformed version")


def read_dcp_index(data: bytes, shard_files: set[str]) -> md.Metadata:
    """The DCP Metadata pickled in `data`, interpreted and checked (see the module docstring);
    `shard_files`: the .distcp names the checkpoint's manifest lists. IndexRefused for anything else."""
    try:
        meta = _unpickle(data)
        _check_index(meta, shard_files)
    except IndexRefused:
        raise
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, RecursionError, struct.error) as e:
        # truncated data, a stack underflow, an unknown memo key, an unhashable key, bad UTF-8, a constructor's
        # refusal: not a well-formed index
        raise IndexRefused(f"a malformed pickle ({type(e).__name__}: {str(e)[:120]})") from None
    return meta
