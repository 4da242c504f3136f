"""nki-kernels: hand-tiled NKI kernels for LLM inference on AWS Trainium (Trn2, Trn3).

Every op takes NumPy arrays (or CPU torch tensors on the emulator; device tensors on a trn
instance), validates its arguments, picks its kernel variant, and runs it on the backend chosen by
``nki_kernels.backend``.
"""
from .attention.decode_attention import decode_attention
from .attention.flash_attention import flash_attention
from .attention.kv_cache_append import kv_cache_append
from .attention.merge_attention_states import merge_attention_states
from .attention.mla_decode import mla_decode
from .attention.paged_attention import PagedAttentionPlan, paged_attention, plan_paged_attention
from .dense.matmul import matmul
from .dense.qkv_proj import QKVOutput, qkv_proj
from .dense.swiglu_mlp import swiglu_mlp, tile_weight
from .moe.fused_moe import fused_moe, quantize_expert_weights_mx, tile_expert_weights
from .moe.router_topk import router_topk
from .quant.mxfp8_matmul import MXTensor, mxfp8_matmul, quantize_weights_mx
from .quant.rmsnorm_quant import rmsnorm_quant

__version__ = "0.1.0"
__all__ = ["matmul", "flash_attention", "qkv_proj", "QKVOutput", "swiglu_mlp", "tile_weight",
           "rmsnorm_quant", "mxfp8_matmul", "quantize_weights_mx", "MXTensor",
           "router_topk", "fused_moe", "tile_expert_weights", "quantize_expert_weights_mx",
           "decode_attention", "merge_attention_states", "mla_decode",
           "paged_attention", "plan_paged_attention", "PagedAttentionPlan", "kv_cache_append"]
