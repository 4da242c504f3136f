"""Every public op as a ``torch.library`` op in the ``nki_kernels`` namespace.

One :class:`OpDef` per op in :data:`OPS`: the torch schema, the kernel adapter (runs the public
NumPy-facing op), an optional NumPy-reference adapter, and a fake (meta) implementation that
gives output shapes and dtypes without running anything, so ``torch.compile(fullgraph=True)``
traces a model through the op. Adding an op is adding one entry.

Dispatch (the device of the tensor arguments):

* CPU: the nki kernel on the nki-kernels emulator (bit for bit what the tests check); or, with
  ``NKI_KERNELS_TORCH_IMPL=reference`` / ``with nki_kernels.torch.implementation("reference")``,
  the plain-NumPy fp32 reference (fast, not bit-identical; ops or arguments a reference does not
  cover still run the kernel).
* XLA (Neuron device, torch-neuronx): the same public op with device tensors, which launches the
  real ``nki.jit`` kernel (NKI kernels take torch-xla tensors directly under torch-neuronx).
  Without torch-neuronx and the real ``nki`` it raises :class:`NeuronUnavailable`.
* anything else: a ``RuntimeError`` naming the op and the device.

Ops are inference-only: their autograd formula raises.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import backend
from .._validate import dtype_name as _array_dtype
from ..attention.decode_attention import decode_attention as _decode_attention
from ..attention.flash_attention import flash_attention as _flash_attention
from ..attention.kv_cache_append import kv_cache_append as _kv_cache_append
from ..attention.merge_attention_states import merge_attention_states as _merge_states
from ..attention.mla_decode import mla_decode as _mla_decode
from ..attention.paged_attention import paged_attention as _paged_attention
from ..attention.paged_attention import plan_paged_attention as _plan_paged_attention
from ..dense.matmul import matmul as _matmul
from ..dense.qkv_proj import qkv_proj as _qkv_proj
from ..dense.swiglu_mlp import swiglu_mlp as _swiglu_mlp
from ..dense.swiglu_mlp import tile_weight as _tile_weight
from ..moe.fused_moe import fused_moe as _fused_moe
from ..moe.fused_moe import tile_expert_weights as _tile_expert_weights
from ..moe.router_topk import router_topk as _router_topk
from ..quant.mxfp8_matmul import MXTensor
from ..quant.mxfp8_matmul import mxfp8_matmul as _mxfp8_matmul
from ..quant.mxfp8_matmul import quantize_weights_mx as _quantize_weights_mx
from ..quant.rmsnorm_quant import rmsnorm_quant as _rmsnorm_quant
from ._convert import TORCH_DTYPE, dtype_name, to_numpy, to_torch

NAMESPACE = "nki_kernels"
IMPL_ENV = "NKI_KERNELS_TORCH_IMPL"
IMPLS = ("kernel", "reference")
_impl_override: contextvars.ContextVar = contextvars.ContextVar("nki_kernels_torch_impl",
                                                                default=None)


class NeuronUnavailable(RuntimeError):
    """An op got XLA tensors but torch-neuronx or the real ``nki`` is not importable."""


@contextlib.contextmanager
def implementation(name: str):
    """Select the CPU implementation inside a block: "kernel" (the emulated nki kernel, the
    default) or "reference" (the NumPy reference). Overrides ``NKI_KERNELS_TORCH_IMPL``."""
    if name not in IMPLS:
        raise ValueError(f"nki_kernels.torch.implementation: name must be one of "
                         f"{', '.join(IMPLS)}; got {name!r}")
    tok = _impl_override.set(name)
    try:
        yield
    finally:
        _impl_override.reset(tok)


def current_implementation() -> str:
    choice = _impl_override.get()
    if choice is not None:
        return choice
    env = os.environ.get(IMPL_ENV, "").strip().lower() or "kernel"
    if env not in IMPLS:
        raise ValueError(f"{IMPL_ENV} must be one of {', '.join(IMPLS)} (or unset); got {env!r}")
    return env


@dataclass(frozen=True)
class OpDef:
    """One torch op.

    name: op name (``torch.ops.nki_kernels.<name>``); schema: its torch schema after the name;
    kernel: adapter calling the public op, args by schema name (CPU: NumPy arrays, XLA: tensors);
    fake: the same args as FakeTensors -> empty outputs of the right shape, dtype and device;
    reference: NumPy adapter, or None; it may return ``NotImplemented`` for arguments it does not
    cover (the kernel runs instead); mutates: names of tensor args written in place.
    ``numpy_like``: arg name -> ml_dtypes name that a uint8 tensor of that arg carries.
    """
    name: str
    schema: str
    kernel: Callable
    fake: Callable
    reference: Callable | None = None
    mutates: tuple = ()
    numpy_like: Callable | None = None


# --------------------------------------------------------------------------------- helpers
def _py(x):
    """A small tensor argument (positions, scales) as NumPy; other values unchanged."""
    return to_numpy(x.cpu()) if isinstance(x, torch.Tensor) else x


def _empty(shape, dtype, like):
    return torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=like.device)


def _none_if_empty(t):
    """Optional outputs cross the schema as an empty tensor (torch ops cannot return None)."""
    return None if t is None or t.numel() == 0 else t


def _target_gen() -> int:
    from ..backend import nisa
    return int(nisa.get_nc_version())


def _fp8_default(fp8_dtype):
    return fp8_dtype or ("float8_e4m3fn" if _target_gen() >= 4 else "float8_e4m3")


def _out_name(out_dtype):
    if out_dtype is None:
        return None
    return dtype_name(out_dtype) if isinstance(out_dtype, torch.dtype) else str(out_dtype)


# ------------------------------------------------------------------------------------ matmul
def _matmul_kernel(a, b, out_dtype=None, lnc=1):
    return _matmul(a, b, out_dtype=_out_name(out_dtype), lnc=lnc)


def _matmul_ref(a, b, out_dtype=None, lnc=1):
    from ..reference.matmul import matmul_ref
    name = _out_name(out_dtype) or ("float32" if a.dtype == np.float32 else "bfloat16")
    return matmul_ref(a, b, name)


def _matmul_fake(a, b, out_dtype=None, lnc=1):
    dt = out_dtype or (torch.float32 if a.dtype == torch.float32 else torch.bfloat16)
    return _empty((a.shape[0], b.shape[1]), dt, a)


# --------------------------------------------------------------------------- flash_attention
_FA_ARGS = ("causal", "scale", "window", "softcap", "sinks", "k_layout", "lnc")


def _fa_kernel(q, k, v, causal=True, scale=None, window=None, softcap=None, sinks=None,
               k_layout="bhsd", lnc=1, return_lse=False):
    return _flash_attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                            sinks=sinks, return_lse=return_lse, k_layout=k_layout, lnc=lnc)


def _fa_ref(q, k, v, causal=True, scale=None, window=None, softcap=None, sinks=None,
            k_layout="bhsd", lnc=1, return_lse=False):
    from ..reference.flash_attention import flash_attention_ref
    return flash_attention_ref(q, k, v, causal=causal, scale=scale, window=window,
                               softcap=softcap, sinks=None if sinks is None else np.asarray(
                                   sinks, np.float32), return_lse=return_lse, k_layout=k_layout)


def _fa_fake(q, k, v, causal=True, scale=None, window=None, softcap=None, sinks=None,
             k_layout="bhsd", lnc=1):
    return _empty(q.shape, q.dtype, q)


def _fa_lse_fake(q, k, v, causal=True, scale=None, window=None, softcap=None, sinks=None,
                 k_layout="bhsd", lnc=1):
    return _empty(q.shape, q.dtype, q), _empty(q.shape[:3], torch.float32, q)


# --------------------------------------------------------------------------------- qkv_proj
_QKV_SCHEMA = ("(Tensor x, Tensor w_qkv, int n_q_heads, int n_kv_heads, int head_dim, "
               "Tensor? bias=None, Tensor? residual=None, Tensor? norm_weight=None, "
               "float eps=1e-06, Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, "
               "float? qk_norm_eps=None, Tensor? positions=None, float rope_theta=10000.0, "
               "Tensor? cos=None, Tensor? sin=None, int? rotary_dim=None, "
               "str rope_layout='half', str k_layout='heads') -> (Tensor, Tensor, Tensor, Tensor)")


def _qkv_args(kw):
    for n in ("positions", "cos", "sin"):
        kw[n] = _py(kw[n])
    return kw


def _qkv_kernel(x, w_qkv, **kw):
    r = _qkv_proj(x, w_qkv, **_qkv_args(kw))
    h = r.residual if r.residual is not None else np.zeros((0, x.shape[1]), x.dtype)
    return r.q, r.k, r.v, h


def _qkv_ref(x, w_qkv, **kw):
    from ..reference.qkv_proj import qkv_proj_ref
    q, k, v, h = qkv_proj_ref(x, w_qkv, **_qkv_args(kw))
    return q, k, v, (h if h is not None else np.zeros((0, x.shape[1]), x.dtype))


def _qkv_fake(x, w_qkv, n_q_heads, n_kv_heads, head_dim, bias=None, residual=None, **kw):
    T, H = x.shape
    k_shape = (n_kv_heads, head_dim, T) if kw.get("k_layout") == "transposed" else (
        n_kv_heads, T, head_dim)
    return (_empty((n_q_heads, T, head_dim), x.dtype, x), _empty(k_shape, x.dtype, x),
            _empty((n_kv_heads, T, head_dim), x.dtype, x),
            _empty((T, H) if residual is not None else (0, H), x.dtype, x))


# -------------------------------------------------------------------------------- swiglu_mlp
def _mlp_kernel(x, w_gate, w_up, w_down, **kw):
    return _swiglu_mlp(x, w_gate, w_up, w_down, **kw)


def _mlp_ref(x, w_gate, w_up, w_down, **kw):
    from ..reference.swiglu_mlp import swiglu_mlp_ref
    if w_gate.ndim == 4:
        return NotImplemented          # tile-major weights: the reference takes [H, I] only
    fp8 = np.dtype(w_gate.dtype).itemsize == 1
    return swiglu_mlp_ref(x, w_gate, w_up, w_down, act_dtype=w_gate.dtype if fp8 else None,
                          **kw)


def _mlp_fake(x, w_gate, w_up, w_down, **kw):
    return _empty(x.shape, torch.bfloat16, x)


def _tile_fake(w):
    K, N = w.shape
    KT = K // 128
    return _empty((N // 128, 128, KT + KT % 2, 128), w.dtype, w)


# ---------------------------------------------------------------------------- rmsnorm_quant
def _rq_kernel(x, gamma, residual=None, eps=1e-6, fp8_dtype=None, static_scale=None, lnc=1):
    r = _rmsnorm_quant(x, gamma, residual=residual, eps=eps, quant="fp8",
                       fp8_dtype=fp8_dtype, static_scale=static_scale, lnc=lnc)
    return (r[0], r[1], r[2] if residual is not None else np.zeros((0, x.shape[1]), x.dtype))


def _rq_ref(x, gamma, residual=None, eps=1e-6, fp8_dtype=None, static_scale=None, lnc=1):
    from ..reference.rmsnorm_quant import rmsnorm_quant_fp8_ref
    r = rmsnorm_quant_fp8_ref(x, gamma, residual, eps, _fp8_default(fp8_dtype), static_scale)
    return (r[0], r[1], r[2] if residual is not None else np.zeros((0, x.shape[1]), x.dtype))


def _rq_fake(x, gamma, residual=None, eps=1e-6, fp8_dtype=None, static_scale=None, lnc=1):
    T, H = x.shape
    return (_empty((T, H), TORCH_DTYPE[_fp8_default(fp8_dtype)], x),
            _empty((T, 1), torch.float32, x),
            _empty((T, H) if residual is not None else (0, H), x.dtype, x))


def _rq_mx_kernel(x, gamma, residual=None, eps=1e-6, mx_fmt="e4m3fn", lnc=1):
    r = _rmsnorm_quant(x, gamma, residual=residual, eps=eps, quant="mx", mx_fmt=mx_fmt, lnc=lnc)
    mx, h = (r[0], r[1]) if residual is not None else (r, np.zeros((0, x.shape[1]), x.dtype))
    return mx.data, mx.scale, h


def _rq_mx_ref(x, gamma, residual=None, eps=1e-6, mx_fmt="e4m3fn", lnc=1):
    from ..reference.rmsnorm_quant import rmsnorm_quant_mx_ref
    r = rmsnorm_quant_mx_ref(x, gamma, residual, eps, mx_fmt)
    return r[0], r[1], (r[2] if residual is not None else np.zeros((0, x.shape[1]), x.dtype))


def _rq_mx_fake(x, gamma, residual=None, eps=1e-6, mx_fmt="e4m3fn", lnc=1):
    T, H = x.shape
    return (_empty((128, (H // 512) * T), torch.uint32, x),
            _empty((64, -(-H // 2048) * T), torch.uint8, x),
            _empty((T, H) if residual is not None else (0, H), x.dtype, x))


# ----------------------------------------------------------------------------- mxfp8_matmul
def _mx_operand(t, scale, k, fmt):
    return t if scale is None else MXTensor(t, scale, fmt, int(k))


def _mx_kernel(a, b, a_scale=None, b_scale=None, k=None, a_fmt="e4m3fn", b_fmt="e4m3fn",
               fmt="e4m3fn", out_dtype=None, lnc=1):
    return _mxfp8_matmul(_mx_operand(a, a_scale, k, a_fmt), _mx_operand(b, b_scale, k, b_fmt),
                         out_dtype=dtype_name(out_dtype or torch.bfloat16), fmt=fmt,
                         lnc=lnc)


def _mx_ref(a, b, a_scale=None, b_scale=None, k=None, a_fmt="e4m3fn", b_fmt="e4m3fn",
            fmt="e4m3fn", out_dtype=None, lnc=1):
    from ..reference.mxfp8_matmul import mxfp8_matmul_ref
    aa = a if a_scale is None else (a, a_scale)
    bb = b if b_scale is None else (b, b_scale)
    return mxfp8_matmul_ref(aa, bb, fmt=fmt, out_dtype=dtype_name(out_dtype or torch.bfloat16),
                            a_fmt=a_fmt if a_scale is not None else None,
                            b_fmt=b_fmt if b_scale is not None else None, K=k)[0]


def _mx_fake(a, b, a_scale=None, b_scale=None, k=None, a_fmt="e4m3fn", b_fmt="e4m3fn",
             fmt="e4m3fn", out_dtype=None, lnc=1):
    kt = None if k is None else -(-int(k) // 512)
    M = a.shape[0] if a_scale is None else a.shape[1] // kt
    N = b.shape[1] if b_scale is None else b.shape[1] // kt
    return _empty((M, N), out_dtype or torch.bfloat16, a)


def _qmx_kernel(w, fmt="e4m3fn"):
    r = _quantize_weights_mx(w, fmt)
    return r.data, r.scale


def _qmx_fake(w, fmt="e4m3fn"):
    K, N = w.shape
    KT = -(-K // 512)
    return _empty((128, KT * N), torch.uint32, w), _empty((64, -(-KT // 4) * N), torch.uint8, w)


# -------------------------------------------------------------------------- decode_attention
def _da_args(kw):
    for n in ("seq_lens", "block_table", "k_scale", "v_scale"):
        kw[n] = _py(kw[n])
    for n in ("k_scale", "v_scale"):
        if kw[n] is not None and np.ndim(kw[n]) == 0:
            kw[n] = float(kw[n])
    return kw


def _da_kernel(q, k_cache, v_cache, seq_lens, return_lse=False, **kw):
    return _decode_attention(q, k_cache, v_cache, return_lse=return_lse,
                             **_da_args(dict(kw, seq_lens=seq_lens)))


def _da_ref(q, k_cache, v_cache, seq_lens, return_lse=False, lnc=1, **kw):
    from ..reference.decode_attention import decode_attention_ref
    kw = _da_args(dict(kw, seq_lens=seq_lens))
    return decode_attention_ref(q, k_cache, v_cache, kw.pop("seq_lens"), return_lse=return_lse,
                                **kw)


def _da_fake(q, k_cache, v_cache, seq_lens, **kw):
    return _empty(q.shape, q.dtype, q)


def _da_lse_fake(q, k_cache, v_cache, seq_lens, **kw):
    return _empty(q.shape, q.dtype, q), _empty(q.shape[:3], torch.float32, q)


# --------------------------------------------------------------------------- paged_attention
_PLANS: dict = {}           # the last few plans: the layers of one step share theirs


def _pa_args(kw):
    for n in ("block_table", "seq_lens", "query_start_loc", "k_scale", "v_scale", "sinks"):
        kw[n] = _py(kw[n])
    for n in ("k_scale", "v_scale"):
        if kw[n] is not None and np.ndim(kw[n]) == 0:
            kw[n] = float(kw[n])
    return kw


def _pa_kernel(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, return_lse=False,
               **kw):
    kw = _pa_args(dict(kw, block_table=block_table, seq_lens=seq_lens,
                       query_start_loc=query_start_loc))
    key = (tuple(np.asarray(kw["seq_lens"]).tolist()),
           tuple(np.asarray(kw["query_start_loc"]).tolist()), tuple(k_cache.shape),
           int(q.shape[1]), _array_dtype(k_cache), kw.get("window"), kw.get("lnc", 1),
           int(backend.nisa.get_nc_version()))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_paged_attention(kw["seq_lens"], kw["query_start_loc"], int(k_cache.shape[1]),
                                     int(q.shape[1]), int(k_cache.shape[2]), int(q.shape[2]),
                                     window=kw.get("window"), kv_dtype=_array_dtype(k_cache),
                                     lnc=kw.get("lnc", 1))
        if len(_PLANS) >= 8:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return _paged_attention(q, k_cache, v_cache, kw.pop("block_table"), kw.pop("seq_lens"),
                            kw.pop("query_start_loc"), plan=plan, return_lse=return_lse, **kw)


def _pa_ref(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, return_lse=False, lnc=1,
            **kw):
    from ..reference.paged_attention import paged_attention_ref
    kw = _pa_args(dict(kw, block_table=block_table, seq_lens=seq_lens,
                       query_start_loc=query_start_loc))
    o, lse = paged_attention_ref(q, k_cache, v_cache, kw.pop("block_table"), kw.pop("seq_lens"),
                                 kw.pop("query_start_loc"), out_dtype=_array_dtype(q), **kw)
    return (o, lse) if return_lse else o


def _pa_fake(q, *args, **kw):
    return _empty(q.shape, q.dtype, q)


def _pa_lse_fake(q, *args, **kw):
    return _empty(q.shape, q.dtype, q), _empty(q.shape[:2], torch.float32, q)


# --------------------------------------------------------------------------- kv_cache_append
def _kva_args(kw):
    kw["slot_mapping"] = _py(kw["slot_mapping"])
    for n in ("k_scale", "v_scale"):
        kw[n] = _py(kw[n])
        if kw[n] is not None and np.ndim(kw[n]) == 0:
            kw[n] = float(kw[n])
    return kw


def _kva_kernel(k, v, k_cache, v_cache, slot_mapping, **kw):
    """Writes k_cache / v_cache in place (CPU: NumPy views of the tensors' memory)."""
    kw = _kva_args(dict(kw, slot_mapping=slot_mapping))
    _kv_cache_append(k, v, k_cache, v_cache, kw.pop("slot_mapping"), **kw)


def _kva_ref(k, v, k_cache, v_cache, slot_mapping, **kw):
    from ..reference.kv_cache_append import kv_cache_append_ref
    kw = _kva_args(dict(kw, slot_mapping=slot_mapping))
    nk, nv = kv_cache_append_ref(k, v, k_cache, v_cache, kw.pop("slot_mapping"), **kw)
    np.copyto(k_cache, nk)
    np.copyto(v_cache, nv)


def _kva_fake(k, v, k_cache, v_cache, slot_mapping, **kw):
    return None


def _merge_ref(o_a, lse_a, o_b, lse_b):
    from ..reference.merge_attention_states import merge_attention_states_ref
    return merge_attention_states_ref(o_a, lse_a, o_b, lse_b)


def _merge_fake(o_a, lse_a, o_b, lse_b):
    return _empty(o_a.shape, o_a.dtype, o_a), _empty(lse_a.shape, torch.float32, o_a)


# -------------------------------------------------------------------------------- mla_decode
def _mla_scale(kv_scale, kv_token_scale):
    """The op's ``kv_scale``: the per-tensor float, or the per-token tensor (as NumPy)."""
    if kv_token_scale is None:
        return None if kv_scale is None else float(kv_scale)
    if kv_scale is not None:
        raise ValueError("mla_decode: pass kv_scale (per tensor) or kv_token_scale (per token), "
                         "not both")
    return _py(kv_token_scale)


def _mla_kernel(q_nope, q_rope, kv_cache, seq_lens, scale, block_table=None, kv_scale=None,
                lnc=1, kv_token_scale=None):
    return _mla_decode(q_nope, q_rope, kv_cache, _py(seq_lens), block_table=_py(block_table),
                       scale=float(scale), kv_scale=_mla_scale(kv_scale, kv_token_scale),
                       return_lse=True, lnc=lnc)


def _mla_ref(q_nope, q_rope, kv_cache, seq_lens, scale, block_table=None, kv_scale=None,
             lnc=1, kv_token_scale=None):
    from ..reference.mla_decode import mla_decode_ref
    return mla_decode_ref(q_nope, q_rope, kv_cache, _py(seq_lens), block_table=_py(block_table),
                          scale=float(scale), kv_scale=_mla_scale(kv_scale, kv_token_scale),
                          out_dtype=np.asarray(q_nope).dtype.name)


def _mla_fake(q_nope, q_rope, kv_cache, seq_lens, scale, block_table=None, kv_scale=None, lnc=1,
              kv_token_scale=None):
    return _empty(q_nope.shape, q_nope.dtype, q_nope), \
        _empty(q_nope.shape[:3], torch.float32, q_nope)


# ------------------------------------------------------------------------------------- MoE
def _router_kernel(logits, top_k, **kw):
    return _router_topk(logits, top_k, **kw)


def _router_ref(logits, top_k, **kw):
    from ..reference.router_topk import router_topk_ref
    return router_topk_ref(logits, top_k, **kw)


def _router_fake(logits, top_k, **kw):
    T = logits.shape[0]
    return _empty((T, top_k), torch.float32, logits), _empty((T, top_k), torch.int32, logits)


def _moe_args(kw):
    sg, sd = kw.pop("shared_w_gate_up"), kw.pop("shared_w_down")
    ssg, ssd = kw.pop("shared_gate_up_scale"), kw.pop("shared_down_scale")
    if (sg is None) != (sd is None):
        raise ValueError("fused_moe: shared_w_gate_up and shared_w_down must be given together")
    kw["shared"] = None if sg is None else (sg, sd)
    kw["shared_scales"] = None if ssg is None else (ssg, ssd)
    kw["topk_ids"] = _py(kw["topk_ids"])
    kw["topk_weights"] = _py(kw["topk_weights"])
    return kw


def _moe_kernel(**kw):
    return _fused_moe(**_moe_args(kw))


def _moe_ref(**kw):
    from ..reference.fused_moe import fused_moe_ref
    kw = _moe_args(kw)
    if np.ndim(kw["w_gate_up"]) == 5:
        return NotImplemented          # tile-major experts: the reference takes [E, H, 2I]
    kw.pop("num_global_experts")
    kw.pop("regime")
    fp8 = np.dtype(kw["w_gate_up"].dtype).itemsize == 1
    return fused_moe_ref(act_dtype=kw["w_gate_up"].dtype if fp8 else None, **kw)


def _moe_fake(x, **kw):
    return _empty(x.shape, torch.bfloat16, x)


def _tile_experts_fake(w):
    E, K, N = w.shape
    KT = K // 128
    return _empty((E, N // 128, 128, KT + KT % 2, 128), w.dtype, w)


def _like_fp8(arg_names):
    """A uint8 tensor in these args carries Trn2's float8_e4m3 (torch has no such dtype)."""
    return lambda: {n: "float8_e4m3" for n in arg_names}


# ------------------------------------------------------------------------------------ table
OPS: dict[str, OpDef] = {}


def _add(op: OpDef):
    OPS[op.name] = op


_add(OpDef("matmul", "(Tensor a, Tensor b, ScalarType? out_dtype=None, int lnc=1) -> Tensor",
           _matmul_kernel, _matmul_fake, _matmul_ref, numpy_like=_like_fp8(("a", "b"))))
_FA_SIG = ("(Tensor q, Tensor k, Tensor v, bool causal=True, float? scale=None, int? window=None, "
           "float? softcap=None, Tensor? sinks=None, str k_layout='bhsd', int lnc=1)")
_add(OpDef("flash_attention", _FA_SIG + " -> Tensor", _fa_kernel, _fa_fake, _fa_ref))
_add(OpDef("flash_attention_lse", _FA_SIG + " -> (Tensor, Tensor)",
           functools.partial(_fa_kernel, return_lse=True), _fa_lse_fake,
           functools.partial(_fa_ref, return_lse=True)))
_add(OpDef("qkv_proj", _QKV_SCHEMA, _qkv_kernel, _qkv_fake, _qkv_ref))
_add(OpDef("swiglu_mlp", "(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, "
           "Tensor? norm_weight=None, float eps=1e-06, Tensor? residual=None, "
           "Tensor? gate_scale=None, Tensor? up_scale=None, Tensor? down_scale=None) -> Tensor",
           _mlp_kernel, _mlp_fake, _mlp_ref,
           numpy_like=_like_fp8(("w_gate", "w_up", "w_down"))))
_add(OpDef("tile_weight", "(Tensor w) -> Tensor", _tile_weight, _tile_fake, _tile_weight))
_add(OpDef("rmsnorm_quant", "(Tensor x, Tensor gamma, Tensor? residual=None, float eps=1e-06, "
           "str? fp8_dtype=None, float? static_scale=None, int lnc=1) -> (Tensor, Tensor, Tensor)",
           _rq_kernel, _rq_fake, _rq_ref))
_add(OpDef("rmsnorm_quant_mx", "(Tensor x, Tensor gamma, Tensor? residual=None, "
           "float eps=1e-06, str mx_fmt='e4m3fn', int lnc=1) -> (Tensor, Tensor, Tensor)",
           _rq_mx_kernel, _rq_mx_fake, _rq_mx_ref))
_add(OpDef("mxfp8_matmul", "(Tensor a, Tensor b, Tensor? a_scale=None, Tensor? b_scale=None, "
           "int? k=None, str a_fmt='e4m3fn', str b_fmt='e4m3fn', str fmt='e4m3fn', "
           "ScalarType? out_dtype=None, int lnc=1) -> Tensor", _mx_kernel, _mx_fake, _mx_ref))
_add(OpDef("quantize_weights_mx", "(Tensor w, str fmt='e4m3fn') -> (Tensor, Tensor)",
           _qmx_kernel, _qmx_fake, _qmx_kernel))

_DA_SIG = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_lens, Tensor? block_table=None, "
           "float? scale=None, int? window=None, float? softcap=None, Tensor? sinks=None, "
           "Tensor? k_scale=None, Tensor? v_scale=None, int lnc=1)")
_KV_FP8 = _like_fp8(("k_cache", "v_cache"))
_add(OpDef("decode_attention", _DA_SIG + " -> Tensor", _da_kernel, _da_fake, _da_ref,
           numpy_like=_KV_FP8))
_add(OpDef("decode_attention_lse", _DA_SIG + " -> (Tensor, Tensor)",
           functools.partial(_da_kernel, return_lse=True), _da_lse_fake,
           functools.partial(_da_ref, return_lse=True), numpy_like=_KV_FP8))
_PA_SIG = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
           "Tensor query_start_loc, float? scale=None, int? window=None, float? softcap=None, "
           "Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None, int lnc=1)")
_add(OpDef("paged_attention", _PA_SIG + " -> Tensor", _pa_kernel, _pa_fake, _pa_ref,
           numpy_like=_KV_FP8))
_add(OpDef("paged_attention_lse", _PA_SIG + " -> (Tensor, Tensor)",
           functools.partial(_pa_kernel, return_lse=True), _pa_lse_fake,
           functools.partial(_pa_ref, return_lse=True), numpy_like=_KV_FP8))
_add(OpDef("kv_cache_append", "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
           "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
           _kva_kernel, _kva_fake, _kva_ref, mutates=("k_cache", "v_cache"), numpy_like=_KV_FP8))
_add(OpDef("merge_attention_states", "(Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b) -> "
           "(Tensor, Tensor)", _merge_states, _merge_fake, _merge_ref))
_add(OpDef("mla_decode", "(Tensor q_nope, Tensor q_rope, Tensor kv_cache, Tensor seq_lens, "
           "float scale, Tensor? block_table=None, float? kv_scale=None, int lnc=1, "
           "Tensor? kv_token_scale=None) -> (Tensor, Tensor)", _mla_kernel, _mla_fake, _mla_ref,
           numpy_like=_like_fp8(("kv_cache",))))
_add(OpDef("router_topk", "(Tensor logits, int top_k, str scoring='softmax', "
           "bool renormalize=True, int? n_groups=None, int? topk_groups=None, "
           "Tensor? correction_bias=None, float routed_scaling=1.0) -> (Tensor, Tensor)",
           _router_kernel, _router_fake, _router_ref))
_add(OpDef("fused_moe", "(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor topk_weights, "
           "Tensor topk_ids, Tensor? shared_w_gate_up=None, Tensor? shared_w_down=None, "
           "Tensor? gate_up_scale=None, Tensor? down_scale=None, "
           "Tensor? shared_gate_up_scale=None, Tensor? shared_down_scale=None, "
           "int expert_offset=0, int? num_global_experts=None, str? regime=None) -> Tensor",
           _moe_kernel, _moe_fake, _moe_ref,
           numpy_like=_like_fp8(("w_gate_up", "w_down", "shared_w_gate_up", "shared_w_down"))))
_add(OpDef("tile_expert_weights", "(Tensor w) -> Tensor", _tile_expert_weights,
           _tile_experts_fake, _tile_expert_weights))


# ------------------------------------------------------------------------------- dispatch
def _bind(schema, args, kwargs):
    out = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            raise TypeError(f"nki_kernels::{schema.name}: missing argument {a.name!r}")
    return out


def _to_torch_out(res):
    if isinstance(res, (tuple, list)):
        return tuple(to_torch(r) for r in res)
    return to_torch(res)


def _run_cpu(op: OpDef, schema, *args, **kwargs):
    kw = _bind(schema, args, kwargs)
    like = op.numpy_like() if op.numpy_like else {}
    np_kw = {n: (to_numpy(v, like.get(n)) if isinstance(v, torch.Tensor) else v)
             for n, v in kw.items()}
    res = NotImplemented
    if op.reference is not None and current_implementation() == "reference":
        res = op.reference(**np_kw)
    if res is NotImplemented:
        res = op.kernel(**np_kw)
    return _to_torch_out(res)


def _neuron_ready(opname):
    try:
        import torch_neuronx  # noqa: F401
    except ImportError as e:
        raise NeuronUnavailable(
            f"nki_kernels::{opname}: got XLA (Neuron) tensors, but torch-neuronx is not "
            f"importable ({e}). Install the Neuron SDK from the AWS Neuron package repository "
            f"(pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
            f"torch-neuronx), or move the tensors to the CPU to run the emulator.") from None
    if backend.is_emulated():
        raise NeuronUnavailable(
            f"nki_kernels::{opname}: got XLA (Neuron) tensors, but the NKI backend is the "
            f"emulator (NKI_KERNELS_BACKEND={os.environ.get('NKI_KERNELS_BACKEND', '')!r}, real "
            f"`nki` importable: {backend._real_nki() is not None}); the real kernel needs the "
            f"`nki` package of the Neuron SDK.")


def _run_xla(op: OpDef, schema, *args, **kwargs):
    """On a trn instance: the public op with the XLA tensors as they are. ``nki.jit`` kernels
    accept torch-xla tensors under torch-neuronx and run as custom calls on the device; the
    host-side checks read only shapes and dtypes (small tables such as RoPE positions are
    moved to the host first)."""
    _neuron_ready(op.name)
    res = op.kernel(**_bind(schema, args, kwargs))
    if isinstance(res, (tuple, list)):
        return tuple(r if isinstance(r, torch.Tensor) else torch.as_tensor(r) for r in res)
    return res


def _run_fake(op: OpDef, schema, *args, **kwargs):
    return op.fake(**_bind(schema, args, kwargs))


def _no_backward(ctx, *grads):
    raise RuntimeError("nki_kernels torch ops are inference-only (no backward); run the model "
                       "under torch.no_grad() or torch.inference_mode()")


_LIB = torch.library.Library(NAMESPACE, "DEF")


def register(op: OpDef):
    """Define ``torch.ops.nki_kernels.<op.name>`` with its CPU, XLA, fake and autograd parts."""
    qual = f"{NAMESPACE}::{op.name}"
    _LIB.define(op.name + op.schema)
    schema = getattr(torch.ops.nki_kernels, op.name).default._schema
    _LIB.impl(op.name, functools.partial(_run_cpu, op, schema), "CPU")
    _LIB.impl(op.name, functools.partial(_run_xla, op, schema), "XLA")
    torch.library.register_fake(qual, functools.partial(_run_fake, op, schema), lib=_LIB)
    if not op.mutates:
        torch.library.register_autograd(qual, _no_backward, lib=_LIB)


for _op in OPS.values():
    register(_op)
