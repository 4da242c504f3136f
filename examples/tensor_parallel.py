"""A Llama decoder layer sharded over N tensor-parallel ranks, the neuronx-distributed way, each
rank calling nki-kernels ops on its shard.

Megatron / neuronx-distributed split (``ColumnParallelLinear`` / ``RowParallelLinear``):

* QKV and gate/up are column-parallel: rank r holds its query heads (n_q / N), its KV heads
  (n_kv / N; when N > n_kv each KV head is replicated on the N / n_kv ranks whose query heads read
  it, as neuronx-distributed's GQA replication does) and I / N columns of gate and up;
* o_proj and down are row-parallel: rank r holds the matching input rows and produces a partial
  [T, H] output; an all-reduce sums the partials.

Per rank: ``qkv_proj`` (RMSNorm + QKV + RoPE on the rank's heads) -> ``flash_attention`` (GQA, no
KV replication inside a rank) -> ``matmul`` with o_proj's rows (fp32 partial) -> all-reduce ->
residual -> ``swiglu_mlp`` (RMSNorm + SwiGLU on the rank's I / N columns; fp32 sum of the bf16
partials) -> all-reduce -> residual.

On a trn instance with neuronx-distributed, each process is one rank (``parallel_state``
gives rank and world size) and the sums are ``reduce_from_tensor_model_parallel_region``
(an all-reduce over the tensor-parallel group). Here all ranks run in one process and
``all_reduce`` sums their partials.

    python examples/tensor_parallel.py        # N = 1, 2, 8 against the unsharded stock layer
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import nki_kernels.torch as nkt


@dataclass
class RankShard:
    """One rank's weights, in the kernels' layouts (made once at load time)."""
    rank: int
    n_q: int                 # query heads on this rank
    n_kv: int                # KV heads on this rank (1 when replicated)
    head_dim: int
    w_qkv: torch.Tensor      # [H, (n_q + 2 n_kv) d]   column-parallel
    w_o: torch.Tensor        # [n_q d, H]              row-parallel
    w_gate: torch.Tensor     # [H, I / N]              column-parallel
    w_up: torch.Tensor       # [H, I / N]
    w_down: torch.Tensor     # [I / N, H]              row-parallel
    norm_attn: torch.Tensor  # [H] (replicated)
    norm_mlp: torch.Tensor   # [H]
    eps: float


def kv_heads_of_rank(rank, n_ranks, n_q, n_kv):
    """The KV heads rank ``rank`` needs: its own slice, or the one replicated head its query heads
    read when there are more ranks than KV heads."""
    if n_kv >= n_ranks:
        per = n_kv // n_ranks
        return list(range(rank * per, (rank + 1) * per))
    q_per_rank = n_q // n_ranks
    return [rank * q_per_rank // (n_q // n_kv)]


def shard_layer(layer, rank: int, n_ranks: int) -> RankShard:
    """Rank ``rank``'s shard of a transformers ``LlamaDecoderLayer`` (bf16)."""
    attn, mlp = layer.self_attn, layer.mlp
    d = attn.head_dim
    n_q = attn.q_proj.out_features // d
    n_kv = attn.k_proj.out_features // d
    I = mlp.gate_proj.out_features
    if n_q % n_ranks or I % n_ranks or (n_kv % n_ranks and n_ranks % n_kv):
        raise ValueError(f"tensor_parallel: {n_ranks} ranks must divide n_q={n_q} and I={I}, "
                         f"and divide or be a multiple of n_kv={n_kv}")
    qh = range(rank * n_q // n_ranks, (rank + 1) * n_q // n_ranks)
    kvh = kv_heads_of_rank(rank, n_ranks, n_q, n_kv)

    def rows(w, heads):                              # [heads * d, H] rows of a [out, in] weight
        return torch.cat([w[h * d:(h + 1) * d] for h in heads])

    w_qkv = torch.cat([rows(attn.q_proj.weight, qh), rows(attn.k_proj.weight, kvh),
                       rows(attn.v_proj.weight, kvh)]).t().contiguous()
    cols = slice(rank * I // n_ranks, (rank + 1) * I // n_ranks)
    w_o = attn.o_proj.weight[:, qh.start * d:qh.stop * d].t().contiguous()
    return RankShard(rank, len(qh), len(kvh), d, w_qkv.detach(), w_o.detach(),
                     mlp.gate_proj.weight[cols].t().contiguous().detach(),
                     mlp.up_proj.weight[cols].t().contiguous().detach(),
                     mlp.down_proj.weight[:, cols].t().contiguous().detach(),
                     layer.input_layernorm.weight.detach(),
                     layer.post_attention_layernorm.weight.detach(),
                     float(layer.input_layernorm.variance_epsilon))


def attention_partial(s: RankShard, x, cos, sin):
    """Rank's attention block up to its row-parallel o_proj: x [T, H] -> fp32 partial [T, H]."""
    T = x.shape[0]
    q, k, v = nkt.qkv_proj(x, s.w_qkv, n_q_heads=s.n_q, n_kv_heads=s.n_kv, head_dim=s.head_dim,
                           norm_weight=s.norm_attn, eps=s.eps, cos=cos, sin=sin)[:3]
    o = nkt.flash_attention(q[None], k[None], v[None], causal=True)       # [1, n_q, T, d]
    o = o[0].transpose(0, 1).reshape(T, s.n_q * s.head_dim)               # [T, n_q d]
    return nkt.matmul(o, s.w_o, out_dtype=torch.float32)


def mlp_partial(s: RankShard, h):
    """Rank's MLP on its I / N columns (no residual): h [T, H] -> bf16 partial [T, H]."""
    return nkt.swiglu_mlp(h, s.w_gate, s.w_up, s.w_down, norm_weight=s.norm_mlp, eps=s.eps)


def all_reduce(partials):
    """The tensor-parallel all-reduce, here over ranks held in one process (fp32 sum)."""
    return torch.stack([p.float() for p in partials]).sum(0)


def tp_layer(shards, x, cos, sin):
    """The sharded layer: x [T, H] bf16 -> [T, H] bf16."""
    attn = all_reduce([attention_partial(s, x, cos, sin) for s in shards])
    h = (x.float() + attn).to(torch.bfloat16)
    mlp = all_reduce([mlp_partial(s, h) for s in shards])
    return (h.float() + mlp).to(torch.bfloat16)


def neuron_tp_layer(layer, x, cos, sin):
    """On a trn instance, one process per rank (torchrun, neuronx-distributed initialised with
    ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=N)``): this rank's shard,
    the sums over the tensor-parallel group. Not run here (no Neuron devices)."""
    from neuronx_distributed.parallel_layers import parallel_state
    from neuronx_distributed.parallel_layers.mappings import (
        reduce_from_tensor_model_parallel_region as tp_sum,
    )
    s = shard_layer(layer, parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_tensor_model_parallel_size())
    h = (x.float() + tp_sum(attention_partial(s, x, cos, sin))).to(torch.bfloat16)
    return (h.float() + tp_sum(mlp_partial(s, h).float())).to(torch.bfloat16)


def rope_tables(rotary_emb, x, T):
    """transformers' cos/sin [1, T, d] (halves repeated) -> the kernels' [T, d / 2] tables."""
    cos, sin = rotary_emb(x, torch.arange(T)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half].float(), sin[0, :, :half].float()


def tiny_llama(seed=0):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=1, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.05)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def stock_layer(model, x):
    """The unsharded transformers layer on x [T, H] (its own dtype)."""
    T = x.shape[0]
    pe = model.model.rotary_emb(x[None], torch.arange(T)[None])
    return model.model.layers[0](x[None], attention_mask=None, position_embeddings=pe)[0]


def main():
    import copy
    model = tiny_llama()
    layer = model.model.layers[0]
    T = 16
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    cos, sin = rope_tables(model.model.rotary_emb, x, T)
    with torch.no_grad():
        exact = stock_layer(copy.deepcopy(model).double(), x.double())
        stock = stock_layer(model, x)
        print(f"stock bf16 layer: max |error| {(stock.double() - exact).abs().max().item():.2e}")
        for n in (1, 2, 8):
            shards = [shard_layer(layer, r, n) for r in range(n)]
            y = tp_layer(shards, x, cos, sin)
            err = (y.double() - exact).abs().max().item()
            print(f"N = {n}: {shards[0].n_q} q heads, {shards[0].n_kv} kv head(s), "
                  f"I/N = {shards[0].w_gate.shape[1]} per rank; max |error| {err:.2e}")


if __name__ == "__main__":
    main()
