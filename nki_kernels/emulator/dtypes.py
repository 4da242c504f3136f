"""NKI data types (``nl.bfloat16``, ``nl.float8_e4m3fn_x4``, ...) and the casts between them.

Storage uses NumPy / ml_dtypes types. MX packed ``*_x4`` types are 32-bit (fp8) or 16-bit (fp4)
containers of four values; one "element" of such a tensor is one container (nki-spec §5.1).

Cast rules (nki-spec §5.3): float->float rounds to nearest even (ml_dtypes); float->int rounds to
nearest even and saturates (NaN -> 0: undocumented, our choice); int->float exact up to 2^24.
fp8 overflow on hardware is undocumented: we follow ml_dtypes (inf for e4m3/e5m2, NaN for e4m3fn),
so kernels that need saturation must clamp explicitly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


class NkiDtype:
    """A dtype object as passed to ``nl.ndarray(..., dtype=nl.bfloat16)``."""

    __slots__ = ("name", "np", "kind", "itemsize", "lanes", "lane_np")

    def __init__(self, name, np_dtype, kind, lanes=1, lane_np=None):
        self.name = name
        self.np = np.dtype(np_dtype)
        self.kind = kind  # 'float' | 'int' | 'uint' | 'bool' | 'x4'
        self.itemsize = self.np.itemsize
        self.lanes = lanes  # values per container (4 for *_x4)
        self.lane_np = np.dtype(lane_np) if lane_np is not None else None

    def __repr__(self):
        return f"nl.{self.name}"

    def __str__(self):
        # NKI Library compares dtype names: str(nl.bfloat16) == "bfloat16"
        return self.name

    def __format__(self, spec):
        # the emulator's messages say "nl.bfloat16"; str() keeps the bare name
        return format(repr(self), spec)

    def __reduce__(self):
        return (by_name, (self.name,))

    # NumPy interoperability: ``np.dtype(nl.bfloat16)``, ``np.zeros(s, dtype=nl.float32)`` and
    # ``arr.astype(nl.float16)`` use this attribute (NumPy's ``.dtype`` protocol). x4 types give
    # a one-field structured dtype named after the NKI type over their uint container (and that
    # name in the dtype's metadata): host arrays of packed MX data keep their identity through
    # NumPy's copies, ``concatenate`` and ``stack`` and when passed into a kernel, and
    # ``str(arr.dtype)`` names the type, which NKI Library's harness reads (``'x4' in str(dtype)``).
    # They carry no arithmetic: ``.view(np.uint32)`` (``np.uint16`` for fp4) gives the packed
    # words.
    @property
    def dtype(self):
        return _NP_OF[self.name]

    def __eq__(self, other):
        if isinstance(other, NkiDtype):
            return other is self
        if isinstance(other, (str, np.dtype, type)):
            try:
                return from_numpy(other) is self if not isinstance(other, str) \
                    else other == self.name
            except TypeError:
                return False
        return NotImplemented

    def __ne__(self, other):
        r = self.__eq__(other)
        return r if r is NotImplemented else not r

    def __hash__(self):
        # equal to the NumPy dtype it compares equal to, so ``arr.dtype in {nl.float8_e5m2_x4: ...}``
        # finds the entry (NKI Library's MX goldens look their dtype up this way)
        return hash(self.dtype)

    @property
    def is_float(self):
        return self.kind == "float"

    @property
    def is_int(self):
        return self.kind in ("int", "uint", "bool")

    @property
    def is_x4(self):
        return self.kind == "x4"

    @property
    def is_fp8(self):
        return self.name.startswith("float8_") and self.kind == "float"


def _d(name, npd, kind, **kw):
    return NkiDtype(name, npd, kind, **kw)


bool_ = _d("bool_", np.uint8, "bool")
int8 = _d("int8", np.int8, "int")
int16 = _d("int16", np.int16, "int")
int32 = _d("int32", np.int32, "int")
int64 = _d("int64", np.int64, "int")
uint8 = _d("uint8", np.uint8, "uint")
uint16 = _d("uint16", np.uint16, "uint")
uint32 = _d("uint32", np.uint32, "uint")
float16 = _d("float16", np.float16, "float")
bfloat16 = _d("bfloat16", ml_dtypes.bfloat16, "float")
tfloat32 = _d("tfloat32", np.float32, "float")
float32 = _d("float32", np.float32, "float")
float8_e4m3 = _d("float8_e4m3", ml_dtypes.float8_e4m3, "float")
float8_e4m3fn = _d("float8_e4m3fn", ml_dtypes.float8_e4m3fn, "float")
float8_e5m2 = _d("float8_e5m2", ml_dtypes.float8_e5m2, "float")
float8_e8m0fnu = _d("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu, "float")
float8_e5m2_x4 = _d("float8_e5m2_x4", np.uint32, "x4", lanes=4, lane_np=ml_dtypes.float8_e5m2)
float8_e4m3fn_x4 = _d("float8_e4m3fn_x4", np.uint32, "x4", lanes=4, lane_np=ml_dtypes.float8_e4m3fn)
float4_e2m1fn_x4 = _d("float4_e2m1fn_x4", np.uint16, "x4", lanes=4, lane_np=ml_dtypes.float4_e2m1fn)

ALL = [
    bool_, int8, int16, int32, int64, uint8, uint16, uint32, float16, bfloat16, tfloat32, float32,
    float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu, float8_e5m2_x4, float8_e4m3fn_x4,
    float4_e2m1fn_x4,
]
_BY_NAME = {d.name: d for d in ALL}
# NumPy dtype -> NKI dtype, for kernel arguments that arrive as arrays. tfloat32 and the x4 types
# have no NumPy identity of their own (they map to float32 / uint containers).
_FROM_NP = {}
for _dt in ALL:
    if _dt.kind != "x4" and _dt is not tfloat32 and _dt is not bool_:
        _FROM_NP.setdefault(_dt.np, _dt)
_FROM_NP[np.dtype(np.bool_)] = bool_


def _x4_np(d):
    # the field is the float type of the container's width, so that NumPy's value cast of the
    # host array to that float (``np.asarray(out, dtype=np.float32)``, which NKI Library's harness
    # applies to every output) keeps the packed bits, as its MX goldens (``words.view(np.float32)``)
    # expect; ``.view(np.uint32)`` / ``.view(np.uint16)`` still give the words
    width = np.dtype(d.np).itemsize
    return np.dtype([(d.name, {4: np.float32, 2: np.float16}[width])],
                    metadata={"nki_dtype": d.name})


_NP_OF = {d.name: (_x4_np(d) if d.kind == "x4" else np.dtype(np.bool_) if d is bool_ else d.np)
          for d in ALL}

FP8_MAX = {"float8_e4m3": 240.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# Generation gates for dtypes (nki-spec §0.2 item 6, §9.1.1): gen4-only formats.
GEN4_ONLY = {"float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4", "float8_e8m0fnu"}


def by_name(name: str) -> NkiDtype:
    return _BY_NAME[name]


def from_numpy(npd) -> NkiDtype:
    """The NKI dtype of a NumPy/ml_dtypes array dtype (kernel arguments)."""
    if isinstance(npd, NkiDtype):
        return npd
    npd = np.dtype(npd)
    meta = npd.metadata
    if meta and meta.get("nki_dtype") in _BY_NAME:
        return _BY_NAME[meta["nki_dtype"]]
    named = _BY_NAME.get(npd.names[0]) if npd.names and len(npd.names) == 1 else None
    if named is not None and named.is_x4:     # an x4 host dtype whose metadata was dropped
        return named
    try:
        return _FROM_NP[npd]
    except KeyError:
        raise TypeError(f"arrays of dtype {npd} cannot be passed to an NKI kernel; supported: "
                        + ", ".join(sorted(str(k) for k in _FROM_NP))) from None


def as_nki_dtype(dtype, where: str) -> NkiDtype:
    """Accept only NKI dtype objects, as the real API does since 0.2 (nki-spec §5.1)."""
    if isinstance(dtype, NkiDtype):
        return dtype
    from . import versions
    if versions.status("NumPy or string dtypes inside kernels") != "removed":
        # NKI 0.3-0.6 (and NKI Library, written for 0.3) pass strings and NumPy dtypes
        try:
            d = _BY_NAME[dtype] if isinstance(dtype, str) else from_numpy(dtype)
        except (KeyError, TypeError):
            d = None
        if d is not None:
            versions.check("NumPy or string dtypes inside kernels", where, exc=TypeError)
            return d
    raise TypeError(f"{where}: dtype must be an NKI dtype object such as nl.bfloat16 or nl.float32; "
                    f"got {dtype!r} (NumPy dtypes and strings are not accepted inside kernels "
                    f"since NKI 0.7; the emulator follows NKI {versions.current()})")


def sentinel_fill(raw: np.ndarray, dtype: NkiDtype) -> None:
    """Fill fresh storage the way the official simulator does: NaN for floats, 4 for ints.

    x4 types are uint32/uint16 containers (nki-spec §0.2 item 7) and get the integer sentinel, 4 in
    each container word (a small finite value in lane 0, zeros in the others). The spec does not
    say what the simulator writes there; the integer rule is the documented one that fits a uint
    container, and it matches hardware, where garbage MX data is almost never a NaN code: NKI
    Library's MX kernels feed padded, never-written token columns through TensorE and discard
    them (moe_block / moe_tkg MX), which a NaN fill would turn into NaN outputs.
    """
    if dtype.kind == "x4":
        raw.view(dtype.np)[...] = 4
    elif dtype.kind == "float":
        raw.view(dtype.np)[...] = np.array(np.nan, dtype=np.float32).astype(dtype.np)
    else:
        raw.view(dtype.np)[...] = 4


def to_f32(values: np.ndarray) -> np.ndarray:
    """Read stored values as float32 (the engines' arithmetic type)."""
    if values.dtype == np.float32:
        return values
    return values.astype(np.float32)


def cast(values: np.ndarray, dtype: NkiDtype) -> np.ndarray:
    """Cast float32 (or integer) results to ``dtype`` with the hardware rules."""
    if dtype.kind == "x4":
        raise TypeError(f"no arithmetic cast into {dtype}")
    if dtype.kind == "float":
        if dtype is tfloat32:
            return round_tf32(np.asarray(values, dtype=np.float32))
        return np.asarray(values).astype(dtype.np)
    v = np.asarray(values)
    if v.dtype.kind in "iub":
        info = np.iinfo(dtype.np)
        return np.clip(v.astype(np.int64), info.min, info.max).astype(dtype.np)
    info = np.iinfo(dtype.np)
    v = np.rint(v.astype(np.float64))  # rint = round half to even
    v = np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)
    return np.clip(v, info.min, info.max).astype(dtype.np)


def round_tf32(x: np.ndarray) -> np.ndarray:
    """Round fp32 to 10 mantissa bits (tfloat32), nearest even, kept in an fp32 container."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    lsb = (b >> 13) & 1
    b = (b + 0xFFF + lsb) & 0xFFFFE000
    out = b.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, x).astype(np.float32)


def unpack_x4(words: np.ndarray, dtype: NkiDtype) -> np.ndarray:
    """Decode x4 containers to float32 values with a trailing axis of 4 (lane q = byte/nibble q)."""
    if dtype.lane_np.itemsize == 1 and dtype.np.itemsize == 4:  # fp8 x4 in uint32
        b = np.ascontiguousarray(words).view(np.uint8).reshape(words.shape + (4,))
        return b.view(dtype.lane_np).astype(np.float32)
    # fp4 x4 in uint16: nibble q = bits 4q..4q+3
    w = np.asarray(words).astype(np.uint16)
    nib = np.stack([(w >> (4 * q)) & 0xF for q in range(4)], axis=-1).astype(np.uint8)
    return nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def pack_x4(values: np.ndarray, dtype: NkiDtype) -> np.ndarray:
    """Inverse of :func:`unpack_x4`: float values with a trailing axis of 4 -> containers."""
    v = np.asarray(values, dtype=np.float32).astype(dtype.lane_np)
    if dtype.np.itemsize == 4:
        return np.ascontiguousarray(v).view(np.uint8).view(np.uint32).reshape(v.shape[:-1])
    nib = v.view(np.uint8).astype(np.uint16) & 0xF
    return sum(nib[..., q] << (4 * q) for q in range(4)).astype(np.uint16)
