"""NumPy reference for ``nki_kernels.attention.mla_decode`` (multi-head latent attention, decode).

MLA (DeepSeek-V2/V3) caches per token one latent row ``[c_kv (kv_lora_rank) | k_rope (rope)]``:
``c_kv = x W_DKV`` (the compressed KV) and ``k_rope = RoPE(x W_KR)`` (one decoupled RoPE key
shared by every head). Per head ``h`` the keys and values are up-projected from the latent:

* unabsorbed: ``k_h = [c_kv W_UK_h | k_rope]``, ``v_h = c_kv W_UV_h``, ``q_h = [q_nope_h |
  q_rope_h]``; ``s = scale * q_h . k_h``; ``o_h = softmax(s) v_h`` (width v_head_dim);
* absorbed (what the kernel computes): ``q_lat_h = W_UK_h q_nope_h`` (width kv_lora_rank), so
  ``q_nope_h . (c_kv W_UK_h) = q_lat_h . c_kv``; scores ``scale * (q_lat_h . c_kv + q_rope_h .
  k_rope)``; ``o_lat_h = softmax(s) c_kv``; the caller applies W_UV: ``o_h = o_lat_h W_UV_h``.

Weights are stored as ``w_uk, w_uv [H, kv_lora_rank, head_dim]`` (``k_nope_h = c_kv @ w_uk[h]``,
``v_h = c_kv @ w_uv[h]``: the two halves of DeepSeek's ``kv_b_proj`` per head).

Layouts: ``q [B, s_q, H, .]`` (query ``i`` of sequence ``b`` sits at ``pos = seq_lens[b] - s_q +
i`` and sees keys ``j <= pos``); contiguous cache ``[B, S_max, 576]`` or paged ``[num_blocks,
block_size, 576]`` with ``block_table [B, max_blocks]`` (only the ``ceil(L / block_size)`` pages
a sequence uses are touched). FP8 caches dequantize as ``float(c) * kv_scale``, with
``kv_scale`` a scalar (per tensor) or one scale per cache slot (per token: ``[B, S_max]``
contiguous, ``[num_blocks, block_size]`` paged; row ``t`` of a sequence uses the scale of the
slot it is stored in). A sequence of length 0 gives output 0 and ``lse = -inf``.
``p_dtype="bfloat16"`` rounds the probabilities that multiply V and ``dequant_dtype="bfloat16"``
the dequantized latent rows (the kernel's per-token path works on bf16 tiles): the
same-precision reference of the attention accuracy rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .decode_attention import gather_kv  # [L, 576] latent rows: the paged gather of decode

BF16 = ml_dtypes.bfloat16


def token_scales(kv_scale, b, L, block_table=None):
    """The dequantization scales of sequence ``b``'s first ``L`` latent rows, float32 ``[L]``:
    a scalar (or None = 1) repeated, or per token the scales of the slots the rows are stored
    in (``kv_scale[b, :L]`` contiguous; ``kv_scale[block_table[b, j // bs], j % bs]`` paged)."""
    ks = np.asarray(1.0 if kv_scale is None else kv_scale, dtype=np.float32)
    if ks.ndim < 2:
        return np.full(L, float(ks.reshape(-1)[0]), dtype=np.float32)
    if block_table is None:
        return ks[b, :L].copy()
    bs = ks.shape[1]
    j = np.arange(L)
    return ks[np.asarray(block_table)[b, j // bs], j % bs]


def _dequant(kv_cache, b, L, block_table, kv_scale, ct, dequant_dtype=None):
    """Sequence ``b``'s latent rows ``[L, 576]`` times their scales, in ``ct``; rounded to bf16
    first with ``dequant_dtype="bfloat16"`` (float32 product, then bf16)."""
    c = gather_kv(kv_cache, b, L, block_table).astype(np.float32)
    s = token_scales(kv_scale, b, L, block_table)
    if dequant_dtype == "bfloat16":
        return (c * s[:, None]).astype(BF16).astype(ct)
    return c.astype(ct) * s.astype(ct)[:, None]


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-style MLA dimensions (DeepSeek-V3: 128 heads, 512 / 64 / 128 / 128)."""
    hidden: int = 256
    heads: int = 4
    kv_lora_rank: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(qk head dim) (DeepSeek multiplies it by the YaRN mscale^2)."""
        return float((self.nope_dim + self.rope_dim) ** -0.5)


def random_weights(cfg: MLAConfig, rng):
    """Random W_DKV [hidden, rank], W_KR [hidden, rope], W_UK, W_UV [H, rank, nope / v], with
    roughly unit-variance outputs."""
    f = np.float32
    w_dkv = (rng.standard_normal((cfg.hidden, cfg.kv_lora_rank)) / np.sqrt(cfg.hidden)).astype(f)
    w_kr = (rng.standard_normal((cfg.hidden, cfg.rope_dim)) / np.sqrt(cfg.hidden)).astype(f)
    w_uk = (rng.standard_normal((cfg.heads, cfg.kv_lora_rank, cfg.nope_dim))
            / np.sqrt(cfg.kv_lora_rank)).astype(f)
    w_uv = (rng.standard_normal((cfg.heads, cfg.kv_lora_rank, cfg.v_dim))
            / np.sqrt(cfg.kv_lora_rank)).astype(f)
    return w_dkv, w_kr, w_uk, w_uv


def rope(x, pos, theta=10_000.0):
    """Rotary embedding of ``x [..., n, r]`` (r even, interleaved pairs) at positions ``pos [n]``."""
    x = np.asarray(x, dtype=np.float64)
    r = x.shape[-1]
    inv = theta ** (-np.arange(0, r, 2) / r)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None, :]      # [n, r/2]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def latent_rows(x, w_dkv, w_kr, pos):
    """Cache rows of hidden states ``x [n, hidden]`` at positions ``pos``: ``[c_kv | RoPE(x
    W_KR)]``, float32 ``[n, rank + rope]``."""
    x = np.asarray(x, dtype=np.float64)
    c = x @ np.asarray(w_dkv, dtype=np.float64)
    kr = rope(x @ np.asarray(w_kr, dtype=np.float64), pos)
    return np.concatenate([c, kr], axis=-1).astype(np.float32)


def absorb_q(q_nope_heads, w_uk):
    """``q_lat[b, i, h] = W_UK_h q_nope_h``: ``[B, s_q, H, nope] -> [B, s_q, H, rank]`` float32."""
    return np.einsum("bshn,hln->bshl", np.asarray(q_nope_heads, dtype=np.float64),
                     np.asarray(w_uk, dtype=np.float64)).astype(np.float32)


def apply_w_uv(o_lat, w_uv):
    """``o_h = o_lat_h W_UV_h``: ``[B, s_q, H, rank] -> [B, s_q, H, v]`` float64."""
    return np.einsum("bshl,hlv->bshv", np.asarray(o_lat, dtype=np.float64),
                     np.asarray(w_uv, dtype=np.float64))


def _softmax_rows(s, p_dtype):
    """``(p used for V / denominator, lse)`` of logits ``s [..., L]`` (masked = -inf)."""
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    pn = e.astype(BF16).astype(s.dtype) if p_dtype == "bfloat16" else e
    lse = (m + np.log(den))[..., 0]
    return pn / den, lse


def mla_decode_ref(q_nope, q_rope, kv_cache, seq_lens, *, block_table=None, scale,
                   kv_scale=None, rank=512, compute_dtype=np.float32, p_dtype=None,
                   out_dtype=None, dequant_dtype=None):
    """Absorbed MLA decode: ``o_lat [B, s_q, H, rank]`` (compute dtype, or rounded to
    ``out_dtype`` -- "bfloat16" like the kernel's output) and ``lse [B, s_q, H]``.

    ``q_nope [B, s_q, H, rank]`` (W_UK absorbed), ``q_rope [B, s_q, H, rope]``, latent cache
    rows ``[c_kv (rank) | k_rope]``."""
    ct = compute_dtype
    B, s_q, H, _ = np.shape(q_nope)
    qn = np.asarray(q_nope).astype(ct)
    qr = np.asarray(q_rope).astype(ct)
    o = np.zeros((B, s_q, H, rank), dtype=ct)
    lse = np.full((B, s_q, H), -np.inf, dtype=np.float32)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        c = _dequant(kv_cache, b, L, block_table, kv_scale, ct, dequant_dtype)  # [L, 576]
        s = (np.einsum("shl,jl->shj", qn[b], c[:, :rank])
             + np.einsum("shr,jr->shj", qr[b], c[:, rank:])) * ct(scale)          # [s_q, H, L]
        pos = L - s_q + np.arange(s_q)
        s = np.where(np.arange(L)[None, None, :] <= pos[:, None, None], s, -np.inf)
        p, ls = _softmax_rows(s, p_dtype)
        o[b] = np.einsum("shj,jl->shl", p, c[:, :rank])
        lse[b] = ls
    if out_dtype == "bfloat16":
        o = o.astype(BF16)
    return o, lse


def mla_unabsorbed_ref(q_nope_heads, q_rope, kv_cache, seq_lens, w_uk, w_uv, *, block_table=None,
                       scale, kv_scale=None):
    """MLA decode the unabsorbed way (per-head keys and values up-projected from the latent),
    float64: ``o [B, s_q, H, v_dim]`` and ``lse [B, s_q, H]``. ``q_nope_heads [B, s_q, H, nope]``
    in head space (not absorbed)."""
    f = np.float64
    w_uk, w_uv = np.asarray(w_uk, dtype=f), np.asarray(w_uv, dtype=f)
    H, rank, _ = w_uk.shape
    B, s_q = np.shape(q_nope_heads)[:2]
    qn = np.asarray(q_nope_heads).astype(f)
    qr = np.asarray(q_rope).astype(f)
    o = np.zeros((B, s_q, H, w_uv.shape[2]), dtype=f)
    lse = np.full((B, s_q, H), -np.inf, dtype=np.float32)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        c = _dequant(kv_cache, b, L, block_table, kv_scale, f)
        k_nope = np.einsum("jl,hln->hjn", c[:, :rank], w_uk)                     # [H, L, nope]
        v = np.einsum("jl,hlv->hjv", c[:, :rank], w_uv)                          # [H, L, v]
        s = (np.einsum("shn,hjn->shj", qn[b], k_nope)
             + np.einsum("shr,jr->shj", qr[b], c[:, rank:])) * scale
        pos = L - s_q + np.arange(s_q)
        s = np.where(np.arange(L)[None, None, :] <= pos[:, None, None], s, -np.inf)
        p, ls = _softmax_rows(s, None)
        o[b] = np.einsum("shj,hjv->shv", p, v)
        lse[b] = ls
    return o, lse


def flops_mla_decode(lens, s_q: int, heads: int, rank: int = 512, rope: int = 64) -> float:
    """Matmul FLOPs of the absorbed form: ``2 s_q H L (rank + rope)`` for QK^T and ``2 s_q H L
    rank`` for PV per sequence (all L keys; the drafts' masked corner is negligible)."""
    return float(sum(2.0 * s_q * heads * int(L) * (2 * rank + rope) for L in lens))


def bytes_mla_decode(lens, s_q: int, heads: int, cache_itemsize: int, rank: int = 512,
                     rope: int = 64, token_scale_bytes: int = 0) -> float:
    """Compulsory HBM bytes: each valid latent row read once (``(rank + rope) x itemsize``, plus
    ``token_scale_bytes`` of its per-token FP8 scale: 4 for fp32), q (bf16 nope + rope) and o
    (bf16, rank wide) of every sequence."""
    tokens = sum(int(L) for L in lens)
    B = len(lens)
    return float(tokens * ((rank + rope) * cache_itemsize + token_scale_bytes)
                 + B * s_q * heads * (rank + rope) * 2 + B * s_q * heads * rank * 2)
