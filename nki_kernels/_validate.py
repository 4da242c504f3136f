"""The input checks every op shares (host side, never used inside kernels).

Messages name the op, the argument, what it got and what is supported.
"""
from __future__ import annotations

import numpy as np


def is_torch(x) -> bool:
    """A torch tensor, recognised without importing torch."""
    return type(x).__module__.split(".")[0] == "torch"


def dtype_name(x) -> str:
    """The dtype name of a NumPy/ml_dtypes array or a torch tensor: 'bfloat16', 'float8_e4m3fn'..."""
    if is_torch(x):
        return str(x.dtype).replace("torch.", "")
    return np.dtype(x.dtype).name


def check_2d(op, name, a):
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"{op}: {name} must be a 2-D array; got shape {shape}")
    if min(shape) < 1:
        raise ValueError(f"{op}: {name} must have positive dimensions; got {list(shape)}")
    return int(shape[0]), int(shape[1])


def check_dtype(op, name, a, allowed):
    got = dtype_name(a)
    if got not in allowed:
        raise TypeError(f"{op}: {name}.dtype must be {' or '.join(allowed)}; got {got}")
    return got


def float_vector(op, name, v, n):
    """A float vector of length n as a contiguous fp32 NumPy array (it is small: H or N)."""
    if is_torch(v):
        v = v.detach().float().numpy()
    a = np.asarray(v)
    if a.shape != (n,):
        raise ValueError(f"{op}: {name} must be a vector of length {n}; got shape {list(a.shape)}")
    if a.dtype.kind not in "fV" and dtype_name(a) != "bfloat16":
        raise TypeError(f"{op}: {name} must be a float vector; got {a.dtype}")
    return np.ascontiguousarray(a.astype(np.float32))


# ------------------------------------------------------------------------ one rule for every op
GEN_NAMES = {2: "trn1", 3: "trn2", 4: "trn3"}
_GRAD_WARNED: set = set()


def check_target(op, supported=("trn2", "trn3")) -> int:
    """The NeuronCore generation the op runs on (3 = Trn2, 4 = Trn3), refused up front with one
    clear error when ``op`` does not support it (the emulator's target, or the device's).
    Raises ``BackendUnavailable`` first when the backend asked for cannot run here."""
    from .backend import nisa, require
    require()
    gen = int(nisa.get_nc_version())
    name = GEN_NAMES.get(gen, f"gen{gen}")
    if name not in supported:
        raise ValueError(f"{op}: target {name} is not supported; supported targets: "
                         f"{', '.join(supported)}")
    return gen


def check_lnc(op, lnc) -> int:
    """``lnc``: 1, or 2 (the two physical cores of a logical NeuronCore)."""
    if isinstance(lnc, bool) or lnc not in (1, 2):
        raise ValueError(f"{op}: lnc must be 1 or 2; got {lnc!r}")
    return int(lnc)


def check_eps(op, eps, name="eps") -> float:
    """A finite float > 0 (eps = 0 turns an all-zero row into inf / NaN); not a bool."""
    ok = isinstance(eps, (int, float, np.floating, np.integer)) and not isinstance(eps, bool)
    if not ok or not np.isfinite(eps) or not eps > 0:
        raise ValueError(f"{op}: {name} must be a finite float > 0; got {eps!r}")
    return float(eps)


def check_flag(op, name, value) -> bool:
    """A flag takes True or False only (a string such as "no" would read as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} must be True or False; got {value!r}")
    return bool(value)


def array_like(op, name, value, dtype=np.float32):
    """Any array-like (list, tuple, NumPy array, CPU torch tensor) as a NumPy array of ``dtype``;
    the error names what it got."""
    if is_torch(value):
        value = value.detach().float().cpu().numpy()
    try:
        a = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError):
        got = type(value).__name__ if not isinstance(value, str) else repr(value)
        raise TypeError(f"{op}: {name} must be an array-like of numbers (list, NumPy array, "
                        f"tensor); got {got}") from None
    return a


def check_no_grad(op, *arrays):
    """The ops are inference-only: a torch tensor that requires grad comes back detached. Warn
    once per op (a UserWarning), so a training loop learns it has no gradient here."""
    if op in _GRAD_WARNED:
        return
    if any(is_torch(a) and getattr(a, "requires_grad", False) for a in arrays):
        import warnings
        _GRAD_WARNED.add(op)
        warnings.warn(f"{op}: nki-kernels ops are inference-only: inputs that require grad are "
                      f"read detached and the result has no autograd history", UserWarning,
                      stacklevel=3)


# ---------------------------------------------------------------------- attention host inputs
def positive_number(op, name, x, allow_none=True):
    """A finite number > 0 (not a bool) as a float, or None when allowed."""
    if x is None and allow_none:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)) \
            or not np.isfinite(float(x)) or float(x) <= 0:
        raise ValueError(f"{op}: {name} must be a finite number > 0{' or None' if allow_none else ''};"
                         f" got {x!r}")
    return float(x)


def host_ints(op, name, x):
    """A host integer array (NumPy, list or CPU torch tensor); TypeError for any other dtype."""
    if is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{op}: {name} must be an integer array; got dtype {a.dtype}")
    return a


def kv_scales(op, name, s, h_kv):
    """An FP8 KV-cache scale (k_scale / v_scale): None, a positive scalar, or one positive value
    per KV head; float64 ``[H_kv]`` (or None)."""
    if s is None:
        return None
    if is_torch(s):
        s = s.detach().float().cpu().numpy()
    a = np.asarray(s, dtype=np.float64).reshape(-1)
    if a.size not in (1, h_kv):
        raise ValueError(f"{op}: {name} must be a scalar or have H_kv = {h_kv} values (per KV "
                         f"head); got {a.size} values")
    if not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{op}: {name} must be finite and > 0; got {a.tolist()}")
    return np.broadcast_to(a, (h_kv,)).astype(np.float64)


def check_window(op, window):
    """A left sliding window: None, or an int >= 1 (keys visible including the query's own)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                               or window < 1):
        raise ValueError(f"{op}: window must be None or an int >= 1 (keys visible including the "
                         f"query's own); got {window!r}")
    return None if window is None else int(window)


FP8_KV = {3: "float8_e4m3", 4: "float8_e4m3fn"}      # KV-cache FP8 type per generation


def attention_options(op, gen, q, k_cache, v_cache, n_q_heads, n_kv_heads, head_dim, scale,
                      softcap, sinks, k_scale, v_scale):
    """The options every attention op over a (paged) KV cache checks the same way: q bf16/fp16,
    caches both q's dtype or the target's FP8 (scales only then), scale / soft-cap > 0, sinks
    ``[H_q]``. Returns ``(q dtype name, cache dtype name, is_fp8, k_scale [H_kv] | None,
    v_scale [H_kv] | None, scale, softcap | None, sinks fp32 [H_q] | None)``."""
    qn = dtype_name(q)
    if qn not in ("bfloat16", "float16"):
        raise TypeError(f"{op}: q.dtype must be one of bfloat16, float16; got {qn}")
    kn, vn = dtype_name(k_cache), dtype_name(v_cache)
    fp8 = FP8_KV.get(gen, FP8_KV[4])
    if kn != vn or kn not in (qn, fp8):
        raise TypeError(f"{op}: k_cache and v_cache must both be {qn} (q's dtype) or {fp8} (FP8 on "
                        f"this target); got {kn} and {vn}")
    is_fp8 = kn == fp8
    if not is_fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError(f"{op}: k_scale / v_scale apply to FP8 caches only; the cache is {kn}")
    ks = kv_scales(op, "k_scale", k_scale, n_kv_heads)
    vs = kv_scales(op, "v_scale", v_scale, n_kv_heads)
    scale = (1.0 / float(np.sqrt(head_dim)) if scale is None
             else positive_number(op, "scale", scale, False))
    softcap = positive_number(op, "softcap", softcap)
    sk = None
    if sinks is not None:
        sk = np.ascontiguousarray(array_like(op, "sinks", sinks))
        if sk.shape != (n_q_heads,):
            raise ValueError(f"{op}: sinks must have shape (H_q,) = ({n_q_heads},); got "
                             f"{sk.shape}")
    return qn, kn, is_fp8, ks, vs, scale, softcap, sk


def check_block_table(op, block_table, lens, cache_shape, block_sizes, cache_name="k_cache",
                      rows="B"):
    """A vLLM block table ``[len(lens), max_blocks]`` for a paged cache of ``cache_shape``
    (``[num_blocks, block_size, ...]``): block size supported, enough blocks for every length,
    the entries in use inside ``[0, num_blocks)`` (entries past a length are never read and not
    checked), offsets below 2^31. Returns ``(table as int32, block_size)``."""
    n0, bs = int(cache_shape[0]), int(cache_shape[1])
    if bs not in block_sizes:
        raise ValueError(f"{op}: block_size ({cache_name}.shape[1]) must be one of "
                         f"{', '.join(map(str, block_sizes))}; got {bs}")
    bt = host_ints(op, "block_table", block_table)
    n = len(lens)
    if bt.ndim != 2 or bt.shape[0] != n:
        raise ValueError(f"{op}: block_table must be [{rows}={n}, max_blocks]; got shape "
                         f"{list(bt.shape)}")
    cap = bt.shape[1] * bs
    top = max((int(x) for x in lens), default=0)
    if top > cap:
        raise ValueError(f"{op}: seq_lens up to {top} exceed the block table's capacity "
                         f"{bt.shape[1]} blocks x {bs} = {cap} tokens (block_table is "
                         f"[{n}, {bt.shape[1]}])")
    for r, L in enumerate(lens):
        used = bt[r, :-(-int(L) // bs)]
        if used.size and (used.min() < 0 or used.max() >= n0):
            raise ValueError(f"{op}: block_table[{r}] has entries out of range [0, {n0}) "
                             f"(num_blocks); got {used.tolist()}"[:300])
    elems = int(np.prod([int(x) for x in cache_shape]))
    if elems >= 2 ** 31:
        raise ValueError(f"{op}: the paged cache has {elems} elements; the page offsets support "
                         f"< 2^31")
    return np.ascontiguousarray(bt.astype(np.int32)), bs


def check_decode_lens(op, seq_lens, B, s_q):
    """Decode lengths: one host int per sequence, 0 (an empty slot) or >= s_q (they count the new
    tokens, already in the cache)."""
    sl = host_ints(op, "seq_lens", seq_lens).reshape(-1)
    if sl.shape != (B,):
        raise ValueError(f"{op}: seq_lens must have one length per sequence (B = {B}); got shape "
                         f"{list(np.asarray(seq_lens).shape)}")
    if np.any(sl < 0) or any(0 < L < s_q for L in sl.tolist()):
        raise ValueError(f"{op}: seq_lens must be 0 (an empty slot) or >= s_q = {s_q} (they count "
                         f"the new tokens, already in the cache); got {sl.tolist()}"[:300])
    return sl


def token_scales(op, name, s, lead, dims, lens, block_table=None, block_size=None):
    """Per-token KV-cache scales (one per cache slot): an fp32 array shaped like the cache's
    leading dims ``lead`` (named ``dims``, e.g. "[num_blocks, block_size]"). The slots the op
    reads (the first ``L`` tokens of each sequence, through ``block_table`` when paged) must be
    finite and > 0; the others are never read and not checked. A contiguous fp32 NumPy array."""
    if not hasattr(s, "dtype"):
        raise TypeError(f"{op}: {name} (per-token scales) must be a float32 array {dims}; got "
                        f"{type(s).__name__}")
    shape = getattr(s, "shape", None)
    if shape is None or tuple(int(x) for x in shape) != tuple(int(x) for x in lead):
        raise ValueError(f"{op}: {name} (per-token scales) must be {dims} = "
                         f"{[int(x) for x in lead]} like the cache's leading dims; got shape "
                         f"{None if shape is None else [int(x) for x in shape]}")
    got = dtype_name(s)
    if got != "float32":
        raise TypeError(f"{op}: {name} (per-token scales) dtype must be float32; got {got}")
    a = s.detach().cpu().numpy() if is_torch(s) else np.asarray(s)
    a = np.ascontiguousarray(a, dtype=np.float32)
    for b, L in enumerate(int(x) for x in lens):
        if L == 0:
            continue
        if block_table is None:
            v = a[b, :L]
        else:
            pages = np.asarray(block_table)[b, :-(-L // block_size)]
            v = a[pages].reshape(-1)[:L]
        bad = np.flatnonzero(~np.isfinite(v) | (v <= 0))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"{op}: {name} must be finite and > 0 for every token read; "
                             f"sequence {b} token {j} has {float(v[j])!r}")
    return a
