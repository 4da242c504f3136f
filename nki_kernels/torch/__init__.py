"""nki-kernels from PyTorch: ``torch.library`` ops, transformers integration.

The only part of nki-kernels that imports torch. Importing it registers every public op as
``torch.ops.nki_kernels.<name>`` (with fake implementations for ``torch.compile``); the functions
here are thin wrappers with the NumPy API's keyword arguments and return types. ``docs/torch.md``
lists the schemas and what runs where.

    import nki_kernels.torch as nkt
    o = nkt.flash_attention(q, k, v, causal=True)          # CPU tensors: the emulated kernel
    with nkt.implementation("reference"):                   # or NKI_KERNELS_TORCH_IMPL=reference
        o = nkt.flash_attention(q, k, v)                     # the NumPy reference (fast)

transformers (imported on first use): :func:`register_attention` (``attn_implementation=
"nki_kernels"``) and :func:`apply_nki_kernels` (fused decoder blocks for Llama and Qwen3).
"""
from __future__ import annotations

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("nki_kernels.torch needs PyTorch: `pip install torch==2.13.0` (CPU build), "
                      "then `pip install -e '.[torch]'`") from e

from ..dense.qkv_proj import QKVOutput
from ..quant.mxfp8_matmul import MXTensor
from .ops import (
    IMPL_ENV,
    OPS,
    NeuronUnavailable,
    OpDef,
    current_implementation,
    implementation,
    register,
)

_ops = torch.ops.nki_kernels


def matmul(a, b, *, out_dtype=None, lnc=1):
    """``a [M, K] @ b [K, N]``; out_dtype a torch dtype (bfloat16 / float32) or None."""
    return _ops.matmul(a, b, out_dtype, lnc)


def flash_attention(q, k, v, *, causal=True, scale=None, window=None, softcap=None, sinks=None,
                    return_lse=False, layout="bhsd", k_layout="bhsd", lnc=1):
    """Prefill attention. ``layout="bhsd"``: q [B, H_q, S_q, d], k/v [B, H_kv, S_kv, d], o like q
    (the kernel's layout); ``layout="bshd"``: all four [B, S, H, d] (flash-attn's, and the
    projection output before transformers' transpose): views are passed, the one copy is the
    kernel's [B, H, S, d] load. Returns o (and lse [B, H_q, S_q] float32)."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"flash_attention: layout must be 'bhsd' or 'bshd'; got {layout!r}")
    if layout == "bshd":
        if k_layout != "bhsd":
            raise ValueError("flash_attention: k_layout='bhds' needs layout='bhsd'")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    args = (q, k, v, causal, scale, window, softcap, sinks, k_layout, lnc)
    if return_lse:
        o, lse = _ops.flash_attention_lse(*args)
    else:
        o, lse = _ops.flash_attention(*args), None
    if layout == "bshd":
        o = o.transpose(1, 2)
    return (o, lse) if return_lse else o


def qkv_proj(x, w_qkv, *, n_q_heads, n_kv_heads, head_dim, bias=None, residual=None,
             norm_weight=None, eps=1e-6, q_norm_weight=None, k_norm_weight=None,
             qk_norm_eps=None, positions=None, rope_theta=10000.0, cos=None, sin=None,
             rotary_dim=None, rope_layout="half", k_layout="heads") -> QKVOutput:
    """Fused RMSNorm + QKV + QK-norm + RoPE; q [n_q, T, d], k/v [n_kv, T, d] (QKVOutput)."""
    q, k, v, h = _ops.qkv_proj(x, w_qkv, n_q_heads, n_kv_heads, head_dim, bias, residual,
                               norm_weight, eps, q_norm_weight, k_norm_weight, qk_norm_eps,
                               positions, float(rope_theta), cos, sin, rotary_dim, rope_layout,
                               k_layout)
    return QKVOutput(q, k, v, h if residual is not None else None)


def swiglu_mlp(x, w_gate, w_up, w_down, *, norm_weight=None, eps=1e-6, residual=None,
               gate_scale=None, up_scale=None, down_scale=None):
    """``residual + (silu(xn W_gate) * (xn W_up)) W_down``, x [T, H] bf16 -> [T, H] bf16."""
    return _ops.swiglu_mlp(x, w_gate, w_up, w_down, norm_weight, eps, residual, gate_scale,
                           up_scale, down_scale)


def tile_weight(w):
    """The tile-major layout swiglu_mlp streams fastest (once, at load time)."""
    return _ops.tile_weight(w)


def rmsnorm_quant(x, gamma, *, residual=None, eps=1e-6, quant="fp8", fp8_dtype=None,
                  static_scale=None, mx_fmt="e4m3fn", lnc=1):
    """RMSNorm + FP8 per-token (``(q, scale)``) or MXFP8 (an MXTensor) quantization; with a
    residual, the updated residual is the last element of the returned tuple."""
    if quant == "mx":
        if fp8_dtype is not None or static_scale is not None:
            raise ValueError("rmsnorm_quant: fp8_dtype and static_scale apply to quant='fp8' only")
        data, scale, h = _ops.rmsnorm_quant_mx(x, gamma, residual, eps, mx_fmt, lnc)
        mx = MXTensor(data, scale, mx_fmt, int(x.shape[1]))
        return (mx, h) if residual is not None else mx
    if quant != "fp8":
        raise ValueError(f"rmsnorm_quant: quant must be 'fp8' or 'mx'; got {quant!r}")
    q, s, h = _ops.rmsnorm_quant(x, gamma, residual, eps, fp8_dtype,
                                 None if static_scale is None else float(static_scale), lnc)
    return (q, s, h) if residual is not None else (q, s)


def mxfp8_matmul(a, b, *, out_dtype=torch.bfloat16, fmt="e4m3fn", lnc=1):
    """``a @ b`` with MXFP8 operands (Trn3); a, b bf16 tensors or MXTensors of torch tensors."""
    if isinstance(out_dtype, str):
        out_dtype = getattr(torch, out_dtype)
    a_mx, b_mx = isinstance(a, MXTensor), isinstance(b, MXTensor)
    if a_mx and b_mx and int(a.k) != int(b.k):
        raise ValueError(f"mxfp8_matmul: the contraction lengths differ: a has K={a.k}, b has "
                         f"K={b.k}")
    k = a.k if a_mx else (b.k if b_mx else None)
    return _ops.mxfp8_matmul(a.data if a_mx else a, b.data if b_mx else b,
                             a.scale if a_mx else None, b.scale if b_mx else None,
                             None if k is None else int(k), a.fmt if a_mx else fmt,
                             b.fmt if b_mx else fmt, fmt, out_dtype, lnc)


def quantize_weights_mx(w, fmt="e4m3fn") -> MXTensor:
    """Offline MXFP8 quantization of a weight ``w [K, N]`` (an MXTensor of torch tensors)."""
    data, scale = _ops.quantize_weights_mx(w, fmt)
    return MXTensor(data, scale, fmt, int(w.shape[0]))


def decode_attention(q, k_cache, v_cache, seq_lens, *, block_table=None, scale=None, window=None,
                     softcap=None, sinks=None, k_scale=None, v_scale=None, return_lse=False,
                     lnc=1):
    """Decode attention: q [B, s_q, H_q, d], caches [B, S_max, H_kv, d] or paged with
    block_table; seq_lens host ints [B]. Returns o [B, s_q, H_q, d] (and lse [B, s_q, H_q])."""
    seq_lens = torch.as_tensor(seq_lens)
    k_scale, v_scale = (None if s is None else torch.as_tensor(s, dtype=torch.float32)
                        for s in (k_scale, v_scale))
    args = (q, k_cache, v_cache, seq_lens, block_table, scale, window, softcap, sinks, k_scale,
            v_scale, lnc)
    return _ops.decode_attention_lse(*args) if return_lse else _ops.decode_attention(*args)


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, *, scale=None,
                    window=None, softcap=None, sinks=None, k_scale=None, v_scale=None,
                    return_lse=False, lnc=1):
    """Paged attention of a ragged serving batch: q [T, H_q, d], caches [num_blocks,
    block_size, H_kv, d], block_table [R, max_blocks], seq_lens [R], query_start_loc [R + 1]
    (host ints). Returns o [T, H_q, d] (and lse [T, H_q]). The plan of a step is made once
    and reused while seq_lens / query_start_loc stay the same (the layers of one step)."""
    seq_lens, query_start_loc = torch.as_tensor(seq_lens), torch.as_tensor(query_start_loc)
    block_table = torch.as_tensor(block_table)
    k_scale, v_scale = (None if s is None else torch.as_tensor(s, dtype=torch.float32)
                        for s in (k_scale, v_scale))
    args = (q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, window, softcap,
            sinks, k_scale, v_scale, lnc)
    return _ops.paged_attention_lse(*args) if return_lse else _ops.paged_attention(*args)


def kv_cache_append(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Write the new tokens' K/V (k, v [T, H_kv, d]) into their slots of the paged caches
    [num_blocks, block_size, H_kv, d] in place (slot_mapping [T], -1 skips a token; FP8 caches
    with k_scale / v_scale). Returns (k_cache, v_cache), the same tensors."""
    slot_mapping = torch.as_tensor(slot_mapping)
    k_scale, v_scale = (None if s is None else torch.as_tensor(s, dtype=torch.float32)
                        for s in (k_scale, v_scale))
    _ops.kv_cache_append(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return k_cache, v_cache


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention results over disjoint key sets: ``(o, lse)``."""
    return _ops.merge_attention_states(o_a, lse_a, o_b, lse_b)


def router_topk(logits, top_k, *, scoring="softmax", renormalize=True, n_groups=None,
                topk_groups=None, correction_bias=None, routed_scaling=1.0):
    """Router scores and top-k: ``(weights [T, k] float32, ids [T, k] int32)``."""
    return _ops.router_topk(logits, top_k, scoring, renormalize, n_groups, topk_groups,
                            correction_bias, float(routed_scaling))


def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *, shared=None, gate_up_scale=None,
              down_scale=None, shared_scales=None, expert_offset=0, num_global_experts=None,
              regime=None):
    """Routed SwiGLU experts (+ optional shared expert): y [T, H] bf16."""
    sg, sd = shared if shared is not None else (None, None)
    ssg, ssd = shared_scales if shared_scales is not None else (None, None)
    return _ops.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, sg, sd, gate_up_scale,
                          down_scale, ssg, ssd, expert_offset, num_global_experts, regime)


def tile_expert_weights(w):
    """Expert weights [E, K, N] in the tile-major layout fused_moe streams fastest."""
    return _ops.tile_expert_weights(w)


def __getattr__(name):
    # the transformers integration imports transformers: only on first use
    if name in ("apply_nki_kernels", "register_attention", "nki_attention", "PatchReport"):
        from . import hf
        return getattr(hf, name)
    raise AttributeError(f"module 'nki_kernels.torch' has no attribute {name!r}")


__all__ = ["OPS", "OpDef", "register", "implementation", "current_implementation", "IMPL_ENV",
           "NeuronUnavailable", "matmul", "flash_attention", "qkv_proj", "swiglu_mlp",
           "tile_weight", "rmsnorm_quant", "mxfp8_matmul", "quantize_weights_mx", "QKVOutput",
           "decode_attention", "paged_attention", "merge_attention_states", "router_topk", "fused_moe",
           "tile_expert_weights", "kv_cache_append",
           "MXTensor", "apply_nki_kernels", "register_attention", "nki_attention", "PatchReport"]
