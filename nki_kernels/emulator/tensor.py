"""``NkiTensor``: storage plus a view (shape, strides and offset in elements of the view dtype).

Element address = ``offset + sum(strides[k] * i_k)`` into the flat storage (nki-spec §6.1). On-chip
storage is ``partitions x per-partition elements``; the partition of an element is
``address // per_partition_elements``. Views are free; every read and write goes through
``_np()`` (a NumPy strided view over the raw bytes) or, for indirect views, an address gather.

Dynamic parts, resolved each time an instruction executes:
  * scalar offsets (``nl.ds(reg, n)``, ``.ap(scalar_offset=)``): ``value * multiplier`` added to the
    offset, with the indexed extent as the bound;
  * a vector offset (``.ap(vector_offset=)``, HBM only): row p starts at ``idx[p] * multiplier``.
"""
from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import dtypes as dt
from . import runtime as rt
from .errors import NkiRuntimeError, NkiValidationError
from .scalars import ds, is_runtime, runtime_value

MAX_VIEW_DIMS = 5
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _prod(xs):
    n = 1
    for x in xs:
        n *= int(x)
    return n


class _Dyn:
    """A runtime offset term: ``source`` (int / register / NkiScalar / (1,1) SBUF int tensor)."""

    __slots__ = ("source", "mult", "extent", "size")

    def __init__(self, source, mult, extent, size):
        self.source, self.mult, self.extent, self.size = source, mult, extent, size

    def value(self):
        s = self.source
        if isinstance(s, NkiTensor):
            return int(np.asarray(s._read()).reshape(-1)[0])
        return runtime_value(s)


class NkiTensor:
    """A tensor view in HBM, SBUF or PSUM."""

    __slots__ = ("storage", "dtype", "shape", "strides", "offset", "name", "_dyn", "_vec", "_ap")

    def __init__(self, storage, dtype, shape, strides=None, offset=0, name="", dyn=(), vec=None,
                 ap=False):
        self.storage = storage
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        if strides is None:
            strides = []
            acc = 1
            for s in reversed(self.shape):
                strides.append(acc)
                acc *= s
            strides = tuple(reversed(strides))
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.name = name or storage.name
        self._dyn = tuple(dyn)
        self._vec = vec
        self._ap = ap

    # ------------------------------------------------------------------ attributes
    @property
    def buffer(self):
        return self.storage.buffer

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return _prod(self.shape)

    @property
    def on_chip(self):
        return self.storage.buffer.on_chip

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def part_elems(self):
        """Elements per partition of the underlying on-chip allocation, in this view's dtype."""
        return self.storage.row_bytes // self.dtype.itemsize

    def __repr__(self):
        return (f"NkiTensor({self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"buffer={self.buffer})")

    def __len__(self):
        return self.shape[0]

    def __bool__(self):
        return True

    def _derive(self, shape, strides, offset, dyn=None, vec=None, dtype=None, ap=None):
        if len(shape) > MAX_VIEW_DIMS:
            raise NkiValidationError(f"view of {self.name!r}: {len(shape)} dims; NKI views have at "
                                     f"most {MAX_VIEW_DIMS}")
        return NkiTensor(self.storage, dtype or self.dtype, shape, strides, offset, self.name,
                         self._dyn if dyn is None else dyn, self._vec if vec is None else vec,
                         self._ap if ap is None else ap)

    def _static_only(self, what):
        if self._vec is not None:
            raise NkiValidationError(f"{what}: {self.name!r} is an indirect (vector_offset) view, "
                                     f"which cannot be re-indexed")

    # ------------------------------------------------------------------ indexing (nki-spec §6.2)
    def __getitem__(self, key):
        self._static_only("indexing")
        if not isinstance(key, tuple):
            key = (key,)
        n_ell = sum(1 for k in key if k is Ellipsis)
        if n_ell > 1:
            raise IndexError("an index can only have a single ellipsis")
        if n_ell:
            i = key.index(Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices for {self.name!r} of shape {self.shape}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset = [], [], self.offset
        dyn = list(self._dyn)
        last_int_dim = None
        for d, (k, n, s) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, ds):
                if is_runtime(k.start) or isinstance(k.start, NkiTensor):
                    if k.size > n:
                        raise IndexError(f"nl.ds size {k.size} exceeds dim {d} of {self.name!r} "
                                         f"({n})")
                    dyn.append(_Dyn(k.start, s, n, k.size))
                    start = 0
                else:
                    start = int(k.start)
                k = slice(start, start + k.size)
            if isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else int(step)
                if step < 1:
                    raise IndexError(f"slice step must be >= 1 in NKI; got {step} on dim {d} of "
                                     f"{self.name!r}")
                if d == 0 and self.on_chip and step != 1:
                    raise NkiValidationError(f"indexing {self.name!r}: partition dim slices must be "
                                             f"contiguous (step 1); got step {step}")
                start = 0 if start is None else int(start)
                stop = n if stop is None else int(stop)
                if start < 0:
                    start += n
                if stop < 0:
                    stop += n
                if not (0 <= start <= stop <= n):
                    raise IndexError(f"slice {start}:{stop} is out of range for dim {d} of "
                                     f"{self.name!r} with shape {self.shape}")
                offset += start * s
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
            elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
                k = int(k)
                if k < 0:
                    k += n
                if not 0 <= k < n:
                    raise IndexError(f"index {k} is out of range for dim {d} of {self.name!r} with "
                                     f"shape {self.shape}")
                offset += k * s
                if d == 0 and self.on_chip:
                    shape.append(1)  # on-chip: an int on the partition dim keeps it (size 1)
                    strides.append(s)
                else:
                    last_int_dim = (len(shape), s)
            elif is_runtime(k) or isinstance(k, NkiTensor):
                dyn.append(_Dyn(k, s, n, 1))
                if d == 0 and self.on_chip:
                    shape.append(1)
                    strides.append(s)
                else:
                    last_int_dim = (len(shape), s)
            else:
                raise IndexError(f"NKI tensors take ints, slices, nl.ds and ... as indices; got "
                                 f"{type(k).__name__} (integer-array and mask indexing do not exist)")
        min_rank = 2 if self.on_chip else 1
        if len(shape) < min_rank and last_int_dim is not None:
            pos, s = last_int_dim
            shape.insert(pos, 1)
            strides.insert(pos, s)
        return self._derive(tuple(shape), tuple(strides), offset, dyn=tuple(dyn))

    def __setitem__(self, key, value):
        from . import isa
        dst = self[key]
        if isinstance(value, NkiTensor):
            if dst.on_chip and value.on_chip:
                isa.tensor_copy(dst=dst, src=value)
            else:
                isa.dma_copy(dst=dst, src=value)
        elif isinstance(value, (int, float)):
            isa.memset(dst=dst, value=value)
        else:
            raise TypeError(f"cannot assign {type(value).__name__} to an NKI tensor")

    # ------------------------------------------------------------------ view methods (§6.3)
    def _chk_dim(self, dim, what, allow0=False):
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"{what}: dim {dim} out of range for {self.ndim}-D {self.name!r}")
        dim %= self.ndim
        if dim == 0 and self.on_chip and not allow0:
            raise NkiValidationError(f"{what}: on-chip tensors cannot change the partition dim "
                                     f"(dim 0) of {self.name!r}")
        return dim

    def slice(self, dim, start, end, step=1):
        dim = self._chk_dim(dim, "slice", allow0=True)
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        dim = self._chk_dim(dim, "select", allow0=not is_runtime(index)
                            and not isinstance(index, NkiTensor))
        if self.on_chip and dim == 0:
            raise NkiValidationError("select: on-chip tensors cannot select on the partition dim")
        key = [slice(None)] * self.ndim
        key[dim] = index
        out = self[tuple(key)]
        # select removes the dim even where __getitem__ would keep a size-1 dim for rank
        if out.ndim == self.ndim:
            shape = out.shape[:dim] + out.shape[dim + 1:]
            strides = out.strides[:dim] + out.strides[dim + 1:]
            out = out._derive(shape, strides, out.offset)
        return out

    def permute(self, dims):
        dims = tuple(int(d) % self.ndim for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of {self.ndim} dims")
        if self.on_chip and dims[0] != 0:
            raise NkiValidationError("permute: on-chip tensors must keep the partition dim first")
        return self._derive(tuple(self.shape[d] for d in dims), tuple(self.strides[d] for d in dims),
                            self.offset)

    def broadcast(self, dim, size):
        dim = self._chk_dim(dim, "broadcast")
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast: dim {dim} of {self.name!r} has size {self.shape[dim]}, "
                             f"must be 1")
        shape = list(self.shape)
        strides = list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return self._derive(tuple(shape), tuple(strides), self.offset)

    def expand_dim(self, dim):
        if not 0 <= dim <= self.ndim:
            raise IndexError(f"expand_dim: dim {dim} out of range")
        if dim == 0 and self.on_chip:
            raise NkiValidationError("expand_dim: on-chip tensors keep the partition dim first")
        s = self.strides[dim] * self.shape[dim] if dim < self.ndim else 1
        return self._derive(self.shape[:dim] + (1,) + self.shape[dim:],
                            self.strides[:dim] + (s,) + self.strides[dim:], self.offset)

    def squeeze_dim(self, dim):
        dim = self._chk_dim(dim, "squeeze_dim")
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim: dim {dim} has size {self.shape[dim]}, must be 1")
        return self._derive(self.shape[:dim] + self.shape[dim + 1:],
                            self.strides[:dim] + self.strides[dim + 1:], self.offset)

    def reshape_dim(self, dim, shape):
        dim = self._chk_dim(dim, "reshape_dim")
        shape = list(shape)
        n = self.shape[dim]
        if shape.count(-1) > 1:
            raise ValueError("reshape_dim: at most one -1")
        if -1 in shape:
            rest = _prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = n // rest if rest else 0
        if _prod(shape) != n:
            raise ValueError(f"reshape_dim: {shape} does not split a dim of size {n}")
        st = []
        acc = self.strides[dim]
        for s in reversed(shape):
            st.append(acc)
            acc *= s
        return self._derive(self.shape[:dim] + tuple(shape) + self.shape[dim + 1:],
                            self.strides[:dim] + tuple(reversed(st)) + self.strides[dim + 1:],
                            self.offset)

    def flatten_dims(self, start_dim, end_dim):
        start_dim %= self.ndim
        end_dim %= self.ndim
        if self.on_chip and start_dim == 0:
            raise NkiValidationError("flatten_dims: on-chip tensors keep the partition dim")
        for d in range(start_dim, end_dim):
            if self.strides[d] != self.strides[d + 1] * self.shape[d + 1]:
                raise NkiValidationError(f"flatten_dims: dims {start_dim}..{end_dim} of "
                                         f"{self.name!r} are not contiguous")
        n = _prod(self.shape[start_dim:end_dim + 1])
        return self._derive(self.shape[:start_dim] + (n,) + self.shape[end_dim + 1:],
                            self.strides[:start_dim] + (self.strides[end_dim],)
                            + self.strides[end_dim + 1:], self.offset)

    def reshape(self, shape):
        self._static_only("reshape")
        if isinstance(shape, int):
            shape = (shape,)
        shape = [int(s) for s in shape]
        if shape.count(-1) == 1:
            rest = _prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.size // rest
        if _prod(shape) != self.size:
            raise ValueError(f"reshape: cannot reshape {self.name!r} of shape {self.shape} "
                             f"({self.size} elements) into {tuple(shape)}")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiValidationError(f"reshape: on-chip tensors keep the partition dim; "
                                     f"{self.shape} -> {tuple(shape)} changes it")
        strides = _reshape_strides(self.shape, self.strides, shape)
        if strides is None:
            raise NkiValidationError(f"reshape: the layout of {self.name!r} (shape {self.shape}, "
                                     f"strides {self.strides}) does not allow shape {tuple(shape)} "
                                     f"without a copy")
        return self._derive(tuple(shape), tuple(strides), self.offset)

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        """einops-style: ``(('b', ('h', 'w')), ('b', 'w', 'h'), {'h': 4})``; splits, permutes,
        then merges (merges must be of contiguous dims)."""
        fixed_sizes = dict(fixed_sizes or {})
        if len(src_pattern) != self.ndim:
            raise ValueError(f"rearrange: source pattern has {len(src_pattern)} groups for a "
                             f"{self.ndim}-D tensor")
        t = self
        names = []
        d = 0
        for grp, n in zip(src_pattern, self.shape):
            if isinstance(grp, tuple):
                sizes = [fixed_sizes.get(g, -1) for g in grp]
                t = t.reshape_dim(d, sizes) if len(grp) > 1 else t
                for g, s in zip(grp, t.shape[d:d + len(grp)]):
                    fixed_sizes[g] = s
                names.extend(grp)
                d += len(grp)
            else:
                fixed_sizes[grp] = n
                names.append(grp)
                d += 1
        flat_dst = [g for grp in dst_pattern for g in (grp if isinstance(grp, tuple) else (grp,))]
        if sorted(flat_dst) != sorted(names):
            raise ValueError("rearrange: source and destination name different axes")
        t = t.permute([names.index(g) for g in flat_dst])
        d = 0
        for grp in dst_pattern:
            if isinstance(grp, tuple) and len(grp) > 1:
                t = t.flatten_dims(d, d + len(grp) - 1)
            d += 1
        return t

    def view(self, dtype):
        self._static_only("view")
        dtype = dt.as_nki_dtype(dtype, "view")
        if dtype.itemsize == self.itemsize:
            return self._derive(self.shape, self.strides, self.offset, dtype=dtype)
        if self.strides[-1] != 1:
            raise NkiValidationError(f"view: the last dim of {self.name!r} must be contiguous to "
                                     f"reinterpret {self.dtype} as {dtype}")
        if self._dyn:
            raise NkiValidationError("view: not allowed after a dynamic select / ds")
        a, b = self.itemsize, dtype.itemsize
        if b > a:
            r = b // a
            if self.shape[-1] % r or self.offset % r or any(s % r for s in self.strides[:-1]):
                raise NkiValidationError(f"view: {self.name!r} of shape {self.shape} ({self.dtype}) "
                                         f"cannot be viewed as {dtype}: sizes and offsets must be "
                                         f"divisible by {r}")
            shape = self.shape[:-1] + (self.shape[-1] // r,)
            strides = tuple(s // r for s in self.strides[:-1]) + (1,)
            off = self.offset // r
        else:
            r = a // b
            shape = self.shape[:-1] + (self.shape[-1] * r,)
            strides = tuple(s * r for s in self.strides[:-1]) + (1,)
            off = self.offset * r
        return self._derive(shape, strides, off, dtype=dtype)

    reinterpret_cast = view

    def bitcast(self, dtype):
        return self.view(dtype)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0,
           dtype=None):
        """Address the underlying storage with ``[[stride, count], ...]`` (outermost first)."""
        where = f"ap on {self.name!r}"
        dtype = self.dtype if dtype is None else dt.as_nki_dtype(dtype, where)
        if scalar_offset is not None and vector_offset is not None:
            raise NkiValidationError(f"{where}: scalar_offset and vector_offset are mutually "
                                     f"exclusive")
        pattern = [tuple(int(x) for x in p) for p in pattern]
        if not pattern or any(len(p) != 2 for p in pattern):
            raise ValueError(f"{where}: pattern must be a list of [stride, count] pairs")
        if any(c <= 0 for _, c in pattern):
            raise NkiValidationError(f"{where}: every count must be positive; got {pattern}")
        if offset is None:
            base = self.offset * self.itemsize // dtype.itemsize
        else:
            base = int(offset)
        if self.on_chip:
            # The first pair is the partition access, which the hardware steps contiguously (one
            # partition per step; no partition stride is encoded). Its step must be the element
            # count of the whole free dimension "of the tensor" (NKI Access Patterns guide,
            # "Restriction on SBUF/PSUM Tensors"): of the tensor .ap() is called on, which for a
            # view of a wider allocation is the view's free size, or of the allocation (nki-spec
            # 6.4). NKI Library's mlp_tkg (bias, fused gate/up, LNC 2; a device QoR baseline in
            # test_mlp_tkg.py) steps a (T, I) view of a (T, 2I) tile by I. Either way the access
            # moves one partition per step.
            pe = self.storage.row_bytes // dtype.itemsize
            view_free = math.prod(self.shape[1:]) * self.itemsize // dtype.itemsize
            if pattern[0][0] not in (pe, view_free) and pattern[0][1] > 1:
                raise NkiValidationError(
                    f"{where}: on-chip access patterns must address whole partitions: the first "
                    f"[stride, count] pair's stride must be the free size of the tensor "
                    f"({view_free}) or of its allocation ({pe}) in {dtype} elements; got "
                    f"{pattern[0][0]}")
            pattern[0] = (pe, pattern[0][1])
            if pattern[0][1] > 128:
                raise NkiValidationError(f"{where}: partition count {pattern[0][1]} exceeds 128")
        shape = tuple(c for _, c in pattern)
        strides = tuple(s for s, _ in pattern)
        if len(shape) > MAX_VIEW_DIMS:
            raise NkiValidationError(f"{where}: {len(shape)} dims; at most {MAX_VIEW_DIMS}")
        dyn = ()
        vec = None
        if scalar_offset is not None or vector_offset is not None:
            if not 0 <= indirect_dim < self.ndim:
                raise NkiValidationError(f"{where}: indirect_dim {indirect_dim} out of range")
            m = self.strides[indirect_dim] * self.itemsize // dtype.itemsize
            extent = self.shape[indirect_dim]
            if scalar_offset is not None:
                if isinstance(scalar_offset, NkiTensor):
                    _check_index_tensor(scalar_offset, where, "scalar_offset", (1, 1))
                elif not is_runtime(scalar_offset) and not isinstance(scalar_offset, int):
                    raise TypeError(f"{where}: scalar_offset must be a (1,1) SBUF int tensor, a "
                                    f"register or an NkiScalar; got {type(scalar_offset).__name__}")
                # bound: r plus the count of the pattern dim that walks the indexed dim, as for
                # nl.ds(r, n): A.ap([[512, 128], [1, 256]], scalar_offset=r) needs r + 128 <= 512
                rows = next((c for s, c in pattern if s == m), 1)
                # an access pattern addresses the allocation, not the view: a pattern may walk
                # more rows of the indexed stride than the view's dim has (a [1, N] view read
                # as 32 rows); the bound is then the rows of that stride inside the allocation
                if rows > extent and m > 0:
                    extent = max(extent, (self.storage.nbytes // dtype.itemsize - base) // m)
                dyn = (_Dyn(scalar_offset, m, extent, rows),)
            else:
                if self.on_chip:
                    raise NkiValidationError(f"{where}: vector_offset is only valid on HBM tensors "
                                             f"(DMA gather/scatter)")
                if indirect_dim != 0:
                    raise NkiValidationError(f"{where}: vector_offset needs indirect_dim=0")
                if not isinstance(vector_offset, NkiTensor):
                    raise TypeError(f"{where}: vector_offset must be an SBUF (P, 1) int tensor")
                _check_index_tensor(vector_offset, where, "vector_offset", None)
                if vector_offset.shape[0] != shape[0]:
                    raise NkiValidationError(
                        f"{where}: vector_offset has {vector_offset.shape[0]} rows but the "
                        f"pattern's first count is {shape[0]}")
                vec = _Dyn(vector_offset, m, extent, 1)
        return NkiTensor(self.storage, dtype, shape, strides, base, self.name, dyn, vec, ap=True)

    def get_pattern(self):
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_contiguous(self):
        dims = range(1, self.ndim) if self.on_chip else range(self.ndim)
        acc = 1
        for d in reversed(list(dims)):
            if self.shape[d] != 1 and self.strides[d] != acc:
                return False
            acc *= self.shape[d]
        return True

    def is_indirect(self):
        return bool(self._dyn) or self._vec is not None

    def indirect(self, index, num_elem=None):
        raise NotImplementedError(
            "NkiTensor.indirect (gen4 compute-engine tensor indirection, nki-spec §6.5) is not "
            "implemented in the nki-kernels emulator; use .ap(vector_offset=...) with dma_copy")

    # ------------------------------------------------------------------ element access
    def _base_offset(self, check_oob=True):
        """Offset with the scalar dynamic terms resolved; None when one is out of bounds."""
        off = self.offset
        for d in self._dyn:
            v = d.value()
            if v < 0 or v + d.size > d.extent:
                return None
            off += v * d.mult
        return off

    def _flat(self):
        if self.storage.pending is not None:   # first use of an SBUF tensor: it takes its space now
            self.storage.pending.place(self.storage)
        if self.storage.retired:
            raise NkiValidationError(
                f"{self.name or 'a tile'!r} ({self.buffer.name}){rt._allocated_at(self.storage.site)} "
                f"is used after its space was reused: {self.storage.retired}")
        self.storage.last_use = next(rt._uses)
        raw = self.storage.raw
        return raw.view(self.dtype.np) if self.dtype.np.itemsize > 1 else (
            raw if raw.dtype == self.dtype.np else raw.view(self.dtype.np))

    def _bounds(self, off):
        lo = hi = off
        for s, n in zip(self.strides, self.shape):
            if s >= 0:
                hi += s * (n - 1)
            else:
                lo += s * (n - 1)
        return lo, hi

    def _np(self, oob=None):
        """A NumPy view of the elements (storage dtype). Raises for indirect views."""
        if self._vec is not None:
            raise RuntimeError("internal: vector-offset views are accessed through _gather/_scatter")
        off = self._base_offset()
        if off is None:
            raise NkiRuntimeError(self._oob_msg())
        flat = self._flat()
        lo, hi = self._bounds(off)
        if lo < 0 or hi >= flat.shape[0]:
            raise NkiValidationError(
                f"access to {self.name!r} is out of bounds: elements [{lo}, {hi}] of an allocation "
                f"of {flat.shape[0]} {self.dtype} elements (shape {self.shape}, strides "
                f"{self.strides}, offset {off})")
        isz = flat.itemsize
        # stride over an unsigned view of the same width: as_strided cannot rebuild some
        # ml_dtypes types from their array interface ('<f1' for float8_e5m2)
        raw = flat.view(_UINT[isz])
        v = as_strided(raw[off:], shape=self.shape, strides=[s * isz for s in self.strides],
                       writeable=True)
        return v.view(flat.dtype)

    def _oob_msg(self):
        vals = [(d.value(), d.extent, d.size) for d in self._dyn]
        return (f"dynamic offset out of bounds on {self.name!r}: (value, extent, size) = {vals} "
                f"with oob_mode.error")

    def _row_addresses(self):
        """(rows, inner) element addresses for a vector-offset view, and a per-row valid mask."""
        d = self._vec
        idx = np.asarray(d.source._read()).reshape(-1).astype(np.int64)
        valid = (idx >= 0) & (idx < d.extent)
        inner = np.zeros(self.shape[1:], dtype=np.int64) if self.ndim > 1 else np.zeros((),
                                                                                      np.int64)
        for k, (s, n) in enumerate(zip(self.strides[1:], self.shape[1:])):
            sh = [1] * (self.ndim - 1)
            sh[k] = n
            inner = inner + (np.arange(n, dtype=np.int64) * s).reshape(sh)
        rows = self.offset + np.where(valid, idx, 0) * d.mult
        addrs = rows.reshape((-1,) + (1,) * (self.ndim - 1)) + inner[None, ...]
        flat_n = self._flat().shape[0]
        if addrs.size and (addrs[valid].min(initial=0) < 0 or addrs[valid].max(initial=0) >= flat_n):
            raise NkiValidationError(f"gather/scatter on {self.name!r} reaches outside the "
                                     f"allocation of {flat_n} elements")
        return addrs, valid

    def _read(self, oob_skip=False):
        """The elements in the storage dtype (a copy for indirect views)."""
        if self._vec is None:
            return self._np()
        addrs, valid = self._row_addresses()
        if not valid.all() and not oob_skip:
            bad = np.flatnonzero(~valid)[:4]
            raise NkiRuntimeError(f"indirect read of {self.name!r}: vector_offset rows {bad.tolist()} "
                                  f"are out of bounds [0, {self._vec.extent}) with oob_mode.error")
        return self._flat()[addrs], valid

    def _write(self, values, oob_skip=False, valid=None):
        """Store values (already in the storage dtype, broadcastable to the view shape)."""
        if self._vec is None:
            v = self._np()
            v[...] = values
            return
        addrs, ok = self._row_addresses()
        if valid is not None:
            ok = ok & valid
        elif not ok.all() and not oob_skip:
            bad = np.flatnonzero(~ok)[:4]
            raise NkiRuntimeError(f"indirect write to {self.name!r}: vector_offset rows "
                                  f"{bad.tolist()} are out of bounds [0, {self._vec.extent}) with "
                                  f"oob_mode.error")
        values = np.broadcast_to(values, self.shape)
        self._flat()[addrs[ok]] = values[ok]

    # helpers for instructions -------------------------------------------------
    def read_pf(self):
        """Elements as a ``[P, F]`` array in the storage dtype (free dims flattened row-major)."""
        a = self._read()
        if isinstance(a, tuple):
            a = a[0]
        return np.reshape(a, (self.shape[0], -1)) if self.ndim > 1 else a.reshape(self.shape[0], 1)

    def read_f32(self):
        if self.dtype.is_x4:
            raise NkiValidationError(f"{self.name!r}: MX packed {self.dtype} data can only be read "
                                     f"by nc_matmul_mx, DMA and view()")
        return dt.to_f32(self.read_pf())

    def write_pf(self, values_f32_or_native, cast=True):
        """Write ``[P, F]`` results into the view (casting float32 with the hardware rules)."""
        v = dt.cast(values_f32_or_native, self.dtype) if cast else values_f32_or_native
        self._write(np.reshape(v, self.shape))

    @property
    def free_size(self):
        return _prod(self.shape[1:]) if self.ndim > 1 else 1

    @property
    def partitions(self):
        return self.shape[0]


def _check_index_tensor(t, where, what, shape):
    if not isinstance(t, NkiTensor) or t.buffer is not rt.sbuf:
        raise NkiValidationError(f"{where}: {what} must be an SBUF tensor")
    if not t.dtype.is_int:
        raise NkiValidationError(f"{where}: {what} must have an integer dtype; got {t.dtype}")
    if shape is not None and t.shape != shape and t.size != 1:
        raise NkiValidationError(f"{where}: {what} must have shape {shape}; got {t.shape}")


def _reshape_strides(old_shape, old_strides, new_shape):
    """Strides for a no-copy reshape (NumPy's algorithm), or None if a copy would be needed."""
    old = [(n, s) for n, s in zip(old_shape, old_strides) if n != 1]
    new_strides = [0] * len(new_shape)
    oi = ni = 0
    on = len(old)
    nn = len(new_shape)
    # map non-unit dims
    while ni < nn and oi < on:
        if new_shape[ni] == 1:
            new_strides[ni] = 1
            ni += 1
            continue
        np_, op_ = new_shape[ni], old[oi][0]
        nj, oj = ni + 1, oi + 1
        while np_ != op_:
            if np_ < op_:
                np_ *= new_shape[nj]
                nj += 1
            else:
                op_ *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        new_strides[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            new_strides[k - 1] = new_strides[k] * new_shape[k]
        ni, oi = nj, oj
    while ni < nn:
        new_strides[ni] = 1
        ni += 1
    return new_strides


def hbm_tensor(array: np.ndarray, buffer, name: str) -> NkiTensor:
    """Wrap a host array as an HBM kernel argument (copies the bytes into emulator storage)."""
    dtype = dt.from_numpy(array.dtype)
    st = rt.new_storage(buffer, array.shape, dtype, name=name, fill=False)
    st.raw[...] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return NkiTensor(st, dtype, array.shape if array.ndim else (1,), name=name)


def to_numpy(t: NkiTensor) -> np.ndarray:
    """Copy a (whole, contiguous) HBM tensor's elements out as a NumPy array (x4 data in its host
    dtype, ``np.dtype(nl.float8_e4m3fn_x4)``: the packed words under the x4 type's name)."""
    a = np.array(t._np(), copy=True)
    return a.view(t.dtype.dtype) if t.dtype.is_x4 else a
