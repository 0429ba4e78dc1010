"""A Box is a rectangle of a logical tensor: the unit the reshard planner reasons in.

A 2-D box is a half-open row range x a half-open column range; a 1-D box (biases, norms) has rows
only (c0 = c1 = None). Boxes are plain integers, so plans are hashable, printable data:

    Box(4, 8, 0, 16)  = rows [4, 8) x cols [0, 16)  of e.g. q_proj.weight [32, 16]
    a & b             = the overlap (None when empty)
    b.shift(-4, 0)    = the same rectangle in a tensor whose row 0 is logical row 4

It imports the standard library only; like all of sync, it must never import the trainer, the engine or
the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    r0: int
    r1: int
    c0: int | None = None
    c1: int | None = None

    def __post_init__(self) -> None:
        if (self.c0 is None) != (self.c1 is None):
            raise ValueError(f"a box has both column bounds or neither, got c0={self.c0}, c1={self.c1}")
        if not 0 <= self.r0 <= self.r1 or (self.c0 is not None and not 0 <= self.c0 <= self.c1):
            raise ValueError(f"box bounds must satisfy 0 <= start <= stop, got {self}")

    # ---- construction ----
    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        """The whole of a tensor of `shape` (1-D or 2-D)."""
        return cls.at((0,) * len(shape), shape)

    @classmethod
    def at(cls, offset: tuple[int, ...], shape: tuple[int, ...]) -> Box:
        """The box of `shape` whose first element sits at `offset`."""
        if len(offset) != len(shape) or len(shape) not in (1, 2):
            raise ValueError(f"boxes are 1-D or 2-D; got offset {offset} and shape {shape}")
        if len(shape) == 1:
            return cls(offset[0], offset[0] + shape[0])
        return cls(offset[0], offset[0] + shape[0], offset[1], offset[1] + shape[1])

    # ---- geometry ----
    @property
    def ndim(self) -> int:
        return 1 if self.c0 is None else 2

    @property
    def offset(self) -> tuple[int, ...]:
        return (self.r0,) if self.c0 is None else (self.r0, self.c0)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.r1 - self.r0,) if self.c0 is None else (self.r1 - self.r0, self.c1 - self.c0)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def empty(self) -> bool:
        return self.size == 0

    def with_rows(self, r0: int, r1: int) -> Box:
        return Box(r0, r1, self.c0, self.c1)

    def with_cols(self, c0: int, c1: int) -> Box:
        if self.c0 is None:
            raise ValueError("a 1-D box has no columns")
        return Box(self.r0, self.r1, c0, c1)

    def shift(self, dr: int, dc: int = 0) -> Box:
        """Translate by (dr, dc): moves a box between logical and local coordinates."""
        if self.c0 is None:
            return Box(self.r0 + dr, self.r1 + dr)
        return Box(self.r0 + dr, self.r1 + dr, self.c0 + dc, self.c1 + dc)

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of a tensor that holds exactly `outer`."""
        return self.shift(-outer.r0, -(outer.c0 or 0))

    def contains(self, other: Box) -> bool:
        return (self & other) == other

    def __and__(self, other: Box) -> Box | None:
        """Intersection, or None when the boxes do not overlap (or either is empty)."""
        if self.ndim != other.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-D box with a {other.ndim}-D box")
        r0, r1 = max(self.r0, other.r0), min(self.r1, other.r1)
        if r0 >= r1:
            return None
        if self.c0 is None:
            return Box(r0, r1)
        c0, c1 = max(self.c0, other.c0), min(self.c1, other.c1)
        return Box(r0, r1, c0, c1) if c0 < c1 else None

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor with this: `t[box.slices()]`."""
        if self.c0 is None:
            return (slice(self.r0, self.r1),)
        return slice(self.r0, self.r1), slice(self.c0, self.c1)

    def __str__(self) -> str:
        rows = f"{self.r0}:{self.r1}"
        return f"[{rows}]" if self.c0 is None else f"[{rows}, {self.c0}:{self.c1}]"
