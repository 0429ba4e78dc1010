"""DataBatch: what moves between worker groups — rows of tensors plus per-row Python objects.

    DataBatch
      tensors      {"input_ids": [B, T], "advantages": [B], ...}   every tensor's dim 0 is B
      non_tensors  {"texts": [B strs], "examples": [B Examples]}  every list has B items
      meta         {"temperature": 1.0, "step": 3}                 batch-wide, not split

    chunk(3) on B = 8 rows:  rows 0-2 | rows 3-5 | rows 6-7   (contiguous; the first B % n chunks
                                                               get one extra row, as torch.tensor_split)
    concat([a, b, c])        rows of a, then b, then c; meta taken from the first part

Chunking then concatenating is the identity, so a DP_SPLIT call returns rows in the order they
were sent. DataBatch is one kind of `Rows`, what dispatch cuts by data-parallel rank: a layer above may hand
its own typed batch instead (the trainer's TrainBatch crosses as itself), as long as it has len, chunk and
concat; single_controller never imports it. Pickling stores each tensor compactly: a chunk made by chunk() is
a view of the whole batch's storage, and pickling the view as is would send the whole batch to every worker.

It imports torch only; like all of single_controller, it knows nothing of RL and must never import the
RL layers (controller, trainer, engine, rewards, sync, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

Index = slice | Sequence[int] | torch.Tensor


def chunk_sizes(total: int, n_chunks: int) -> list[int]:
    """Sizes of `n_chunks` contiguous chunks of `total` rows, as equal as possible (first ones larger)."""
    if n_chunks < 1:
        raise ValueError(f"cannot split into {n_chunks} chunks; n_chunks must be >= 1")
    base, extra = divmod(total, n_chunks)
    return [base + (1 if i < extra else 0) for i in range(n_chunks)]


@runtime_checkable
class Rows(Protocol):
    """Rows a DP_SPLIT call cuts into one contiguous chunk per data-parallel rank and joins back in rank order
    (relayrl.single_controller.dispatch). chunk(n) then concat is the identity; chunk sizes are chunk_sizes'."""

    def __len__(self) -> int: ...

    def chunk(self, n_chunks: int) -> list[Any]: ...

    @classmethod
    def concat(cls, parts: Sequence[Any]) -> Any: ...


class DataBatch:
    """Rows of named tensors (same first dim) and per-row Python lists, with batch-wide `meta`."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None,
                 non_tensors: dict[str, list] | None = None):
        self.tensors = dict(tensors or {})
        self.non_tensors = {k: list(v) for k, v in (non_tensors or {}).items()}
        self.meta = dict(meta or {})
        self._length = self._validate()

    def _validate(self) -> int:
        both = set(self.tensors) & set(self.non_tensors)
        if both:
            raise ValueError(f"DataBatch keys {sorted(both)} appear in both tensors and non_tensors; use one")
        lengths: dict[str, int] = {}
        for k, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"DataBatch tensor {k!r} is a {type(t).__name__}, not a torch.Tensor; "
                                "put per-row Python objects in non_tensors")
            if t.dim() == 0:
                raise ValueError(f"DataBatch tensor {k!r} is a scalar; rows need a first dim "
                                 "(put batch-wide values in meta)")
            lengths[k] = t.shape[0]
        lengths.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{k}: {n}" for k, n in lengths.items())
            raise ValueError(f"DataBatch rows disagree ({shown}); every tensor's first dim and every "
                             "non_tensors list must have the same length")
        return next(iter(lengths.values()), 0)

    def __len__(self) -> int:
        return self._length

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | list:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"DataBatch has no {key!r}; it has {self.keys()}")

    def __setitem__(self, key: str, value: torch.Tensor | list) -> None:
        """Add or replace a column: a tensor, or a list of per-row objects, of len(self) rows."""
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor and value.dim() == 0:
            raise ValueError(f"column {key!r} is a scalar; put batch-wide values in meta")
        rows = value.shape[0] if is_tensor else len(value)
        if any(k != key for k in self.keys()) and rows != len(self):
            raise ValueError(f"column {key!r} has {rows} rows but the batch has {len(self)}")
        (self.non_tensors if is_tensor else self.tensors).pop(key, None)
        if is_tensor:
            self.tensors[key] = value
        else:
            self.non_tensors[key] = list(value)
        self._length = rows if len(self.keys()) == 1 else self._length

    def select(self, idx: Index) -> DataBatch:
        """The rows at idx (a slice, a list of ints, an index tensor or a boolean mask); meta is kept."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
            tensors = {k: t[idx] for k, t in self.tensors.items()}
        else:
            index = torch.as_tensor(idx)
            if index.dtype == torch.bool:
                if index.shape != (len(self),):
                    raise ValueError(f"boolean mask has shape {tuple(index.shape)}, expected ({len(self)},)")
                index = index.nonzero().flatten()
            index = index.long().flatten()
            rows = index.tolist()
            tensors = {k: t[index.to(t.device)] for k, t in self.tensors.items()}
        non_tensors = {k: [v[i] for i in rows] for k, v in self.non_tensors.items()}
        return DataBatch(tensors, self.meta, non_tensors)

    def chunk(self, n_chunks: int) -> list[DataBatch]:
        """n_chunks contiguous chunks, sizes from chunk_sizes (may be empty when n_chunks > len)."""
        out, start = [], 0
        for size in chunk_sizes(len(self), n_chunks):
            out.append(self.select(slice(start, start + size)))
            start += size
        return out

    @classmethod
    def concat(cls, parts: Sequence[DataBatch]) -> DataBatch:
        """Rows of parts[0], then parts[1], ...; all parts need the same keys; meta from parts[0]."""
        if not parts:
            raise ValueError("DataBatch.concat needs at least one batch")
        first = parts[0]
        if len(parts) == 1:  # a world of 1 (inline: the worker's own result): nothing to join, nothing copied
            return first
        for i, p in enumerate(parts[1:], 1):
            if set(p.tensors) != set(first.tensors) or set(p.non_tensors) != set(first.non_tensors):
                raise ValueError(f"DataBatch.concat: part {i} has keys {sorted(p.keys())}, "
                                 f"part 0 has {sorted(first.keys())}; all parts need the same keys")
        tensors = {k: torch.cat([p.tensors[k] for p in parts]) for k in first.tensors}
        non_tensors = {k: [x for p in parts for x in p.non_tensors[k]] for k in first.non_tensors}
        return DataBatch(tensors, first.meta, non_tensors)

    def to(self, device: str | torch.device) -> DataBatch:
        return DataBatch({k: t.to(device) for k, t in self.tensors.items()}, self.meta, self.non_tensors)

    def __getstate__(self) -> dict[str, Any]:
        # clone views so only their own elements are pickled, not the storage they were cut from
        compact = {k: t.clone() if _is_partial_view(t) else t for k, t in self.tensors.items()}
        return {"tensors": compact, "non_tensors": self.non_tensors, "meta": self.meta}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors, self.non_tensors, self.meta = state["tensors"], state["non_tensors"], state["meta"]
        self._length = self._validate()

    def __repr__(self) -> str:
        cols = [f"{k}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for k, t in self.tensors.items()]
        cols += [f"{k}: list" for k in self.non_tensors]
        return f"DataBatch(rows={len(self)}, {{{', '.join(cols)}}}, meta={sorted(self.meta)})"


def _is_partial_view(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()
