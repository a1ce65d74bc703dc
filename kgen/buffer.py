"""Where a stage's tensors lie in memory: a ``Buffer`` is the logical tensor ``(N, C, *S)``
and the tile(s) holding it (its physical size may exceed the logical one when a convolution
was cropped, and a sub-pixel convolution leaves one tile per phase). Static; only the batch
is known at run time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from .ir import TensorType


@dataclass(frozen=True)
class Tile:
    """One physical buffer: its size per logical dim (C, *S), strides (elements) and offsets."""

    dims: tuple[int, ...]  # physical (C, *S)
    strides: tuple[int, ...]  # per (C, *S)
    sample_stride: int
    offset: tuple[int, ...]  # logical position 0 lies at this physical position (spatial dims)
    residue: tuple[int, ...] = ()  # sub-pixel phase: logical o = stride*m + residue

    @property
    def memory_order(self) -> list[int]:
        """Dims (0 = C, 1.. = spatial) from outermost to innermost; a broadcast dim (stride 0) outermost."""
        return sorted(range(len(self.dims)), key=lambda d: -self.strides[d] if self.strides[d] else -math.inf)

    @property
    def stored(self) -> int:
        """Elements of a sample that lie in memory: a broadcast dim (stride 0) holds one."""
        return math.prod(n for n, s in zip(self.dims, self.strides) if s)


@dataclass(frozen=True)
class Buffer:
    """A stage's input: the logical shape, and the tile(s) holding it."""

    logical: tuple[int, ...]  # (C, *S)
    # contiguous | channels_last | strided: a view of another stage's tensor read in place (a permute's strides, a
    # slice's, an expand's zeros; ``view_buffer``), which only families that read any strides take
    layout: str
    tiles: tuple[Tile, ...]
    phase_stride: tuple[int, ...] = ()  # sub-pixel: one tile per phase

    @property
    def phased(self) -> bool:
        return bool(self.phase_stride)

    @cached_property
    def dense(self) -> bool:
        """One tile holding exactly the logical tensor in its layout's own strides (contiguous or channels_last)."""
        return self.addressable and self.layout != "strided"

    @property
    def batched_matrices(self) -> bool:
        """Whether cuBLAS's batched product takes this view as it is (``batched_matrix``). at::matmul copies any
        other view into a plain tensor first (its reshape of the batch dims, or bmm's own copy)."""
        if len(self.logical) < 2:  # [N, K]: one matrix
            return True
        return self.addressable and batched_matrix(self.sizes_and_strides(2))

    def sizes_and_strides(self, batch: int) -> list[tuple[int, int]]:
        """(size, stride) of each dim of the tensor at ``batch``, the batch's first (one tile: ``addressable``)."""
        t = self.tiles[0]
        return [(batch, t.sample_stride)] + list(zip(t.dims, t.strides))

    @cached_property  # (asked ~10^6 times by a whole model's plan search)
    def addressable(self) -> bool:
        """One tile holding exactly the logical tensor at any strides (a plain tensor, a channels_last one, a view
        of one): what ATen's view of it is, and what a view of that view reads."""
        t = self.tiles[0]
        return not self.phased and len(self.tiles) == 1 and t.dims == self.logical and not any(t.offset)

    @cached_property
    def flat(self) -> bool:
        """A plain contiguous (C, *S) tensor: element e of a sample lies at e."""
        return self.dense and self.layout == "contiguous"

    def channel_vectors(self, vector: int) -> bool:
        """Whether every tile holds all channels of a position adjacent (channel stride 1) and every
        position starts at a multiple of ``vector`` values: a load of ``vector`` channels is aligned to
        its size wherever the tile pointers are."""
        return all(t.dims[0] == self.logical[0] and t.strides[0] == 1 and t.sample_stride % vector == 0
                   and all(s % vector == 0 for s in t.strides[1:]) for t in self.tiles)

    def element_vectors(self, vector: int) -> bool:
        """Whether logical elements e..e + ``vector`` - 1 of a sample (row-major, e a multiple of ``vector``) lie
        adjacent in memory, aligned to the vector wherever the tile pointer is: one tile holding exactly the
        logical tensor (any strides: a plain tensor or a view of one), whose innermost dims form a contiguous run a
        multiple of ``vector`` long, and whose other strides and sample stride are multiples of ``vector``."""
        if not self.addressable:
            return False
        t = self.tiles[0]
        dims = [(n, s) for n, s in zip(t.dims, t.strides) if n != 1]  # a dim of size 1 is never stepped
        run, d = 1, len(dims)
        while d and dims[d - 1][1] == run:  # the contiguous run of innermost dims
            d -= 1
            run *= dims[d][0]
        return run % vector == 0 and t.sample_stride % vector == 0 and all(s % vector == 0 for _, s in dims[:d])

    def repeats_vectors(self, vector: int) -> bool:
        """Whether logical elements e..e + ``vector`` - 1 of a sample (row-major, e a multiple of ``vector``) are one
        value of memory: one tile holding exactly the logical tensor whose last dim is a broadcast (stride 0, an
        expand's) a multiple of ``vector`` long."""
        t = self.tiles[0]
        return self.addressable and t.strides[-1] == 0 and t.dims[-1] % vector == 0

    @property
    def innermost(self) -> int:
        order = [d for d in self.tiles[0].memory_order if self.logical[d] > 1]
        return order[-1] if order else len(self.logical) - 1


def batched_matrix(dims: list[tuple[int, int]]) -> bool:
    """Whether a tensor of these (size, stride) per dim is what cuBLAS's strided batched product reads as it is:
    its last two dims one matrix in either order (one of stride 1, the other at least its size), the dims before
    them one batch stride (each one's stride the next one's times its size; dims of size 1 left out). The C++ twin:
    kgen_runtime.h detail::batched_matrix."""
    (m, sm), (k, sk) = dims[-2:]
    if not ((sk == 1 or k == 1) and sm >= max(k, 1) or (sm == 1 or m == 1) and sk >= max(m, 1)):
        return False
    batch = [(n, s) for n, s in dims[:-2] if n != 1]
    return all(outer == inner * n for (_, outer), (n, inner) in zip(batch, batch[1:]))


MAX_PRODUCT_SLICES = 16  # kgen_runtime.h detail::kMaxProductSlices
# bytes at::matmul must copy per extra launch of the slices before slicing pays: about what an H200 copies in a
# launch's time (Target.launch_s at its DRAM rate); kgen_runtime.h detail::kSliceBytes
SLICE_BYTES = 1 << 23


def product_slice_dim(x: list[tuple[int, int]], w: list[tuple[int, int]], value_bytes: int) -> int | None:
    """The batch dim (not the batch itself) of at most MAX_PRODUCT_SLICES indices whose slices of x, w (each as
    (size, stride) per dim) and their contiguous product cuBLAS reads as they are, where at::matmul would copy x or w
    first and the copies outweigh the extra launches: kgen::matmul then runs one bmm per index on the views (Mamba2's
    einsums, whose permutes interleave the batch dims, at its batch of 2048). The fewest slices; None where there is
    no such dim or nothing to save. The C++ twin: kgen_runtime.h detail::product_slice_dim."""
    r = len(x)
    if r < 4 or len(w) != r or [n for n, _ in x[:-2]] != [n for n, _ in w[:-2]] or x[-1][0] != w[-2][0]:
        return None
    copied = sum(value_bytes * math.prod(n for n, _ in t) for t in (x, w) if not batched_matrix(t))
    if not copied:
        return None
    sizes = [n for n, _ in x[:-1]] + [w[-1][0]]
    out = list(zip(sizes, [math.prod(sizes[d + 1:]) for d in range(r)]))
    best = None
    for d in range(1, r - 2):
        n = x[d][0]
        if n == 1 or n > MAX_PRODUCT_SLICES or (best is not None and n >= x[best][0]) or copied < (n - 1) * SLICE_BYTES:
            continue
        if all(batched_matrix(t[:d] + t[d + 1:]) for t in (x, w, out)):
            best = d
    return best


def strides_of(dims: tuple[int, ...], layout: str) -> tuple[tuple[int, ...], int]:
    """Strides of a (C, *S) sample in ``layout``, and the sample stride."""
    order = list(range(len(dims)))
    if layout == "channels_last":
        order = order[1:] + [0]
    strides = [0] * len(dims)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= dims[d]
    return tuple(strides), step


def dense_buffer(logical, physical, layout) -> Buffer:
    strides, sample = strides_of(tuple(physical), layout)
    tile = Tile(tuple(physical), strides, sample, (0,) * (len(physical) - 1))
    return Buffer(tuple(logical), layout, (tile,))


def flat_buffer(t: TensorType) -> Buffer:
    """A plain contiguous tensor of type ``t``."""
    shape = tuple(t.shape[1:])
    return dense_buffer(shape, shape, "contiguous")


def view_buffer(src: Buffer, view_strides: tuple[int, ...], logical: tuple[int, ...]) -> Buffer:
    """The tensor ``src`` (one tile holding it, at any strides: ``Buffer.addressable``) seen through a view of
    logical shape ``logical`` whose dim d steps ``view_strides[d]`` elements of it (0: broadcast): channels_last where
    the strides and the sample's are that layout's, else strided."""
    sample = src.tiles[0].sample_stride
    strides = tuple(view_strides)
    layout = "channels_last" if len(logical) > 1 and (strides, sample) == strides_of(logical, "channels_last") else "strided"
    return Buffer(tuple(logical), layout, (Tile(tuple(logical), strides, sample, (0,) * (len(logical) - 1)),))


def permuted_buffer(src: Buffer, dims: tuple[int, ...]) -> Buffer:
    """``src`` permuted by ``dims`` (over N, C, *S; the batch stays first), read in place."""
    strides = src.tiles[0].strides
    return view_buffer(src, tuple(strides[d - 1] for d in dims[1:]), tuple(src.logical[d - 1] for d in dims[1:]))


def sliced_buffer(src: Buffer, dim: int, start: int, end: int, step: int) -> Buffer:
    """``src`` sliced along ``dim`` (of N, C, *S), read in place: ATen's view keeps the source's strides (the dim's
    times ``step``) and starts ``start`` values in (its data pointer)."""
    logical, view = list(src.logical), list(src.tiles[0].strides)
    logical[dim - 1] = len(range(start, end, step))
    view[dim - 1] *= step
    return view_buffer(src, tuple(view), tuple(logical))


def expanded_buffer(src: Buffer, shape: tuple[int, ...]) -> Buffer:
    """``src`` expanded to (C, *S) = ``shape`` (its dims of size 1 repeated: stride 0), read in place."""
    return view_buffer(src, tuple(0 if n != m else s for s, n, m in zip(src.tiles[0].strides, shape, src.logical)),
                       tuple(shape))
