"""Run state as data: a nested structure stored as a JSON tree plus one safetensors file of its tensors.

A checkpoint's run state (step, sampler position, RNG states, LR scheduler, generator states) used to be a
pickle, and unpickling a crafted file runs its code. This format can only describe data, so reading a
crafted file can at worst fail with a one-line CheckpointError:

    STEM.json          {"format": "relayrl-state", "version": 1, "value": TREE}
    STEM.safetensors   the tensors TREE refers to, by name ("0", "1", ...)

TREE is JSON with a few tagged objects (one key starting with "$") for what JSON lacks:

    None, bool, int, str, finite float, list   as themselves
    dict with str keys not starting with "$"    a JSON object
    any other dict (int keys, ...)              {"$dict": [[KEY, VALUE], ...]}
    tuple                                       {"$tuple": [...]}
    nan / inf / -inf                            {"$float": "nan"}
    torch.Tensor (dense, CPU or not)            {"$tensor": NAME}                       loaded on the CPU
    numpy.ndarray (numeric)                     {"$ndarray": {"dtype", "shape", "tensor"}}   its raw bytes

so that Python's `random` state (a tuple with a tuple inside) and numpy's (a tuple with an ndarray) come
back with the same types and values. Dict subclasses (OrderedDict) come back as dicts. Anything else
(functions, objects, numpy scalars, bytes) is refused at save time with a TypeError naming its key path.
This module imports only torch, safetensors, numpy (optional) and the checkpoint errors; it must never
import the trainer, engine or controller (they import it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from relayrl.checkpoint.errors import CheckpointError

try:
    import numpy as np
except ImportError:  # numpy is optional: torch runs without it.
    np = None

FORMAT = "relayrl-state"
VERSION = 1
JSON_SUFFIX = ".json"
TENSORS_SUFFIX = ".safetensors"
MAX_DEPTH = 64  # far beyond any state dict; stops a cycle or a crafted deep tree early
_TAGS = ("$dict", "$tuple", "$float", "$tensor", "$ndarray")
# What safetensors stores; complex and the exotic float8 / unsigned kinds are refused by name at save time.
_TENSOR_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                  torch.float16, torch.bfloat16, torch.float32, torch.float64}


def state_file_names(stem: str) -> tuple[str, str]:
    """The two file names of entry `stem`: (JSON tree, safetensors)."""
    return stem + JSON_SUFFIX, stem + TENSORS_SUFFIX


# ---------------------------------------------------------------- encode


def _path_str(path: tuple) -> str:
    return path[0] + "".join(f"[{k!r}]" for k in path[1:])


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def _tensor(self, t: torch.Tensor, path: tuple) -> str:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            raise TypeError(f"{_path_str(path)}: cannot store a {type(t).__name__} with layout {t.layout} in a "
                            "checkpoint's run state (only dense torch.Tensor)")
        if t.dtype not in _TENSOR_DTYPES:
            raise TypeError(f"{_path_str(path)}: cannot store a {t.dtype} tensor in a checkpoint's run state")
        name = str(len(self.tensors))
        # A copy of its own: safetensors refuses tensors sharing storage, and a later in-place update of the
        # caller's tensor must not change what is written.
        self.tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        return name

    def encode(self, obj: Any, path: tuple) -> Any:
        if len(path) > MAX_DEPTH:
            raise TypeError(f"{_path_str(path)}: nested more than {MAX_DEPTH} levels deep (a cycle?)")
        if obj is None or isinstance(obj, (bool, str)) or (isinstance(obj, int) and type(obj) is int):
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"$float": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"$tensor": self._tensor(obj, path)}
        if np is not None and type(obj) is np.ndarray:
            if obj.dtype.kind not in "biufc" or obj.dtype.hasobject:
                raise TypeError(f"{_path_str(path)}: cannot store a numpy array of dtype {obj.dtype} in a checkpoint")
            raw = torch.from_numpy(np.frombuffer(np.ascontiguousarray(obj).tobytes(), dtype=np.uint8).copy())
            return {"$ndarray": {"dtype": obj.dtype.str, "shape": list(obj.shape),
                                 "tensor": self._tensor(raw, path)}}
        if isinstance(obj, list):
            return [self.encode(v, (*path, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v, (*path, i)) for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            if all(type(k) is str and not k.startswith("$") for k in obj):
                return {k: self.encode(v, (*path, k)) for k, v in obj.items()}
            return {"$dict": [[self.encode(k, (*path, f"<key {k!r}>")), self.encode(v, (*path, k))]
                              for k, v in obj.items()]}
        raise TypeError(f"{_path_str(path)}: cannot store a {type(obj).__module__}.{type(obj).__qualname__} in a "
                        "checkpoint (only dict, list, tuple, str, int, float, bool, None, torch.Tensor, numpy.ndarray)")


def encode_state(obj: Any, name: str = "state") -> tuple[bytes, bytes]:
    """(JSON bytes, safetensors bytes) of `obj`; a TypeError naming the key path (`name['a'][0]`) for
    anything that is not data."""
    enc = _Encoder()
    tree = enc.encode(obj, (name,))
    text = json.dumps({"format": FORMAT, "version": VERSION, "value": tree}, allow_nan=False, separators=(",", ":"))
    return text.encode(), st_save(enc.tensors)


# ---------------------------------------------------------------- decode


class _Malformed(Exception):
    """Raised inside the decoder; turned into a CheckpointError naming the file."""


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def _tensor(self, name: Any) -> torch.Tensor:
        if type(name) is not str or name not in self.tensors:
            raise _Malformed(f"refers to a tensor {name!r} the safetensors file does not hold")
        return self.tensors[name]

    def _ndarray(self, spec: Any) -> Any:
        if np is None:
            raise _Malformed("holds a numpy array, and numpy is not installed")
        if type(spec) is not dict or set(spec) != {"dtype", "shape", "tensor"}:
            raise _Malformed("has a malformed $ndarray entry")
        try:
            dtype = np.dtype(spec["dtype"]) if type(spec["dtype"]) is str else None
        except TypeError:
            dtype = None
        shape = spec["shape"]
        if dtype is None or dtype.kind not in "biufc" or dtype.hasobject:
            raise _Malformed(f"has a numpy array of unsupported dtype {spec['dtype']!r}")
        if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
            raise _Malformed(f"has a numpy array with a malformed shape {shape!r}")
        raw = self._tensor(spec["tensor"])
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != math.prod(shape) * dtype.itemsize:
            raise _Malformed(f"has a numpy array whose {raw.numel()} bytes do not fit shape {shape} of {dtype}")
        return np.frombuffer(raw.numpy().tobytes(), dtype=dtype).reshape(shape).copy()

    def decode(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise _Malformed(f"is nested more than {MAX_DEPTH} levels deep")
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is list:
            return [self.decode(v, depth + 1) for v in node]
        if type(node) is not dict:
            raise _Malformed(f"holds an unexpected JSON value of type {type(node).__name__}")
        tags = [k for k in node if k.startswith("$")]
        if not tags:
            return {k: self.decode(v, depth + 1) for k, v in node.items()}
        if len(node) != 1 or tags[0] not in _TAGS:
            raise _Malformed(f"has an unknown tagged object with keys {sorted(node)[:4]}")
        tag, body = tags[0], node[tags[0]]
        if tag == "$tensor":
            return self._tensor(body)
        if tag == "$ndarray":
            return self._ndarray(body)
        if tag == "$float":
            if body not in ("nan", "inf", "-inf"):
                raise _Malformed(f"has a malformed $float {body!r}")
            return float(body)
        if type(body) is not list:
            raise _Malformed(f"has a {tag} that is not a list")
        if tag == "$tuple":
            return tuple(self.decode(v, depth + 1) for v in body)
        out = {}
        for pair in body:  # $dict
            if type(pair) is not list or len(pair) != 2:
                raise _Malformed("has a $dict item that is not a [key, value] pair")
            key = self.decode(pair[0], depth + 1)
            try:
                out[key] = self.decode(pair[1], depth + 1)
            except TypeError as e:  # an unhashable key (a list)
                raise _Malformed(f"has an unusable $dict key: {e}") from None
        return out


def decode_state(json_bytes: bytes, tensor_bytes: bytes, json_file: str | Path, tensors_file: str | Path) -> Any:
    """The structure encode_state wrote; a CheckpointError naming the file at fault for anything else."""
    try:
        doc = json.loads(json_bytes)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int too long
        raise CheckpointError(f"checkpoint file {json_file} is not valid JSON ({_one_line(e)}): it is truncated, "
                              "corrupt or not written by relayrl") from None
    if type(doc) is not dict or doc.get("format") != FORMAT or "value" not in doc:
        raise CheckpointError(f"checkpoint file {json_file} is not a relayrl state file (no format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"checkpoint file {json_file} has state format version {doc.get('version')!r}; this "
                              f"relayrl reads version {VERSION}")
    try:
        tensors = st_load(tensor_bytes)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {tensors_file} is not a valid safetensors file "
                              f"({_one_line(e)}): it is truncated, corrupt or not written by relayrl") from None
    try:
        return _Decoder(tensors).decode(doc["value"])
    except (_Malformed, RecursionError) as e:
        raise CheckpointError(f"checkpoint file {json_file} {e}: it is corrupt or not written by relayrl") from None


def read_state(directory: Path, stem: str) -> Any:
    """Decode entry `stem` of a checkpoint directory (STEM.json + STEM.safetensors)."""
    json_name, tensors_name = state_file_names(stem)
    files = {}
    for name in (json_name, tensors_name):
        try:
            files[name] = (directory / name).read_bytes()
        except OSError as e:
            raise CheckpointError(f"checkpoint file {directory / name} cannot be read: {e.strerror or e}") from None
    return decode_state(files[json_name], files[tensors_name], directory / json_name, directory / tensors_name)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
