"""transformers integration: an attention implementation and fused decoder blocks.

* :func:`register_attention` registers ``"nki_kernels"`` with transformers' ``AttentionInterface``
  (and its mask interface), so ``AutoModelForCausalLM.from_config(cfg,
  attn_implementation="nki_kernels")`` runs :func:`nki_attention`: ``flash_attention`` for prefill
  (S_q = S_kv) and ``decode_attention`` for decode (1 <= S_q <= 8 new tokens over a longer
  cache), with sliding window, soft-capping and sinks passed through. transformers' cache is
  [B, H_kv, S, d] and decode_attention reads [B, S, H_kv, d] (vLLM's layout), so each decode call
  copies K/V into that layout; ``register_attention(decode="flash_attention")`` decodes with
  flash_attention instead, which reads the cache in place (the causal diagonal aligned to the
  end: the last query sees every key). What the kernel cannot express (a padding or
  custom mask, dropout in training, fp32, head_dim outside 64/128/192/256) runs a plain torch
  attention instead: counted in :data:`STATS`, warned once per reason, never silently wrong.
* :func:`apply_nki_kernels` swaps, per decoder layer of a supported architecture (Llama, Qwen3,
  Qwen3-MoE, DeepSeek-V3 without its MLA attention), the ``input_layernorm + q/k/v_proj
  (+ q_norm/k_norm) + RoPE`` front for ``qkv_proj`` and the ``post_attention_layernorm + mlp +
  residual`` back for ``swiglu_mlp`` (a sparse MoE block: its routing and experts, with a shared
  expert, for ``router_topk + fused_moe``); everything else is left alone and listed in the
  returned :class:`PatchReport`.
"""
from __future__ import annotations

import collections
import sys
import types
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "nki_kernels"
HEAD_DIMS_ATTN = (64, 128, 192, 256)
HEAD_DIMS_QKV = (64, 128, 256)
STATS: collections.Counter = collections.Counter()   # kernel calls and fallbacks, by reason
DECODE_KERNELS = ("decode_attention", "flash_attention")
_settings = {"decode": "decode_attention"}
_warned: set = set()
_MAX_DECODE_S_Q = 8

_ops = None


def _torch_ops():
    global _ops
    if _ops is None:
        from . import ops  # noqa: F401 - registers torch.ops.nki_kernels
        _ops = torch.ops.nki_kernels
    return _ops


# ------------------------------------------------------------------------------- attention
def _visible(s_q, s_kv, causal, window, device):
    """[S_q, S_kv] bool, the kernel's mask: end-aligned causal diagonal, window keys incl. it."""
    pos = torch.arange(s_q, device=device)[:, None] + (s_kv - s_q)
    j = torch.arange(s_kv, device=device)[None, :]
    m = torch.ones((s_q, s_kv), dtype=torch.bool, device=device)
    if causal:
        m &= j <= pos
    if window:
        m &= j > pos - window
    return m


def _mask_is_plain(mask, s_q, s_kv, causal, window):
    """True when a 4-D transformers mask says no more than the kernel's own mask."""
    if mask.ndim != 4 or mask.shape[-2:] != (s_q, s_kv):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return bool((allowed == _visible(s_q, s_kv, causal, window, mask.device)).all())


def _fallback(reason):
    STATS[f"fallback: {reason}"] += 1
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"nki_kernels attention: {reason}; this call runs a plain torch attention "
                      f"(correct, not the nki kernel)", stacklevel=3)


def _torch_attention(q, k, v, mask, scale, causal, window, softcap, sinks):
    """Plain fp32 attention for what the kernel cannot express; [B, S_q, H_q, d] out."""
    B, Hq, Sq, d = q.shape
    Skv = k.shape[2]
    rep = Hq // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is None:
        vis = _visible(Sq, Skv, causal, window, q.device)[None, None]
    elif mask.dtype == torch.bool:
        vis = mask
    else:
        s = s + mask.float()
        vis = torch.isfinite(s) & (mask > torch.finfo(mask.dtype).min / 2)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :Skv]
    return (p @ vf).to(q.dtype).transpose(1, 2)


def nki_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers attention function: q [B, H_q, S_q, d], k/v [B, H_kv, S_kv, d] (the cache
    after its update) -> (o [B, S_q, H_q, d], None). o is a view of the kernel's [B, H, S, d]
    output; no K/V copies (GQA reads KV heads in place)."""
    B, Hq, Sq, d = query.shape
    Skv = key.shape[2]
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    scale = float(scaling) if scaling is not None else d ** -0.5
    window = int(sliding_window) if sliding_window else None
    softcap = float(softcap) if softcap else None
    reason = None
    if dropout and module.training:
        reason = "attention dropout in training"
    elif query.dtype not in (torch.bfloat16, torch.float16):
        reason = f"dtype {query.dtype} (the kernel takes bfloat16 / float16)"
    elif d not in HEAD_DIMS_ATTN:
        reason = f"head_dim {d} (the kernel takes {HEAD_DIMS_ATTN})"
    elif value.shape[-1] != d or key.shape[-1] != d:
        reason = "v head_dim differs from q/k head_dim (MLA): no kernel for that yet"
    elif causal and Sq > Skv:
        reason = f"S_q {Sq} > S_kv {Skv}"
    elif attention_mask is not None:
        if torch.compiler.is_compiling():
            reason = "an explicit mask under torch.compile (its values cannot be checked)"
        elif not _mask_is_plain(attention_mask, Sq, Skv, causal, window):
            reason = "a padding or custom attention mask"
    if reason is not None:
        _fallback(reason)
        return _torch_attention(query, key, value, attention_mask, scale, causal, window,
                                softcap, s_aux), None
    ops = _torch_ops()
    if (causal and Sq < Skv and Sq <= _MAX_DECODE_S_Q
            and _settings["decode"] == "decode_attention"):
        STATS["decode_attention"] += 1
        lens = torch.full((B,), Skv, dtype=torch.int32)
        o = ops.decode_attention(query.transpose(1, 2), key.transpose(1, 2),
                                 value.transpose(1, 2), lens, None, scale, window, softcap, s_aux,
                                 None, None, 1)
        return o, None                                   # [B, S_q, H_q, d]
    STATS["flash_attention" if Sq == Skv else "flash_attention (S_q < S_kv)"] += 1
    o = ops.flash_attention(query, key, value, causal, scale, window, softcap, s_aux, "bhsd", 1)
    return o.transpose(1, 2), None


def register_attention(name: str = NAME, *, decode: str | None = None):
    """Register :func:`nki_attention` (and transformers' SDPA mask builder, which gives None for
    a purely causal batch) under ``name``. ``decode``: "decode_attention" (default) or
    "flash_attention", the kernel for S_q < S_kv steps."""
    if decode is not None:
        if decode not in DECODE_KERNELS:
            raise ValueError(f"register_attention: decode must be one of "
                             f"{', '.join(DECODE_KERNELS)}; got {decode!r}")
        _settings["decode"] = decode
    AttentionInterface.register(name, nki_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# -------------------------------------------------------------------------- block patching
# model_type -> class names of the parts that have an exact fused equivalent. RMSNorm classes
# listed compute weight * bf16(x * rsqrt(mean(x^2) + eps)) (Gemma's 1 + weight does not).
ARCHS = {
    "llama": {"attn": ("LlamaAttention",), "mlp": ("LlamaMLP",), "norm": ("LlamaRMSNorm",)},
    "qwen3": {"attn": ("Qwen3Attention",), "mlp": ("Qwen3MLP",), "norm": ("Qwen3RMSNorm",)},
    # sparse layers: the norm and the router GEMM stay stock; router_topk (softmax, top-k,
    # renormalize) + fused_moe replace the routing and the experts
    "qwen3_moe": {"attn": ("Qwen3MoeAttention",), "mlp": ("Qwen3MoeMLP",),
                  "moe": ("Qwen3MoeSparseMoeBlock",), "norm": ("Qwen3MoeRMSNorm",),
                  "router": "softmax"},
    # MLA attention stays stock (no fused MLA projection / mla_decode kernel yet; its attention
    # core still goes through the attention interface); dense layers -> swiglu_mlp, MoE layers ->
    # router_topk (sigmoid, group-limited, correction bias, routed scaling) + fused_moe with the
    # shared expert
    "deepseek_v3": {"attn": (), "mlp": ("DeepseekV3MLP",), "moe": ("DeepseekV3MoE",),
                    "norm": ("DeepseekV3RMSNorm",), "router": "sigmoid",
                    "attn_reason": "MLA attention: no fused MLA projection kernel (mla_decode "
                                   "not landed); stock modules, attention core through the "
                                   "attention interface"},
}

# architectures known and refused, with the reason (everything else: "not supported")
NOT_YET: dict = {}


@dataclass
class PatchReport:
    """What :func:`apply_nki_kernels` did: module path -> kernel, or -> why it stayed stock."""
    model_type: str
    attn_implementation: str | None = None
    patched: dict = field(default_factory=dict)
    unsupported: dict = field(default_factory=dict)

    def __str__(self):
        lines = [f"apply_nki_kernels({self.model_type}): attention implementation "
                 f"{self.attn_implementation!r}"]
        lines += [f"  patched  {k}: {v}" for k, v in self.patched.items()]
        lines += [f"  stock    {k}: {v}" for k, v in self.unsupported.items()]
        return "\n".join(lines)


def _eps(norm):
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _cls(m):
    return type(m).__name__


def _attn_problem(layer, arch):
    attn = getattr(layer, "self_attn", None)
    norm = getattr(layer, "input_layernorm", None)
    if attn is None or _cls(attn) not in arch["attn"]:
        return arch.get("attn_reason", f"attention class {_cls(attn)} has no fused equivalent")
    if norm is None or _cls(norm) not in arch["norm"]:
        return f"input norm {_cls(norm)} has no fused equivalent"
    d = int(attn.head_dim)
    if d not in HEAD_DIMS_QKV:
        return f"head_dim {d}: qkv_proj takes {HEAD_DIMS_QKV}"
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    if any(p.weight.dtype != torch.bfloat16 for p in projs):
        return f"weights are {attn.q_proj.weight.dtype}: qkv_proj takes bfloat16"
    if len({p.bias is None for p in projs}) != 1:
        return "q/k/v_proj biases must be all present or all absent"
    if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
        return "q_norm without k_norm"
    return None


def _moe_problem(layer):
    moe = layer.mlp
    ex, gate = getattr(moe, "experts", None), getattr(moe, "gate", None)
    if ex is None or gate is None or not hasattr(ex, "gate_up_proj"):
        return f"MoE block {_cls(moe)}: expected fused experts (gate_up_proj, down_proj) and a router"
    if not isinstance(ex.act_fn, nn.SiLU) and _cls(ex.act_fn) != "SiLUActivation":
        return f"expert activation {_cls(ex.act_fn)}: fused_moe computes SiLU"
    if ex.gate_up_proj.dtype != torch.bfloat16 or ex.down_proj.dtype != torch.bfloat16:
        return f"expert weights are {ex.gate_up_proj.dtype}: fused_moe takes bfloat16"
    if getattr(ex, "has_bias", False) or getattr(gate, "bias", None) is not None:
        return "expert or router biases: not supported"
    sh = getattr(moe, "shared_experts", None)
    if sh is not None:
        lins = [getattr(sh, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(lin is None or lin.bias is not None or lin.weight.dtype != torch.bfloat16
               for lin in lins):
            return "shared expert: expected bias-free bf16 gate/up/down projections"
    return None


def _mlp_problem(layer, arch):
    mlp = getattr(layer, "mlp", None)
    norm = getattr(layer, "post_attention_layernorm", None)
    if mlp is not None and _cls(mlp) in arch.get("moe", ()):
        if norm is None or _cls(norm) not in arch["norm"]:
            return f"post-attention norm {_cls(norm)} has no fused equivalent"
        return _moe_problem(layer)
    if mlp is None or _cls(mlp) not in arch["mlp"]:
        return f"MLP class {_cls(mlp)} has no fused equivalent (sparse MoE needs fused_moe)"
    if norm is None or _cls(norm) not in arch["norm"]:
        return f"post-attention norm {_cls(norm)} has no fused equivalent"
    if not isinstance(mlp.act_fn, nn.SiLU) and _cls(mlp.act_fn) != "SiLUActivation":
        return f"activation {_cls(mlp.act_fn)}: swiglu_mlp computes SiLU"
    lins = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(p.bias is not None for p in lins):
        return "MLP biases: swiglu_mlp has none"
    if any(p.weight.dtype != torch.bfloat16 for p in lins):
        return f"weights are {mlp.gate_proj.weight.dtype}: swiglu_mlp takes bfloat16"
    return None


def _share(lin, w_t):
    """Make ``lin.weight`` a view of the fused weight (one copy in memory, same state_dict)."""
    lin.weight = nn.Parameter(w_t, requires_grad=lin.weight.requires_grad)


def _fuse_attention(layer):
    attn = layer.self_attn
    w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], 0).detach()
    w_qkv = w_qkv.t().contiguous()                       # [H, (n_q + 2 n_kv) d]: K on partitions
    a = attn.q_proj.out_features
    b = a + attn.k_proj.out_features
    layer.register_buffer("nki_w_qkv", w_qkv, persistent=False)
    for lin, (c0, c1) in ((attn.q_proj, (0, a)), (attn.k_proj, (a, b)),
                          (attn.v_proj, (b, w_qkv.shape[1]))):
        _share(lin, w_qkv[:, c0:c1].t())
    bias = None
    if attn.q_proj.bias is not None:
        bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().float()
    layer.register_buffer("nki_qkv_bias", bias, persistent=False)


def _fuse_mlp(layer):
    mlp = layer.mlp
    for name, lin in (("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)):
        w = lin.weight.detach().t().contiguous()         # [in, out]
        layer.register_buffer(f"nki_w_{name}", w, persistent=False)
        _share(lin, w.t())


def _fuse_moe(layer):
    ex = layer.mlp.experts
    w_gu = ex.gate_up_proj.detach().transpose(1, 2).contiguous()     # [E, H, 2I]: gate | up
    w_d = ex.down_proj.detach().transpose(1, 2).contiguous()         # [E, I, H]
    layer.register_buffer("nki_moe_gate_up", w_gu, persistent=False)
    layer.register_buffer("nki_moe_down", w_d, persistent=False)
    ex.gate_up_proj = nn.Parameter(w_gu.transpose(1, 2), requires_grad=ex.gate_up_proj.requires_grad)
    ex.down_proj = nn.Parameter(w_d.transpose(1, 2), requires_grad=ex.down_proj.requires_grad)
    sh = getattr(layer.mlp, "shared_experts", None)
    s_gu = s_d = None
    if sh is not None:                                               # [H, 2Is] = gate | up
        s_gu = torch.cat([sh.gate_proj.weight, sh.up_proj.weight], 0).detach().t().contiguous()
        s_d = sh.down_proj.weight.detach().t().contiguous()          # [Is, H]
        Is = sh.gate_proj.out_features
        _share(sh.gate_proj, s_gu[:, :Is].t())
        _share(sh.up_proj, s_gu[:, Is:].t())
        _share(sh.down_proj, s_d.t())
    layer.register_buffer("nki_moe_shared_gate_up", s_gu, persistent=False)
    layer.register_buffer("nki_moe_shared_down", s_d, persistent=False)


def _moe_back(layer, h):
    """post_attention_layernorm and the router GEMM (stock), router_topk + fused_moe, residual."""
    B, S, H = h.shape
    gate = layer.mlp.gate
    xn = layer.post_attention_layernorm(h).reshape(B * S, H)
    ops = _torch_ops()
    if hasattr(gate, "e_score_correction_bias"):                     # DeepSeek-V3: fp32 router
        logits = nn.functional.linear(xn.float(), gate.weight.float())
        ng = int(gate.num_group)
        w, ids = ops.router_topk(logits, int(gate.top_k), "sigmoid", bool(gate.norm_topk_prob),
                                 ng if ng > 1 else None, int(gate.topk_group) if ng > 1 else None,
                                 gate.e_score_correction_bias.float(),
                                 float(gate.routed_scaling_factor))
    else:                                                            # softmax router (Qwen3-MoE)
        logits = nn.functional.linear(xn, gate.weight)               # [T, E] as transformers
        w, ids = ops.router_topk(logits, int(gate.top_k), "softmax", bool(gate.norm_topk_prob),
                                 None, None, None, 1.0)
    y = ops.fused_moe(xn, layer.nki_moe_gate_up, layer.nki_moe_down, w, ids,
                      layer.nki_moe_shared_gate_up, layer.nki_moe_shared_down, None, None, None,
                      None, 0, None, None)
    return h + y.view(B, S, H)


def _qkv_front(layer, x, position_embeddings):
    """input_layernorm + q/k/v_proj (+ QK-norm) + RoPE in one qkv_proj: q [B, n_q, S, d],
    k, v [B, n_kv, S, d] (views of the kernel's [heads, B*S, d] outputs)."""
    attn = layer.self_attn
    B, S, H = x.shape
    d = int(attn.head_dim)
    nq = attn.q_proj.out_features // d
    nkv = attn.k_proj.out_features // d
    cos, sin = position_embeddings                       # [B or 1, S, rot], halves repeated
    rot = int(cos.shape[-1])
    cos = cos[..., :rot // 2].expand(B, S, rot // 2).reshape(B * S, rot // 2)
    sin = sin[..., :rot // 2].expand(B, S, rot // 2).reshape(B * S, rot // 2)
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    q, k, v, _ = _torch_ops().qkv_proj(
        x.reshape(B * S, H), layer.nki_w_qkv, nq, nkv, d, layer.nki_qkv_bias, None,
        layer.input_layernorm.weight, _eps(layer.input_layernorm),
        None if qn is None else qn.weight, None if kn is None else kn.weight,
        None if qn is None else _eps(qn), None, 10000.0, cos, sin, rot, "half", "heads")
    return (q.view(nq, B, S, d).transpose(0, 1), k.view(nkv, B, S, d).transpose(0, 1),
            v.view(nkv, B, S, d).transpose(0, 1))


def _patched_forward(self, hidden_states, *args, **kwargs):
    """Decoder layer: fused front and/or back, the stock modules for the rest."""
    if args:
        raise TypeError("nki_kernels patched decoder layer: pass everything after hidden_states "
                        "by keyword (as transformers does)")
    attn = self.self_attn
    residual = hidden_states
    if self.nki_fused_attn:
        position_embeddings = kwargs.pop("position_embeddings")
        attention_mask = kwargs.pop("attention_mask", None)
        cache = kwargs.pop("cache", None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        for k in ("position_ids", "use_cache", "output_attentions"):
            kwargs.pop(k, None)
        q, k, v = _qkv_front(self, hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        impl = attn.config._attn_implementation
        eager = sys.modules[type(attn).__module__].eager_attention_forward
        fn = nki_attention if impl == NAME else _all_attention().get_interface(impl, eager)
        extra = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
        o, _ = fn(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **extra,
                  **kwargs)
        B, S = hidden_states.shape[:2]
        attn_out = attn.o_proj(o.reshape(B, S, -1))
    else:
        h = self.input_layernorm(hidden_states)
        attn_out, _ = attn(hidden_states=h, **kwargs)
    hidden_states = residual + attn_out
    if self.nki_fused_mlp == "moe":
        return _moe_back(self, hidden_states)
    if self.nki_fused_mlp:
        B, S, H = hidden_states.shape
        x = hidden_states.reshape(B * S, H)
        norm = self.post_attention_layernorm
        y = _torch_ops().swiglu_mlp(x, self.nki_w_gate, self.nki_w_up, self.nki_w_down,
                                    norm.weight, _eps(norm), x, None, None, None)
        return y.view(B, S, H)
    return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _all_attention():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS


def apply_nki_kernels(model, *, attention: bool = True, blocks: bool = True) -> PatchReport:
    """Patch ``model`` (a transformers causal LM, weights loaded, bfloat16) in place.

    attention: switch the model to ``attn_implementation="nki_kernels"`` (registering it).
    blocks: fuse each supported decoder layer's front (RMSNorm + QKV + QK-norm + RoPE ->
      ``qkv_proj``) and back (RMSNorm + SwiGLU MLP + residual -> ``swiglu_mlp``). The stock
      q/k/v and gate/up/down weights become views of the fused, kernel-layout copies, so memory
      does not grow; patch after loading weights (reloading afterwards breaks the sharing).
    Returns a :class:`PatchReport` listing what was swapped and what stayed stock and why.
    Supported: ``ARCHS`` (Llama, Qwen3, Qwen3-MoE; DeepSeek-V3's MLP and MoE blocks, its MLA
    attention stays stock). Everything else is left alone and listed.
    """
    cfg = model.config
    mtype = getattr(cfg, "model_type", type(model).__name__)
    report = PatchReport(mtype)
    if attention:
        register_attention()
        model.set_attn_implementation(NAME)
    report.attn_implementation = cfg._attn_implementation
    arch = ARCHS.get(mtype)
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("DecoderLayer"):
            continue
        if arch is None:
            report.unsupported[name] = f"architecture {mtype!r} not supported (supported: " \
                                       f"{', '.join(ARCHS)})" + (f": {NOT_YET[mtype]}"
                                                                 if mtype in NOT_YET else "")
            continue
        if not blocks:
            continue
        pa, pm = _attn_problem(mod, arch), _mlp_problem(mod, arch)
        if pa is None:
            _fuse_attention(mod)
            qk = " + q_norm/k_norm" if getattr(mod.self_attn, "q_norm", None) is not None else ""
            report.patched[f"{name}.input_layernorm+self_attn.q/k/v_proj"] = \
                f"qkv_proj (RMSNorm + QKV{qk} + RoPE)"
            report.unsupported[f"{name}.self_attn.o_proj"] = "stock nn.Linear (no fused kernel)"
        else:
            report.unsupported[f"{name}.input_layernorm+self_attn"] = pa
        back = None
        if pm is None and _cls(mod.mlp) in arch.get("moe", ()):
            back = "moe"
            _fuse_moe(mod)
            shared = " + shared expert" if getattr(mod.mlp, "shared_experts", None) is not None \
                else ""
            report.patched[f"{name}.mlp"] = f"router_topk + fused_moe (experts and routing{shared})"
            report.unsupported[f"{name}.post_attention_layernorm+mlp.gate"] = \
                "stock (the norm and the router GEMM run in torch)"
        elif pm is None:
            back = "mlp"
            _fuse_mlp(mod)
            report.patched[f"{name}.post_attention_layernorm+mlp"] = \
                "swiglu_mlp (RMSNorm + SwiGLU + residual)"
        else:
            report.unsupported[f"{name}.post_attention_layernorm+mlp"] = pm
        mod.nki_fused_attn, mod.nki_fused_mlp = pa is None, back
        if pa is None or pm is None:
            mod.forward = types.MethodType(_patched_forward, mod)
    for name in ("model.embed_tokens", "model.norm", "lm_head"):
        if _has(model, name):
            report.unsupported[name] = "stock (no nki kernel for this module)"
    return report


def _has(model, path):
    m = model
    for p in path.split("."):
        m = getattr(m, p, None)
        if m is None:
            return False
    return True


__all__ = ["nki_attention", "register_attention", "apply_nki_kernels", "PatchReport", "ARCHS",
           "NOT_YET", "STATS", "NAME"]
