"""Our kernels beside AWS NKI Library's, one command: ``nki-kernels bench --vs-nkilib PATH``.

For each bench case of a paired op (``bench/defs/<op>.py``, the tier's model shapes from
``reference/shapes.py``) and each LNC both kernels support, this runs our op and NKI Library's
kernel for the same problem on the same inputs, checks BOTH outputs with the bench's own check
(``case.check``: the NumPy reference of ``reference/<op>.py`` and the accuracy rule of the
definition), and reports both times, both % of roof (same FLOPs, bytes and roof: the case's)
and the ratio theirs / ours (> 1: ours is faster).

Times are **modeled** (``cost.estimate``: the emulator runs the kernel, the cost model turns its
instruction trace into a time; the same call for both kernels), or device time with
``--measured`` on a trn instance (``bench/device.py``; that path is written but has never run).
NKI Library's kernels are written for NKI 0.3: they run under ``versions.nki_version("0.3")``,
ours under the default, with the module aliases and stand-ins of
``nki_kernels.emulator.pytest_plugin.install_standins`` (harness plumbing, no kernel code).

A side that has no equivalent configuration, refuses the shape, fails to import (NKI Library's
own bugs at its public head: docs/conformance.md) or fails the output check posts no time and
says why; the ratio is only given when both sides posted a time.

PATH is a checkout of github.com/aws-neuron/nki-library (kernels under
``PATH/src/nkilib_src/nkilib/``), or the folder of an installed ``nkilib`` package (holding
``core/``; written for a trn instance, never run here). Nothing of PATH is copied or edited.

Pairs (ours -> NKI Library; adapters and what is not equivalent: docs/bench.md, "Our kernels
beside NKI Library's"):

* ``rmsnorm_quant`` -> ``core/rmsnorm`` ``rmsnorm_quant_kernel`` (ROW FP8), LNC 1 and 2;
* ``swiglu_mlp`` -> ``core/mlp`` ``mlp`` (``mlp_tkg`` / ``mlp_cte`` by their dispatcher; FP8 at
  CTE: ``rmsnorm_quant_kernel`` feeding ``mlp``'s ROW mode), LNC 1;
* ``qkv_proj`` -> ``core/qkv`` ``qkv`` (``qkv_cte`` with fused RoPE; at decode also ``qkv_tkg``
  with RoPE on the host, not timed), LNC 1;
* ``flash_attention`` -> ``core/attention`` ``attention_cte``, LNC 1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nki_kernels.bench import harness

NKILIB_URL = "github.com/aws-neuron/nki-library"
NKILIB_VERSION = "0.3"          # the NKI version NKI Library's public head is written for
CHECKOUT_SUB = Path("src") / "nkilib_src" / "nkilib"


class NoEquivalent(Exception):
    """NKI Library (or ours) has no configuration for this problem: the side posts no time."""


class OtherRegime(NoEquivalent):
    """This variant of NKI Library's serves another regime (e.g. qkv_tkg at prefill T): the row
    is left out when the pair has another variant for the problem."""


class Unavailable(Exception):
    """NKI Library's kernel cannot be imported from PATH (its own bug, or a missing file)."""


# ------------------------------------------------------------------------------- NKI Library


@dataclasses.dataclass(frozen=True)
class NkiLib:
    """Where NKI Library's kernels are: ``sys_path`` to add, ``prefix`` of the package name."""
    path: Path
    kind: str            # "checkout" | "installed"
    sys_path: Path
    prefix: str          # "nkilib_src.nkilib" (checkout) | "nkilib" (installed package)
    commit: str = "unknown"

    def file(self, module: str) -> Path:
        base = self.sys_path / Path(*self.prefix.split("."))
        return base / (module.replace(".", "/") + ".py")


def find_nkilib(path) -> NkiLib:
    """The NKI Library at ``path`` (``--vs-nkilib PATH``), or a BenchError saying what it got and
    what is expected."""
    p = Path(path).expanduser()
    expected = (f"expected a checkout of {NKILIB_URL} (a folder holding {CHECKOUT_SUB}/core/) or "
                f"the folder of an installed nkilib package (holding core/ and __init__.py)")
    if not p.exists():
        raise harness.BenchError(f"--vs-nkilib PATH: got {str(path)!r}, which does not exist; "
                                 f"{expected}")
    if not p.is_dir():
        raise harness.BenchError(f"--vs-nkilib PATH: got {str(path)!r}, which is a file, not a "
                                 f"folder; {expected}")
    p = p.resolve()
    if (p / CHECKOUT_SUB / "core").is_dir():
        return NkiLib(p, "checkout", p / "src", "nkilib_src.nkilib", _commit(p))
    if (p / "core").is_dir() and (p / "__init__.py").is_file() and p.name == "nkilib":
        # an installed package (pip's nki-library on a trn instance): written, never run here
        return NkiLib(p, "installed", p.parent, "nkilib", "installed")
    raise harness.BenchError(f"--vs-nkilib PATH: got {str(path)!r}, which has no "
                             f"{CHECKOUT_SUB}/core/ folder; {expected}")


def _commit(p: Path) -> str:
    try:
        r = subprocess.run(["git", "-C", str(p), "rev-parse", "--short=12", "HEAD"],
                           capture_output=True, text=True, timeout=10,
                           env={"GIT_OPTIONAL_LOCKS": "0", "PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip() if r.returncode == 0 else "unknown"


_standins = [False]
_emulated = [True]       # False under --measured: the real nki imports NKI Library's kernels


def load(lib: NkiLib, module: str):
    """Import NKI Library's ``module`` (``core.rmsnorm.rmsnorm_quant``) from ``lib``, under NKI 0.3
    on the emulator; Unavailable (with the reason, for the row) when it does not import."""
    emulated = _emulated[0]
    if emulated and not _standins[0]:
        from nki_kernels.emulator.pytest_plugin import install_standins
        install_standins()
        _standins[0] = True
    entry = str(lib.sys_path)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    name = f"{lib.prefix}.{module}"
    rel = lib.file(module).relative_to(lib.path) if lib.kind == "checkout" else module
    try:
        with _nki03(emulated):
            return __import__(name, fromlist=["_"])
    except SyntaxError as e:
        raise Unavailable(f"NKI Library's {rel} does not parse ({type(e).__name__} at "
                          f"{Path(e.filename or '?').name}:{e.lineno}): NKI Library's own bug at "
                          f"its public head (docs/conformance.md)") from None
    except Exception as e:  # noqa: BLE001 - any import failure is a reason for the row
        raise Unavailable(f"NKI Library's {rel} failed to import: {type(e).__name__}: "
                          f"{_first_line(e)}") from None


def _nki03(emulated: bool | None = None):
    if not (_emulated[0] if emulated is None else emulated):
        return contextlib.nullcontext()
    from nki_kernels.emulator.versions import nki_version
    return nki_version(NKILIB_VERSION)


def _nl():
    """``nki.language`` as NKI Library sees it (the emulator once the stand-ins are installed)."""
    import importlib
    return importlib.import_module("nki.language")


def _first_line(e) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:240]


# ------------------------------------------------------------------------------------ pairs


@dataclasses.dataclass
class Stage:
    """One NKI Library kernel call ``kernel[lnc](*args, **kwargs)``; ``make(prev)`` -> (args,
    kwargs), ``prev`` the previous stage's output (None for the first)."""
    kernel: Callable
    make: Callable


@dataclasses.dataclass
class Launch:
    """NKI Library's kernel(s) for one problem: its stages run in order (a chained pair, e.g.
    rmsnorm_quant feeding mlp, is charged one launch overhead: as if in one graph); ``to_ours``
    turns the last stage's output into what our op returns, for the bench's check."""
    name: str
    stages: list
    to_ours: Callable

    @classmethod
    def one(cls, name, kernel, args, kwargs, to_ours):
        return cls(name, [Stage(kernel, lambda _prev: (tuple(args), dict(kwargs)))], to_ours)


@dataclasses.dataclass(frozen=True)
class Pair:
    """``op`` (ours) beside NKI Library's ``family``: ``ours(case, lnc)`` -> the callable the bench
    runs at that LNC (or NoEquivalent), ``theirs(lib, case, inputs, lnc, variant)`` -> a Launch
    (or NoEquivalent / Unavailable); one row per variant of ``variants`` (NKI Library's ways of
    doing the problem), ours run once for them all."""
    op: str
    family: str
    lncs: tuple
    ours: Callable
    theirs: Callable
    variants: tuple = ("",)
    own_lnc: bool = False      # the bench case names its LNC (decode rows): only that one runs
    check: Callable | None = None   # (case) -> a check for both sides where the bench has none

    def case_lncs(self, case) -> tuple:
        return tuple(n for n in self.lncs if not self.own_lnc or n == case.lnc)


# --- rmsnorm_quant


def _rms_quant(case) -> tuple[str, bool]:
    return ("mx" if "mxfp8" in case.dtype else "fp8"), "+res" in case.dtype


def _ours_rmsnorm_quant(case, lnc):
    if lnc == 1:
        return case.run
    from nki_kernels.quant.rmsnorm_quant import rmsnorm_quant
    quant, _ = _rms_quant(case)

    def run(x, g, res=None):          # the bench definition's call, at LNC 2
        return rmsnorm_quant(x, g, quant=quant, residual=res, lnc=lnc)
    return run


def rmsnorm_to_theirs(x, g, lnc):
    """Our (x [T, H], gamma [H]) as NKI Library's (hidden [1, T, H], ln_w [H] or, LNC > 1, [1, H])."""
    T, H = x.shape
    return np.asarray(x).reshape(1, T, H), (np.asarray(g) if lnc == 1 else
                                            np.asarray(g).reshape(1, H))


def rmsnorm_from_theirs(out, T, H):
    """NKI Library's ROW output [.., T, H + 4] (fp8 bytes; a row's last 4 bytes are its fp32
    dequantization scale) as ours: (q [T, H] fp8, scale [T, 1] float32)."""
    a = np.asarray(out).reshape(T, H + 4)
    if a.dtype.itemsize != 1:
        raise ValueError(f"NKI Library rmsnorm_quant output: expected 1-byte FP8 data, got "
                         f"{a.dtype}")
    scale = np.ascontiguousarray(a[:, H:]).view(np.uint8).view(np.float32).reshape(T, 1)
    return np.ascontiguousarray(a[:, :H]), scale


def rmsnorm_to_ours_layout(q, scale):
    """Inverse of rmsnorm_from_theirs (tests: the round trip): [1, T, H + 4] 1-byte rows."""
    T, H = q.shape
    sc = np.ascontiguousarray(np.asarray(scale, dtype=np.float32).reshape(T, 1)).view(np.uint8)
    rows = np.concatenate([np.ascontiguousarray(q).view(np.uint8), sc], axis=1)
    return rows.view(q.dtype).reshape(1, T, H + 4)


def _theirs_rmsnorm_quant(lib, case, inputs, lnc, variant=""):
    quant, residual = _rms_quant(case)
    if quant == "mx":
        raise NoEquivalent("NKI Library's rmsnorm_quant quantizes to FP8 per row (ROW) or with a "
                           "static scale; it has no MXFP8 output")
    if residual:
        raise NoEquivalent("NKI Library's rmsnorm_quant has no fused residual add")
    m = load(lib, "core.rmsnorm.rmsnorm_quant")
    types = load(lib, "core.utils.common_types")
    x, g = inputs[:2]
    T, H = x.shape
    hidden, ln_w = rmsnorm_to_theirs(x, g, lnc)
    with _nki03():
        kargs = m.RmsNormQuantKernelArgs(quantization_type=types.QuantizationType.ROW,
                                         norm_type=types.NormType.RMS_NORM, eps=1e-6)
    return Launch.one("rmsnorm_quant_kernel (ROW fp8_e4m3)", m.rmsnorm_quant_kernel,
                      (hidden, ln_w, kargs), {}, lambda out: rmsnorm_from_theirs(out, T, H))


# --- swiglu_mlp


def _ours_swiglu_mlp(case, lnc):
    if lnc != 1:
        raise NoEquivalent("our swiglu_mlp runs on one NeuronCore (no LNC 2)")
    return case.run


def mlp_weights_to_theirs(inputs, I):
    """Our swiglu_mlp inputs as NKI Library's mlp weights: row-major [H, I], [H, I], [I, H]
    (tile-major weights untiled on the host) and, for FP8, the per-column scales [N] as the
    [128, N] rows their ROW mode reads (the same row on every partition)."""
    from nki_kernels.bench.defs.swiglu_mlp import _untile
    x, _g, wg, wu, wd, *scales = inputs
    H = x.shape[1]
    ws = [np.ascontiguousarray(_untile(w, sh)) for w, sh in
          zip((wg, wu, wd), ((H, I), (H, I), (I, H)))]
    sc = [np.ascontiguousarray(np.broadcast_to(np.asarray(s, np.float32).reshape(1, -1),
                                               (128, np.size(s)))) for s in scales]
    return ws, sc


def mlp_from_theirs(out, x):
    """NKI Library's mlp output ([1, T, H] bf16, or a list whose first item it is) plus the
    residual x, added on the host (their mlp has no add after the down projection; ours does
    it in the kernel, and its time is not charged to theirs)."""
    import ml_dtypes
    o = out[0] if isinstance(out, (list, tuple)) else out
    T, H = x.shape
    y = np.asarray(o).reshape(T, H).astype(np.float32) + np.asarray(x).astype(np.float32)
    return y.astype(ml_dtypes.bfloat16)


def _theirs_swiglu_mlp(lib, case, inputs, lnc, variant=""):
    T, H, I = case.dims["T"], case.dims["H"], case.dims["I"]
    m = load(lib, "core.mlp.mlp")
    types = load(lib, "core.utils.common_types")
    params = load(lib, "core.mlp.mlp_parameters")
    mode = "mlp_tkg" if T <= getattr(params, "TKG_BS_SEQLEN_THRESHOLD", 96) else "mlp_cte"
    x, g = inputs[:2]
    ws, sc = mlp_weights_to_theirs(inputs, I)
    hidden = np.asarray(x).reshape(1, T, H)
    gamma = np.asarray(g, np.float32)
    to_ours = lambda out: mlp_from_theirs(out, x)        # noqa: E731
    if not sc:                                           # bf16 weights: one kernel, norm inside
        kw = dict(normalization_weights_tensor=gamma.reshape(1, H),
                  normalization_type=types.NormType.RMS_NORM, eps=1e-6)
        return Launch.one(f"mlp ({mode}, RMS norm, bf16)", m.mlp, (hidden, *ws), kw, to_ours)
    fp8 = dict(quantization_type=types.QuantizationType.ROW, gate_w_scale=sc[0],
               up_w_scale=sc[1], down_w_scale=sc[2])
    if mode == "mlp_tkg":         # their TKG ROW mode takes bf16 tokens, RMS norm inside (as ours)
        kw = dict(normalization_weights_tensor=gamma.reshape(1, H),
                  normalization_type=types.NormType.RMS_NORM, eps=1e-6, **fp8)
        return Launch.one(f"mlp ({mode}, RMS norm, ROW fp8)", m.mlp, (hidden, *ws), kw, to_ours)
    # CTE: NKI Library's ROW mode takes the activations quantized per row with the scale in the
    # row's last 4 bytes, as its rmsnorm_quant writes them (bf16 tokens with RMS norm + ROW fail
    # in their CTE transpose): the two kernels chained
    rq = load(lib, "core.rmsnorm.rmsnorm_quant")
    with _nki03():
        kargs = rq.RmsNormQuantKernelArgs(quantization_type=types.QuantizationType.ROW,
                                          norm_type=types.NormType.RMS_NORM, eps=1e-6)
    import ml_dtypes
    ln_w = gamma.astype(ml_dtypes.bfloat16)
    ln_w = ln_w if lnc == 1 else ln_w.reshape(1, H)
    kw = dict(normalization_type=types.NormType.NO_NORM, output_dtype=_nl().bfloat16, **fp8)
    return Launch(f"rmsnorm_quant_kernel -> mlp ({mode}, ROW fp8)", [
        Stage(rq.rmsnorm_quant_kernel, lambda _prev: ((hidden, ln_w, kargs), {})),
        Stage(m.mlp, lambda prev: ((np.asarray(prev), *ws), kw)),
    ], to_ours)


# --- qkv_proj


def _ours_qkv_proj(case, lnc):
    if lnc != 1:
        raise NoEquivalent("our qkv_proj runs on one NeuronCore (no LNC 2)")
    return case.run


def rope_caches_to_theirs(positions, d, theta):
    """Our RoPE angles (``reference.qkv_proj.rope_tables``: cos, sin [T, d/2], half-split layout)
    as NKI Library's cos_cache / sin_cache [1, T, d] (the half repeated: their RoPE reads the
    first d/2 columns, [X1, X2] * cos + [-X2, X1] * sin)."""
    from nki_kernels.reference.qkv_proj import rope_tables
    cos, sin = rope_tables(positions, d, theta)
    T = cos.shape[0]
    return (np.concatenate([cos, cos], axis=1).reshape(1, T, d),
            np.concatenate([sin, sin], axis=1).reshape(1, T, d))


def qkv_from_theirs(out, T, nq, nkv, d):
    """NKI Library's BSD output [1, T, (nq + 2 nkv) d] as our QKVOutput (q [nq, T, d],
    k [nkv, T, d], v [nkv, T, d])."""
    from nki_kernels.dense.qkv_proj import QKVOutput
    y = np.asarray(out[0] if isinstance(out, (list, tuple)) else out).reshape(T, -1)
    q = y[:, :nq * d].reshape(T, nq, d).transpose(1, 0, 2)
    k = y[:, nq * d:(nq + nkv) * d].reshape(T, nkv, d).transpose(1, 0, 2)
    v = y[:, (nq + nkv) * d:].reshape(T, nkv, d).transpose(1, 0, 2)
    return QKVOutput(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                     None)


def qkv_to_theirs_output(q, k, v):
    """Inverse of qkv_from_theirs (tests: the round trip)."""
    T = q.shape[1]
    return np.concatenate([a.transpose(1, 0, 2).reshape(T, -1) for a in (q, k, v)],
                          axis=1)[None]


QKV_ROPE_THETA = 500000.0       # bench/defs/qkv_proj.py: Llama 3's theta


def _theirs_qkv_proj(lib, case, inputs, lnc, variant="cte"):
    """``cte``: their ``qkv`` with fused RMS norm and RoPE (fused RoPE exists in qkv_cte only, so
    their dispatcher runs qkv_cte at every T). ``tkg``: decode (T <= 96) through qkv_tkg without
    RoPE; RoPE is then applied to their q and k on the host (``reference.qkv_proj.apply_rope``)
    and not charged to them."""
    T, H, nq, nkv, d = (case.dims[k] for k in ("T", "H", "Hq", "Hkv", "d"))
    if variant == "tkg" and T > 96:
        raise OtherRegime(f"qkv_tkg serves T <= 96 (their dispatcher's threshold); T = {T}")
    m = load(lib, "core.qkv.qkv")
    types = load(lib, "core.utils.common_types")
    x, w, g, pos = inputs
    kw = dict(output_layout=types.QKVOutputLayout.BSD, fused_norm_type=types.NormType.RMS_NORM,
              gamma_norm_weights=np.asarray(g, np.float32).reshape(1, H), norm_eps=1e-6,
              d_head=d, num_q_heads=nq, num_kv_heads=nkv)
    args = (np.asarray(x).reshape(1, T, H), np.asarray(w))
    if variant == "tkg":
        from nki_kernels.reference.qkv_proj import apply_rope, rope_tables
        cos, sin = rope_tables(pos, d, QKV_ROPE_THETA)

        def to_ours(out):
            r = qkv_from_theirs(out, T, nq, nkv, d)
            q, k = (apply_rope(a.astype(np.float32), cos, sin, d).astype(r.v.dtype)
                    for a in (r.q, r.k))
            return r._replace(q=q, k=k)
        return Launch.one("qkv (qkv_tkg: fused RMS norm; RoPE on the host, not timed)", m.qkv,
                          args, kw, to_ours)
    cos, sin = rope_caches_to_theirs(pos, d, QKV_ROPE_THETA)
    kw.update(fused_rope=True, cos_cache=cos, sin_cache=sin)
    return Launch.one("qkv (qkv_cte: fused RMS norm + RoPE)", m.qkv, args, kw,
                      lambda out: qkv_from_theirs(out, T, nq, nkv, d))


# --- flash_attention


def _ours_flash_attention(case, lnc):
    if lnc != 1:
        raise NoEquivalent("our flash_attention runs on one NeuronCore (no LNC 2)")
    return case.run


def attention_to_theirs(q, k, v, scale):
    """Our q [B, Hq, Sq, d], k / v [B, Hkv, Skv, d] as NKI Library's attention_cte operands (tp_q
    True, tp_k False): q [B Hq, Sq, d] (times ``scale`` on the host when ``scale`` is not None;
    their kernel takes scale = 1 with a sliding window), k [B Hkv, d, Skv], v [B Hkv, Skv, d].
    Their GQA maps q batch b to kv batch b // (Hq / Hkv), which is our head grouping once B and
    the heads are flattened."""
    import ml_dtypes
    B, Hq, Sq, d = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    qf = np.asarray(q).reshape(B * Hq, Sq, d)
    if scale is not None:
        qf = (qf.astype(np.float32) * np.float32(scale)).astype(ml_dtypes.bfloat16)
    kf = np.ascontiguousarray(np.asarray(k).reshape(B * Hkv, Skv, d).transpose(0, 2, 1))
    return qf, kf, np.asarray(v).reshape(B * Hkv, Skv, d)


def attention_from_theirs(out, B, Hq):
    """NKI Library's attention_cte output [B Hq, Sq, d] (tp_out False) as ours [B, Hq, Sq, d]."""
    o = np.asarray(out[0] if isinstance(out, (list, tuple)) else out)
    return o.reshape(B, Hq, o.shape[-2], o.shape[-1])


def _theirs_flash_attention(lib, case, inputs, lnc, variant=""):
    import math
    m = load(lib, "core.attention.attention_cte")
    q, k, v = inputs
    B, Hq, _, d = q.shape
    window = case.dims.get("window")
    scale = 1.0 / math.sqrt(d)
    # a sliding window needs scale = 1 (their docstring): q is scaled on the host instead (exact
    # for d = 64 and 256, a power of two; one bf16 rounding of q otherwise)
    qf, kf, vf = attention_to_theirs(q, k, v, scale if window else None)
    kw = dict(scale=1.0 if window else scale, causal_mask=True, tp_q=True, tp_k=False,
              tp_out=False)
    if window:
        kw["sliding_window"] = int(window)
    return Launch.one("attention_cte" + (f" (sliding window {window})" if window else ""),
                      m.attention_cte, (qf, kf, vf), kw,
                      lambda out: attention_from_theirs(out, B, Hq))


# --- decode_attention


def _ours_own_lnc(case, lnc):
    """Our op at the LNC its bench case names (decode_attention's rows carry their own LNC)."""
    if lnc != case.lnc:
        raise NoEquivalent(f"this bench row runs ours at LNC {case.lnc}")
    return case.run


def decode_to_theirs(q, k, v, seq_lens, table=None, *, scale, k_scale=None, kv_dtype=None,
                     k_transposed=False):
    """Our decode problem (``reference.decode_attention``: q [B, s_q, Hq, d]; cache [B, S, Hkv, d]
    or paged [blocks, block, Hkv, d] + table [B, n]; seq_lens counting the s_q new tokens, already
    in the cache) as NKI Library's ``attention_tkg`` operands (qk_in_sb, tp_k_prior, use_pos_id).

    Their kernel serves one KV head: the KV heads are folded into the batch, B' = B Hkv (row
    b Hkv + h is our sequence b, KV head h, with its G = Hq / Hkv query heads). Their s_prior holds
    the prior tokens and, in its last s_q slots, the active ones (k_active / v_active: our cache's
    last s_q tokens of each sequence); their in-kernel mask (use_pos_id) shows prior positions
    < rope_pos_ids = L - s_q, and the active block causally. Without fused RoPE they do not scale
    q: q is multiplied by ``scale`` (and an FP8 cache's ``k_scale``) on the host, one bf16
    rounding. ``kv_dtype``: the FP8 dtype their kernel takes (e4m3), converted to on the host.
    ``k_transposed`` (flat caches): K stored [B', 1, d, S] (their tp_k_prior False), transposed on
    the host.

    Returns a dict: q [d, B' G s_q], k_active [d, B' s_q], v_active [B', 1, s_q, d], k_prior /
    v_prior ([B', 1, S, d], or paged [blocks Hkv, block, d]), table [B', n] uint32 or None,
    mask [s_q, B', G, s_q] uint8, pos [B', s_q] float32, and the dims (bs, q_head, s_active,
    s_prior, block_len, d)."""
    import ml_dtypes

    from nki_kernels.reference.decode_attention import gather_kv
    q = np.asarray(q)
    B, s_q, Hq, d = q.shape
    k, v = np.asarray(k), np.asarray(v)
    Hkv = k.shape[2]
    G = Hq // Hkv
    B2 = B * Hkv
    lens = [int(x) for x in np.asarray(seq_lens).reshape(-1)]
    if min(lens) < s_q:
        raise NoEquivalent(f"a sequence shorter than s_q = {s_q}: their active tokens always sit "
                           f"at the end of s_prior")
    f = np.float32(scale) * np.float32(1.0 if k_scale is None else k_scale)
    qs = (q.astype(np.float32) * f).astype(ml_dtypes.bfloat16)
    qs = qs.reshape(B, s_q, Hkv, G, d).transpose(4, 0, 2, 3, 1).reshape(d, B2 * G * s_q)
    act_k = np.stack([gather_kv(k, b, L, table)[L - s_q:] for b, L in enumerate(lens)])
    act_v = np.stack([gather_kv(v, b, L, table)[L - s_q:] for b, L in enumerate(lens)])

    def cast(a):
        if kv_dtype is None or a.dtype == np.dtype(kv_dtype):
            return np.ascontiguousarray(a)
        lim = float(ml_dtypes.finfo(kv_dtype).max)
        af = a.astype(np.float32)
        if not np.all(np.abs(af) <= lim):
            raise NoEquivalent(f"cache values beyond their FP8 {np.dtype(kv_dtype).name} range "
                               f"(max {lim})")
        return af.astype(kv_dtype)
    k_active = cast(act_k.transpose(3, 0, 2, 1).reshape(d, B2 * s_q))     # [s_q, Hkv, d] per b
    v_active = cast(act_v.transpose(0, 2, 1, 3).reshape(B2, 1, s_q, d))
    if table is None:
        S = -(-max(lens) // 128) * 128
        if S > k.shape[1]:
            raise NoEquivalent(f"their s_prior must be a multiple of 128; the cache holds "
                               f"{k.shape[1]} tokens")
        k_prior, v_prior = (cast(a[:, :S].transpose(0, 2, 1, 3).reshape(B2, 1, S, d))
                            for a in (k, v))
        if k_transposed:
            k_prior = np.ascontiguousarray(k_prior.transpose(0, 1, 3, 2))
        table2, block = None, 0
    else:
        nb, block = k.shape[:2]
        t = np.asarray(table, dtype=np.int64)
        S = t.shape[1] * block
        k_prior, v_prior = (cast(a.transpose(0, 2, 1, 3).reshape(nb * Hkv, block, d))
                            for a in (k, v))
        table2 = (t[:, None, :] * Hkv + np.arange(Hkv)[None, :, None]).reshape(B2, -1)
        table2 = np.ascontiguousarray(table2.astype(np.uint32))
    j, i = np.meshgrid(np.arange(s_q), np.arange(s_q), indexing="ij")
    mask = np.ascontiguousarray(np.broadcast_to((j <= i).astype(np.uint8)[:, None, None, :],
                                                (s_q, B2, G, s_q)))
    pos = np.repeat(np.asarray(lens, np.float32) - s_q, Hkv)[:, None] * np.ones((1, s_q),
                                                                              np.float32)
    return dict(q=np.ascontiguousarray(qs), k_active=k_active, v_active=v_active,
                k_prior=k_prior, v_prior=v_prior, table=table2, mask=mask,
                pos=np.ascontiguousarray(pos), bs=B2, q_head=G, s_active=s_q, s_prior=S,
                block_len=block, d=d)


def decode_from_theirs(out, B, Hkv, v_scale=None):
    """NKI Library's attention_tkg output [B Hkv, G, d, s_q] (out_in_sb False) as ours
    [B, s_q, Hq, d] (query head h = kv head * G + g); an FP8 cache's ``v_scale`` is applied here,
    on the host (their kernel takes no dequantization scale), not charged to them."""
    import ml_dtypes
    o = np.asarray(out[0] if isinstance(out, (list, tuple)) else out)
    _, G, d, s_q = o.shape
    o = o.reshape(B, Hkv, G, d, s_q).transpose(0, 4, 1, 2, 3).reshape(B, s_q, Hkv * G, d)
    if v_scale is not None:
        o = (o.astype(np.float32) * np.float32(v_scale)).astype(ml_dtypes.bfloat16)
    return np.ascontiguousarray(o)


_TKG_CALL = {}


def _attention_tkg_call(m, alloc, logging):
    """A jit kernel around NKI Library's ``attention_tkg`` (a subroutine taking an SBUF manager
    and its output): builds the manager over the SBUF less 16 KiB, loads q and k_active into
    SBUF (qk_in_sb, which their block-KV and FP8 paths require; charged to them) and returns
    ``out`` [B, q_head, d, s_active] in HBM."""
    key = id(m)
    if key in _TKG_CALL:
        return _TKG_CALL[key]
    import importlib
    nki = importlib.import_module("nki")
    nl, nisa = _nl(), importlib.import_module("nki.isa")

    def attention_tkg_call(q, k_active, v_active, k_prior, v_prior, mask, pos, table, cfg):
        sbm = alloc.SbufManager(0, nl.tile_size.total_available_sbuf_size - 16 * 1024,
                                logging.Logger("vs_nkilib"))
        sbm.open_scope()
        out = nl.ndarray((cfg.bs, cfg.q_head, cfg.d_head, cfg.s_active), dtype=q.dtype,
                         buffer=nl.shared_hbm)
        q_sb = sbm.alloc_stack(q.shape, dtype=q.dtype, buffer=nl.sbuf)
        k_sb = sbm.alloc_stack(k_active.shape, dtype=k_active.dtype, buffer=nl.sbuf)
        nisa.dma_copy(q_sb, q)
        nisa.dma_copy(k_sb, k_active)
        out, _ = m.attention_tkg(q_sb, k_sb, v_active, k_prior, v_prior, mask, out, cfg, sbm,
                                 None, pos, None, None, table, None)
        sbm.close_scope()
        return out
    _TKG_CALL[key] = nki.jit(attention_tkg_call)
    return _TKG_CALL[key]


DECODE_FP8_SCALE = 0.05         # bench/defs/decode_attention.py: k_scale = v_scale of FP8 rows


def _theirs_decode_attention(lib, case, inputs, lnc, variant=""):
    import math
    q, k, v, seq_lens, table = inputs
    lens = [int(x) for x in np.asarray(seq_lens)]
    if len(set(lens)) > 1:
        raise NoEquivalent(f"attention_tkg takes one s_prior for the whole batch (a shorter "
                           f"sequence is only masked): this batch ({max(lens)} and {min(lens)} "
                           f"tokens) would read every sequence at {max(lens)} tokens, "
                           f"{len(lens) * max(lens) / sum(lens):.0f}x the cache bytes; not run")
    if variant == "kT" and table is not None:
        raise OtherRegime("block KV: their kernel always transposes K while loading (tp_k_prior)")
    m = load(lib, "core.attention.attention_tkg")
    utils = load(lib, "core.attention.attention_tkg_utils")
    alloc = load(lib, "core.utils.allocator")
    logging = load(lib, "core.utils.logging")
    fp8 = case.dtype.startswith("fp8")
    d = q.shape[-1]
    a = decode_to_theirs(q, k, v, seq_lens, table, scale=1.0 / math.sqrt(d),
                         k_scale=DECODE_FP8_SCALE if fp8 else None,
                         kv_dtype=_nl().float8_e4m3 if fp8 else None,
                         k_transposed=variant == "kT")
    paged = a["table"] is not None
    with _nki03():
        cfg = utils.AttnTKGConfig(bs=a["bs"], q_head=a["q_head"], s_active=a["s_active"],
                                  curr_sprior=a["s_prior"], full_sprior=a["s_prior"], d_head=d,
                                  block_len=a["block_len"], tp_k_prior=variant != "kT",
                                  strided_mm1=not paged, use_pos_id=True, qk_in_sb=True)
    B, Hkv = q.shape[0], k.shape[2]
    kv = "block KV" if paged else ("flat KV, K stored [d, S]" if variant == "kT" else "flat KV")
    name = (f"attention_tkg ({kv}, {a['bs']} = B x {Hkv} KV "
            f"heads folded, in-kernel mask{', FP8 KV; v_scale on the host' if fp8 else ''})")
    args = (a["q"], a["k_active"], a["v_active"], a["k_prior"], a["v_prior"], a["mask"],
            a["pos"], a["table"], cfg)
    return Launch.one(name, _attention_tkg_call(m, alloc, logging), args, {},
                      lambda out: decode_from_theirs(out, B, Hkv,
                                                     DECODE_FP8_SCALE if fp8 else None))


# --- fused_moe


def moe_weights_to_theirs(wgu, wd, gu_scale=None, d_scale=None):
    """Our experts (w_gate_up [E, H, 2I]: gate columns [0, I), up [I, 2I); w_down [E, I, H];
    FP8 per-column scales [E, 2I] / [E, H]) as NKI Library's moe_tkg operands: gate_up
    [E, H, 2, I], down [E, I, H], scales [E, 2, I] / [E, H] (reshapes of the same bytes)."""
    wgu, wd = np.asarray(wgu), np.asarray(wd)
    E, H, I2 = wgu.shape
    out = [wgu.reshape(E, H, 2, I2 // 2), wd]
    if gu_scale is not None:
        out += [np.asarray(gu_scale, np.float32).reshape(E, 2, I2 // 2),
                np.asarray(d_scale, np.float32).reshape(E, -1)]
    return out


def moe_routing_to_theirs(weights, ids, n_experts):
    """Our routing (top-k weights [T, k] fp32, expert ids [T, k]) as moe_tkg's: dense affinities
    [T, E] float32 (the token's weight at each chosen expert, 0 elsewhere; their POST_SCALE mode
    reads affinities[t, index[t, j]]) and expert_index [T, k] int32."""
    w = np.asarray(weights, np.float32)
    ids = np.asarray(ids)
    T, k = ids.shape
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise NoEquivalent(f"expert ids outside [0, {n_experts}): moe_tkg's selective mode "
                           f"indexes the local experts only")
    for t in range(T):
        if len(set(ids[t].tolist())) != k:
            raise NoEquivalent("a token chose the same expert twice")
    aff = np.zeros((T, n_experts), np.float32)
    np.put_along_axis(aff, ids.astype(np.int64), w, axis=1)
    return aff, np.ascontiguousarray(ids.astype(np.int32))


def _theirs_fused_moe(lib, case, inputs, lnc, variant=""):
    """moe_tkg (variants "selective", "all") at decode T <= 128, moe_cte (variants "cte256",
    "cte512": its block size) at prefill; the other regime's variants are OtherRegime, and a
    reason that holds for every variant of the regime gives one row (its first variant)."""
    T, E = case.dims["T"], case.dims["E"]
    prefill = T > 128
    if variant.startswith("cte") != prefill:
        raise OtherRegime(f"T = {T}: {'prefill is moe_cte' if prefill else 'decode is moe_tkg'}")
    fp8 = case.dtype == "fp8"   # bench/defs/fused_moe.py: (x, w, ids, wgu, wd, *shared, *scales)
    x, w, ids, wgu, wd, *rest = inputs
    n_shared = 2 if len(rest) == (6 if fp8 else 2) else 0
    kernel = "moe_cte" if prefill else "moe_tkg"
    reason = None
    if case.dtype == "mx":
        layout = ("shard_on_block_mx's" if prefill else
                  "[E, 128, 2, H/512, I] x4 with [E, 16, 2, H/512, I] scales")
        reason = (f"their MX {kernel} takes MXFP4 / MXFP8 experts in its own layout ({layout}); "
                  f"a converter from ours is not written")
    elif n_shared:
        reason = f"{kernel} has no shared expert (this layer has one)"
    elif np.asarray(ids).max() >= E:
        reason = f"expert parallelism ({E} local experts): not paired"
    elif prefill and lnc == 1:
        reason = MOE_CTE_LNC1
    elif prefill and fp8:
        reason = ("moe_cte's FP8 weights are quantized per tensor or per channel in its own "
                  "scale layout ([E, 1, 2I] / [E, 1, H]); a converter from ours is not written")
    if reason is not None:
        raise (NoEquivalent if variant in ("selective", "cte256") else OtherRegime)(reason)
    if prefill:
        return _theirs_moe_cte(lib, case, x, w, ids, wgu, wd, block=int(variant[3:]))
    m = load(lib, "core.moe.moe_tkg.moe_tkg")
    types = load(lib, "core.utils.common_types")
    scales = rest[n_shared:n_shared + 2]
    ws = moe_weights_to_theirs(wgu, wd, *(scales[:2] if scales else ()))
    aff, idx = moe_routing_to_theirs(w, ids, E)
    kw = dict(is_all_expert=variant == "all",
              expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
              activation_fn=types.ActFnType.SiLU)
    if variant == "all":   # every local expert for every token; rank 0 holds them all; bf16
        import ml_dtypes
        aff = aff.astype(ml_dtypes.bfloat16)     # affinities, as their all-expert tests pass them
        kw["rank_id"] = np.zeros((1, 1), np.uint32)
    if scales:
        kw.update(expert_gate_up_weights_scale=ws[2], expert_down_weights_scale=ws[3])
    mode = "all experts" if variant == "all" else "selective experts"
    return Launch.one(f"moe_tkg ({mode}, POST_SCALE{', ROW fp8' if scales else ''})",
                      _jit(m.moe_tkg), (np.asarray(x), ws[0], ws[1], aff, idx), kw,
                      lambda out: np.asarray(out[0] if isinstance(out, (list, tuple)) else out))


MOE_CTE_LNC1 = ("moe_cte runs on two cores only (LNC 2): its shard-on-I path exchanges each "
                "block's partial sums with the other core by sendrecv (at LNC 1 it fails, "
                "IndexError in compute_down_proj_shard_on_intermediate) and shard-on-block "
                "splits the blocks between two cores; the LNC=2 row compares it")


def moe_blocks_to_theirs(weights, ids, n_experts, block):
    """Our routing (top-k weights [T, k], expert ids [T, k]) as moe_cte's blockwise plan, with
    the fewest blocks this routing needs (their tests size N for the worst case,
    ceil((T k - (E - 1)) / B) + E - 1, whose extra blocks their kernel computes as padding; the
    exact N is the lower bound of their time): each expert's tokens in token order, in blocks
    of ``block`` slots, padding slots pointing at the zero row T.
    Returns (token_position_to_id [N B] int32, block_to_expert [N, 1] int32, dense affinities
    [T + 1, E] float32 with row T zero)."""
    w = np.asarray(weights, np.float32)
    ids = np.asarray(ids).astype(np.int64)
    T, k = ids.shape
    pos, b2e = [], []
    for e in range(n_experts):
        toks = np.nonzero((ids == e).any(axis=1))[0]
        nb = -(-len(toks) // block)
        if nb == 0:
            continue
        slots = np.full(nb * block, T, np.int32)
        slots[:len(toks)] = toks
        pos.append(slots)
        b2e += [e] * nb
    aff = np.zeros((T + 1, n_experts), np.float32)
    np.put_along_axis(aff[:T], ids, w, axis=1)
    return (np.concatenate(pos).astype(np.int32), np.asarray(b2e, np.int32).reshape(-1, 1), aff)


def _theirs_moe_cte(lib, case, x, w, ids, wgu, wd, block):
    """NKI Library's prefill MoE at LNC 2, ``moe_cte`` with its shard-on-I implementation (I split
    between the cores; shard-on-block, the other bf16 one, shards blocks), POST_SCALE, SiLU, the
    fewest blocks of ``block`` tokens this routing needs (moe_blocks_to_theirs)."""
    m = load(lib, "core.moe.moe_cte.moe_cte")
    types = load(lib, "core.utils.common_types")
    T, H = np.asarray(x).shape
    E = case.dims["E"]
    tpos, b2e, aff = moe_blocks_to_theirs(w, ids, E, block)
    ws = moe_weights_to_theirs(wgu, wd)
    hidden = np.zeros((T + 1, H), np.asarray(x).dtype)
    hidden[:T] = x
    with _nki03():
        spec = m.MoECTESpec(implementation=m.MoECTEImplementation.shard_on_i)
    kw = dict(block_size=block, spec=spec,
              expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
              activation_function=types.ActFnType.SiLU,
              is_tensor_update_accumulating=case.dims["k"] != 1)
    return Launch.one(f"moe_cte (shard_on_i, {b2e.shape[0]} blocks of {block}, POST_SCALE)",
                      m.moe_cte, (hidden, aff.reshape(-1, 1), ws[0], ws[1], tpos, b2e), kw,
                      lambda out: np.asarray(out[0] if isinstance(out, (list, tuple)) else out)[:T])


MOE_FP8_COSINE = 0.999          # bench/defs/swiglu_mlp.py's FP8 rule (FP8_COSINE)


def _fused_moe_fp8_check(case):
    """The FP8 rows' check (the bench's fused_moe check compares bf16 and MX rows only), on the
    first and last rows: cosine similarity >= MOE_FP8_COSINE with ``reference.fused_moe`` on the
    dequantized FP8 weights, with the activations quantized per token to e4m3 (W8A8: ours, and
    the rule of the swiglu_mlp bench) or left unquantized (W8A16), whichever is closer: a side may
    compute either way. The same rule for both sides."""
    if case.dtype != "fp8":
        return None
    import ml_dtypes

    from nki_kernels.bench.defs import check_rows
    from nki_kernels.reference.compare import cosine_similarity
    from nki_kernels.reference.fused_moe import fused_moe_ref

    def check(inputs, y):
        x, w, ids, wgu, wd, *rest = inputs      # rest: [shared g|u, shared down,] scales
        sh = len(rest) == 6
        kw = dict(gate_up_scale=rest[2 if sh else 0], down_scale=rest[3 if sh else 1])
        if sh:
            kw.update(shared=tuple(rest[:2]), shared_scales=tuple(rest[4:]))
        rows = check_rows(x.shape[0])
        yr = np.asarray(y, np.float32)[rows]
        cs = {a: cosine_similarity(yr, fused_moe_ref(x[rows], wgu, wd, w[rows], ids[rows],
                                                     act_dtype=dt, **kw).astype(np.float32))
              for a, dt in (("W8A8", ml_dtypes.float8_e4m3), ("W8A16", None))}
        best = max(cs, key=cs.get)
        assert cs[best] >= MOE_FP8_COSINE, (f"fused_moe {case.shape} fp8: cosine similarity "
                                            f"{cs['W8A8']:.6f} (W8A8), {cs['W8A16']:.6f} (W8A16)")
    return check


_JITTED = {}


def _jit(fn):
    """``nki.jit(fn)`` once per function: NKI Library's subroutine-style kernels (moe_tkg) as a
    launchable kernel, as their test harness launches them."""
    if id(fn) not in _JITTED:
        import importlib
        _JITTED[id(fn)] = importlib.import_module("nki").jit(fn)
    return _JITTED[id(fn)]


PAIRS = {
    "rmsnorm_quant": Pair("rmsnorm_quant", "core/rmsnorm", (1, 2), _ours_rmsnorm_quant,
                          _theirs_rmsnorm_quant),
    "swiglu_mlp": Pair("swiglu_mlp", "core/mlp", (1,), _ours_swiglu_mlp, _theirs_swiglu_mlp),
    "qkv_proj": Pair("qkv_proj", "core/qkv", (1,), _ours_qkv_proj, _theirs_qkv_proj,
                     ("cte", "tkg")),
    "flash_attention": Pair("flash_attention", "core/attention", (1,), _ours_flash_attention,
                            _theirs_flash_attention),
    "decode_attention": Pair("decode_attention", "core/attention", (1, 2), _ours_own_lnc,
                             _theirs_decode_attention, ("", "kT"), own_lnc=True),
    "fused_moe": Pair("fused_moe", "core/moe", (1, 2), _ours_own_lnc, _theirs_fused_moe,
                      ("selective", "all", "cte256", "cte512"), own_lnc=True,
                      check=_fused_moe_fp8_check),
}


# ------------------------------------------------------------------------------------ running


def select(ops=None, tier: str = harness.DEFAULT_TIER, target: str = "trn3",
           shape: str | None = None, dtype: str | None = None):
    """[(pair, case)] for the paired ``ops`` (all when None) in ``tier`` (``shape``, ``dtype``:
    only names / dtype labels that contain them)."""
    wanted = list(ops) if ops else list(PAIRS)
    bad = [o for o in wanted if o not in PAIRS]
    if bad:
        raise harness.BenchError(f"--vs-nkilib: no NKI Library pair for op {bad[0]!r}; paired "
                                 f"ops: {', '.join(PAIRS)}")
    out = []
    for op in wanted:
        out += [(PAIRS[op], c) for c in harness.select([op], tier, target, shape, dtype)]
    return out


def _modeled_theirs(launch: Launch, target: str, lnc: int) -> dict:
    """cost.estimate of NKI Library's kernel(s), the call run_modeled makes for ours (NKI 0.3);
    stages' times add up, less the launch overhead of every stage after the first."""
    import io

    from nki_kernels.emulator import target as emulated_target
    from nki_kernels.emulator.cost import estimate
    total, busy, n_ins, out = 0.0, {}, 0, None
    log = io.StringIO()
    for k, st in enumerate(launch.stages):
        args, kwargs = st.make(out)
        # their kernels print [INFO] / [WARN] lines (SBUF manager, untested-size warnings) to
        # stdout: kept off the table, the warnings go into the row
        with _nki03(True), emulated_target(target), contextlib.redirect_stdout(log):
            rep = estimate(st.kernel, *args, target=target, lnc=lnc, **kwargs)
        total += float(rep.total_ns) - (float(rep.launch_ns) * rep.n_launches if k else 0.0)
        for e, v in rep.engine_busy_ns.items():
            busy[e] = busy.get(e, 0.0) + float(v)
        n_ins += rep.n_instructions
        out = rep.outputs
    engine = max(busy, key=busy.get) if any(busy.values()) else None
    warns = [ln.strip() for ln in log.getvalue().splitlines() if "WARN" in ln]
    return {"time_ns": total, "engine_busy_ns": busy, "binding_engine": engine,
            "n_instructions": n_ins, "outputs": out, "notes": list(dict.fromkeys(warns)) or None}


def _measured_theirs(launch: Launch, case, lnc, **kw) -> tuple[dict, object]:
    """Device time of NKI Library's kernel(s) (bench/device.py; stages' times add up) and the
    last output; written for a trn instance with the real nki, never run here."""
    total, out, res = 0.0, None, {}
    for st in launch.stages:
        args, kwargs = st.make(out)
        k = st.kernel[lnc] if lnc != 1 else st.kernel
        # the launch's positional arrays are the NEFF's inputs (bench/device.py feeds them)
        fake = dataclasses.replace(case, run=lambda *a, k=k, kw_=kwargs: k(*a, **kw_))
        res = harness.run_measured(fake, tuple(args), **kw)
        total += res["time_ns"] or 0.0
        out = k(*args, **kwargs)
    return {**res, "time_ns": total}, out


def _side(case_l, target, source, inputs, run, *, sha, date) -> dict:
    """Run one side; its harness row plus ``check`` and ``wall_s``; no time unless it checks."""
    t0 = time.perf_counter()
    out = None
    try:
        res, out = run()
        try:
            check = harness.check_output(case_l, inputs, out)
        except AssertionError as e:
            raise harness.WrongResult(f"output differs from the reference: {_first_line(e)}") \
                from None
        row = harness.make_row(case_l, target, source, res, sha=sha, date=date)
        row["check"] = check
    except NoEquivalent as e:
        row = harness.make_row(case_l, target, source, None, sha=sha, date=date,
                               error=f"no equivalent: {e}")
        row["check"] = "not run"
    except Unavailable as e:
        row = harness.make_row(case_l, target, source, None, sha=sha, date=date,
                               error=f"unavailable: {e}")
        row["check"] = "not run"
    except harness.WrongResult as e:
        row = harness.make_row(case_l, target, source, None, sha=sha, date=date,
                               error=f"wrong result: {e}")
        row["check"] = "failed"
    except Exception as e:  # noqa: BLE001 - a refusal (kernel_assert, shape check) is a reason
        row = harness.make_row(case_l, target, source, None, sha=sha, date=date,
                               error=f"refused or failed: {type(e).__name__}: {_first_line(e)}")
        row["check"] = "not run"
    del out
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def pair_row(pair: Pair, case, lnc: int, ours: dict, theirs: dict, lib: NkiLib | None,
             launch_name: str | None = None) -> dict:
    """One output line from the two sides' harness rows."""
    def side(r):
        return {"time_us": r.get("time_us"), "pct_roof": r.get("pct_roof"),
                "tflops": r.get("tflops"), "gbps": r.get("gbps"),
                "model_bound": r.get("model_bound"), "check": r.get("check"),
                "error": r.get("error"), "wall_s": r.get("wall_s"), "notes": r.get("notes")}
    o, t = side(ours), side(theirs)
    ratio = None
    if o["time_us"] and t["time_us"] and not o["error"] and not t["error"]:
        ratio = t["time_us"] / o["time_us"]
    return {
        "kind": "vs_nkilib", "op": case.op, "nkilib_family": pair.family,
        "nkilib_kernel": launch_name, "shape": case.shape, "dims": dict(case.dims),
        "dtype": case.dtype, "target": ours["target"], "lnc": lnc, "source": ours["source"],
        "roof": ours.get("roof") or theirs.get("roof"), "ours": o, "nkilib": t,
        "ratio_theirs_over_ours": ratio,
        "nkilib_path": str(lib.path) if lib else None,
        "nkilib_commit": lib.commit if lib else None,
        "git_sha": ours["git_sha"], "date": ours["date"],
    }


def run(lib: NkiLib, ops=None, tier: str = harness.DEFAULT_TIER, target: str = "trn3", *,
        shape: str | None = None, dtype: str | None = None, seed: int = 0,
        measured: bool = False, lncs=(1, 2), progress: bool = True, on_row=None,
        warmup: int = 5, repeats: int = 20) -> list[dict]:
    """Run every paired case at each LNC of ``lncs`` both sides support; the rows (see pair_row)."""
    from nki_kernels.bench import roofline
    roofline._target(target)
    if not measured and harness.backend_name() != "emulator":
        raise harness.BenchError("--vs-nkilib: modeled time needs the emulator backend; run with "
                                 "--modeled, or pass --measured on a device")
    selected = [(p, c, n) for p, c in select(ops, tier, target, shape, dtype)
                for n in p.case_lncs(c) if n in lncs]
    _emulated[0] = not measured
    sha, date = harness.git_sha(), harness.now_iso()
    rows = []
    for i, (pair, case, lnc) in enumerate(selected):
        label = f"{case.op} {case.shape} {case.dtype} LNC={lnc}"
        if progress:
            print(f"[{i + 1}/{len(selected)}] {label} ...", file=sys.stderr, flush=True)
        for row in run_one(lib, pair, case, lnc, target, measured=measured, seed=seed, sha=sha,
                           date=date, warmup=warmup, repeats=repeats):
            rows.append(row)
            if on_row is not None:
                on_row(row)
            if progress:
                print(f"    ours {_cell(row['ours'])} ({row['ours']['wall_s']} s); NKI Library "
                      f"{row['nkilib_kernel'] or row['nkilib_family']}: {_cell(row['nkilib'])} "
                      f"({row['nkilib']['wall_s']} s)", file=sys.stderr, flush=True)
    return rows


def run_one(lib, pair: Pair, case, lnc: int, target: str, *, measured: bool = False,
            seed: int = 0, sha: str = "unknown", date: str = "", warmup: int = 5,
            repeats: int = 20) -> list[dict]:
    """Both sides of one (case, LNC) on the same inputs: one row per NKI Library variant."""
    source = "measured" if measured else "modeled"
    inputs = case.make_inputs(harness.case_rng(case, seed))
    case_l = dataclasses.replace(case, lnc=lnc)
    extra = pair.check(case) if pair.check is not None else None
    if extra is not None:
        case_l = dataclasses.replace(case_l, check=extra)

    def ours_run():
        c = dataclasses.replace(case_l, run=pair.ours(case, lnc))
        if measured:
            res = harness.run_measured(c, inputs, warmup=warmup, repeats=repeats)
            return res, c.run(*inputs)
        res = harness.run_modeled(c, target, inputs)
        return res, res.pop("outputs", None)

    ours = _side(case_l, target, source, inputs, ours_run, sha=sha, date=date)
    rows = []
    for variant in pair.variants:
        got = {}

        def theirs_run(variant=variant, got=got):
            try:
                launch = pair.theirs(lib, case, inputs, lnc, variant)
            except OtherRegime:
                got["other_regime"] = True
                raise
            got["name"] = launch.name
            if measured:
                res, out = _measured_theirs(launch, case_l, lnc, warmup=warmup, repeats=repeats)
                return res, launch.to_ours(out)
            res = _modeled_theirs(launch, target, lnc)
            return res, launch.to_ours(res.pop("outputs"))

        theirs = _side(case_l, target, source, inputs, theirs_run, sha=sha, date=date)
        name = got.get("name") or (f"{pair.family} ({variant})" if variant else None)
        row = pair_row(pair, case, lnc, ours, theirs, lib, name)
        row["_other_regime"] = bool(got.get("other_regime"))
        rows.append(row)
    kept = [r for r in rows if not r["_other_regime"]] or rows[:1]
    for r in rows:
        del r["_other_regime"]
    return kept


# ------------------------------------------------------------------------------------ output


def _cell(s: dict) -> str:
    if s.get("error") or s.get("time_us") is None:
        return "-"
    return f"{s['time_us']:.2f} us"


def _check_cell(s: dict) -> str:
    if s.get("error"):
        kind = s["error"].split(":")[0]
        return {"no equivalent": "n/a", "unavailable": "not run", "wrong result": "✗ failed",
                "refused or failed": "refused"}.get(kind, "error")
    return "✓ passed" if s.get("check") == "passed" else (s.get("check") or "-")


def markdown_table(rows, *, tier: str | None = None) -> str:
    """The markdown report: header (targets, date, shas, source), one table, then the reasons."""
    if not rows:
        return "_no --vs-nkilib rows_\n"
    targets = sorted({r["target"] for r in rows})
    sources = sorted({r["source"] for r in rows})
    shas = sorted({r["git_sha"] for r in rows})
    libs = sorted({f"{r['nkilib_path']} (commit {r['nkilib_commit']})" for r in rows})
    dates = sorted({r["date"][:10] for r in rows})
    what = ("modeled: the emulator's cost model, the same cost.estimate call for both kernels"
            if sources == ["modeled"] else "measured on a Neuron device")
    lines = [
        f"# nki-kernels beside NKI Library: {', '.join(targets)}"
        + (f", tier {tier}" if tier else ""),
        "",
        f"{' to '.join(dict.fromkeys([dates[0], dates[-1]]))}, nki-kernels git {', '.join(shas)}; "
        f"NKI Library {', '.join(libs)}. Times {' / '.join(sources)} ({what}). % of roof: the "
        "bench's roof for the problem (same FLOPs, bytes and LNC for both). ratio = NKI "
        "Library / ours (> 1: ours is faster). Both outputs checked against our NumPy reference "
        "with the bench's rule; a side that fails, refuses or has no equivalent posts no time.",
        "",
        "| op | NKI Library kernel | problem | dtype | target | LNC | ours (us) | NKI Library "
        "(us) | ours % roof | NKI Library % roof | ratio | our check | their check | "
        "wall (s) ours / theirs |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    notes = []
    for r in rows:
        o, t = r["ours"], r["nkilib"]
        kern = r.get("nkilib_kernel") or r["nkilib_family"]
        ratio = harness._fmt(r["ratio_theirs_over_ours"], ".2f")
        lines.append(
            f"| {r['op']} | {kern} | {r['shape']} | {r['dtype']} | {r['target']} | {r['lnc']} | "
            f"{harness._fmt(o['time_us'] if not o['error'] else None, '.2f')} | "
            f"{harness._fmt(t['time_us'] if not t['error'] else None, '.2f')} | "
            f"{harness._fmt(o['pct_roof'] if not o['error'] else None, '.1f')} | "
            f"{harness._fmt(t['pct_roof'] if not t['error'] else None, '.1f')} | {ratio} | "
            f"{_check_cell(o)} | {_check_cell(t)} | {harness._fmt(o['wall_s'], '.1f')} / "
            f"{harness._fmt(t['wall_s'], '.1f')} |")
        for who, s in (("ours", o), ("NKI Library", t)):
            if s.get("error"):
                notes.append(f"- {r['op']} {r['shape']} {r['dtype']} {r['target']} LNC={r['lnc']}, "
                             f"{who}: {s['error']}")
    if notes:
        lines += ["", "Why a cell has no time:", *dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"


def write(rows, out_dir=None, *, json_path=None, tier=None, subset=False,
          append_json=True) -> dict:
    """Append the JSON lines (``vs_nkilib.jsonl``) and write the markdown table
    ``vs_nkilib_<targets>_<tier>[_subset].md`` under ``out_dir`` (default bench/results/local)."""
    out = Path(out_dir) if out_dir is not None else harness.default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    jpath = Path(json_path or out / "vs_nkilib.jsonl")
    if append_json:
        harness.write_jsonl(rows, jpath)
    targets = sorted({r["target"] for r in rows}) or ["trn3"]
    tag = "_".join(targets) + (f"_{tier}" if tier else "") + ("_subset" if subset else "")
    md = out / f"vs_nkilib_{tag}.md"
    md.write_text(markdown_table(rows, tier=tier))
    return {"json": jpath, "markdown": md}


def main(args) -> int:
    """``nki-kernels bench --vs-nkilib PATH`` (args: the bench parser's namespace)."""
    try:
        lib = find_nkilib(args.vs_nkilib)
    except harness.BenchError as e:
        print(f"nki-kernels bench: {e}", file=sys.stderr)
        return 2
    for flag in ("publish", "readme", "profile"):
        if getattr(args, flag, False):
            print(f"nki-kernels bench: --{flag} does not apply to --vs-nkilib (its rows go to "
                  f"vs_nkilib.jsonl and its own table)", file=sys.stderr)
            return 2
    ops = None
    if args.op:
        ops = [n.strip() for v in args.op for n in v.split(",") if n.strip()]
    tier = args.tier or harness.DEFAULT_TIER
    out_dir = args.out
    json_path = args.json or (out_dir or harness.default_out_dir()) / "vs_nkilib.jsonl"
    if args.list:
        try:
            for p, c in select(ops, tier, args.target, args.shape, args.dtype):
                print(f"{c.op:<16} {p.family:<14} {c.shape:<34} {c.dtype:<14} LNC "
                      f"{','.join(map(str, p.case_lncs(c)))}")
        except harness.BenchError as e:
            print(f"nki-kernels bench: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        rows = run(lib, ops, tier, args.target, shape=args.shape, dtype=args.dtype,
                   seed=args.seed,
                   measured=bool(args.measured), progress=not args.quiet,
                   warmup=args.warmup, repeats=args.repeats,
                   on_row=lambda r: harness.write_jsonl([r], json_path))
    except harness.BenchError as e:
        print(f"nki-kernels bench: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"nki-kernels bench --vs-nkilib: no paired cases for ops={ops or 'all'} tier={tier}"
              + (f" shape~{args.shape!r}" if args.shape else "")
              + (f" dtype~{args.dtype!r}" if args.dtype else ""), file=sys.stderr)
        return 2
    paths = write(rows, out_dir, json_path=json_path, tier=tier,
                  subset=bool(ops or args.shape or args.dtype), append_json=False)
    if not args.quiet:
        print(markdown_table(rows, tier=tier))
    print(f"wrote {paths['json']} (appended), {paths['markdown']}", file=sys.stderr)
    ours_failed = any(r["ours"]["error"] and not r["ours"]["error"].startswith("no equivalent")
                      for r in rows)
    return 1 if ours_failed else 0


def rows_from_jsonl(path) -> list[dict]:
    """The --vs-nkilib rows of a JSON-lines file (others skipped)."""
    return [r for r in (json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip())
            if r.get("kind") == "vs_nkilib"]
