"""transformers integration: tiny random Llama, Qwen3 and Qwen3-MoE models (2 layers, hidden
256), stock vs patched with apply_nki_kernels (fused qkv_proj / swiglu_mlp blocks, router_topk +
fused_moe, attn_implementation "nki_kernels": flash_attention prefill, decode_attention decode)
on the same input.

* logits: the attention accuracy rule (reference/compare.py) with the stock bf16 model as the
  same-precision reference and the stock model in float64 as the exact one;
* greedy generation of 16 tokens gives the stock model's tokens. The lm_head runs in fp32 in both
  models (bf16 logits tie often: their spacing is ~0.02 at |logit| ~ 3), and the prompts are
  ones whose greedy choices are separated: every stock top-2 margin is more than twice the
  largest logit difference seen between the two models (asserted: no flip is then possible, so
  a differing token is a kernel error, not a near-tie);
* the whole-model Qwen3-MoE runs route every token to all 4 experts (top_k = E): a top-2-of-8
  choice flips at near-ties from bf16 rounding alone (seen in a tiny top-2-of-8 model: logit
  error 0.18 against the stock bf16 model's 0.02, while each block alone matched), and a flip
  compares different expert sets. Routing with a real choice (top-2 of 8)
  is checked on one MoE block, where the chosen experts must equal the stock router's;
* what the kernels cannot express falls back visibly; unsupported modules are listed.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import nki_kernels.torch as nkt  # noqa: E402
from nki_kernels.reference.compare import assert_attention_close  # noqa: E402
from nki_kernels.torch import hf  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)       # one core per test process (pytest -n 2 already uses both)
VOCAB = 32           # few candidates per step: well-separated greedy choices (module docstring)
PROMPT, NEW = 16, 16
# prompt seeds with well-separated greedy choices (found by scanning; the margin is asserted)
GEN_SEED = {"llama": 40, "qwen3": 5, "qwen3_moe": 29, "deepseek_v3": 25}


# transformers 5.x renames the cache argument (past_key_values -> cache)
CACHE_KW = "cache" if "cache" in __import__("inspect").signature(
    transformers.LlamaForCausalLM.forward).parameters else "past_key_values"


def _config(arch):
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.05)
    if arch == "llama":
        return transformers.LlamaConfig(**kw)
    if arch == "deepseek_v3":    # layer 0 dense, layer 1 MoE (+ shared expert); MLA head dims 64
        kw.update(num_key_value_heads=4)
        return transformers.DeepseekV3Config(
            moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=4, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64,
            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, **kw)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(head_dim=64, moe_intermediate_size=256, num_experts=4,
                                           num_experts_per_tok=4, norm_topk_prob=True, **kw)
    return transformers.Qwen3Config(head_dim=64, **kw)


def _build(arch, **kw):
    if arch in ("qwen3_moe", "deepseek_v3"):   # grouped_mm experts take no float64: eager ones
        kw["experts_implementation"] = "eager"
    return transformers.AutoModelForCausalLM.from_config(_config(arch), dtype=torch.bfloat16,
                                                         **kw).eval()


def _fp32_head(model):
    model.lm_head.float()
    model.lm_head.register_forward_pre_hook(lambda m, a: (a[0].float(),))
    return model


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def models(request):
    """(arch, stock bf16, patched bf16, report); built once per architecture."""
    torch.manual_seed(0)
    stock = _build(request.param)
    patched = copy.deepcopy(stock)
    report = nkt.apply_nki_kernels(patched)
    return request.param, stock, patched, report


def _prompt(seed, batch=1):
    return torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def test_patch_report(models):
    arch, _, patched, report = models
    assert report.attn_implementation == "nki_kernels"
    assert patched.config._attn_implementation == "nki_kernels"
    if arch == "deepseek_v3":
        for i in range(2):
            assert report.unsupported[f"model.layers.{i}.input_layernorm+self_attn"].startswith(
                "MLA attention")
        assert report.patched["model.layers.0.post_attention_layernorm+mlp"].startswith(
            "swiglu_mlp")
        assert report.patched["model.layers.1.mlp"] == \
            "router_topk + fused_moe (experts and routing + shared expert)"
        return
    for i in range(2):
        assert f"model.layers.{i}.input_layernorm+self_attn.q/k/v_proj" in report.patched
        if arch == "qwen3_moe":
            assert report.patched[f"model.layers.{i}.mlp"].startswith("router_topk + fused_moe")
            assert report.unsupported[f"model.layers.{i}.post_attention_layernorm+mlp.gate"] \
                .startswith("stock")
        else:
            assert f"model.layers.{i}.post_attention_layernorm+mlp" in report.patched
        assert report.unsupported[f"model.layers.{i}.self_attn.o_proj"].startswith("stock")
    assert ("q_norm/k_norm" in report.patched["model.layers.0.input_layernorm+self_attn.q/k/v_proj"]
            ) == (arch != "llama")
    assert {"model.embed_tokens", "model.norm", "lm_head"} <= set(report.unsupported)
    assert "patched" in str(report) and "stock" in str(report)


def test_weights_are_shared_not_copied(models):
    """The stock q/k/v and gate/up/down weights become views of the fused kernel-layout ones."""
    arch, stock, patched, _ = models
    layer, orig = patched.model.layers[0], stock.model.layers[0]
    if arch == "deepseek_v3":
        moe, orig_moe = patched.model.layers[1], stock.model.layers[1].mlp
        assert moe.mlp.shared_experts.down_proj.weight.data_ptr() == \
            moe.nki_moe_shared_down.data_ptr()
        assert torch.equal(moe.mlp.shared_experts.up_proj.weight, orig_moe.shared_experts.up_proj.weight)
        assert torch.equal(moe.mlp.experts.down_proj, orig_moe.experts.down_proj)
        assert torch.equal(layer.mlp.gate_proj.weight, orig.mlp.gate_proj.weight)
        return
    assert layer.self_attn.k_proj.weight.data_ptr() == \
        layer.nki_w_qkv[:, layer.self_attn.q_proj.out_features:].data_ptr()
    assert torch.equal(layer.self_attn.k_proj.weight, orig.self_attn.k_proj.weight)
    if arch == "qwen3_moe":
        ex = layer.mlp.experts
        assert ex.gate_up_proj.data_ptr() == layer.nki_moe_gate_up.data_ptr()
        assert torch.equal(ex.gate_up_proj, orig.mlp.experts.gate_up_proj)
        assert torch.equal(ex.down_proj, orig.mlp.experts.down_proj)
    else:
        assert layer.mlp.gate_proj.weight.data_ptr() == layer.nki_w_gate.data_ptr()
        assert torch.equal(layer.mlp.down_proj.weight, orig.mlp.down_proj.weight)


def test_logits_match_stock(models):
    """Batch of 2 prompts (prefill; no padding): patched error <= 2 x the stock bf16 model's
    error against the float64 model + floor, and every attention call ran the kernel."""
    _, stock, patched, _ = models
    ids = _prompt(1, batch=2)
    exact = copy.deepcopy(stock).double()
    hf.STATS.clear()
    with torch.no_grad():
        got = patched(ids).logits.float().numpy()
        same = stock(ids).logits.float().numpy()
        ref = exact(ids).logits.numpy()
    assert hf.STATS == {"flash_attention": 2}, hf.STATS
    assert_attention_close(got, same, ref, what="logits")
    err = float(np.abs(got - ref).max())
    print(f"max |logit error| patched {err:.2e}, stock bf16 {float(np.abs(same - ref).max()):.2e}")


def test_greedy_generation_matches_stock(models):
    arch, stock, patched, _ = models
    stock, patched = _fp32_head(copy.deepcopy(stock)), _fp32_head(copy.deepcopy(patched))
    ids = _prompt(GEN_SEED[arch])
    hf.STATS.clear()
    with torch.no_grad():
        want = stock.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
        got = patched.generate(ids, max_new_tokens=NEW, do_sample=False)
        seq = want.sequences[:, :-1]                       # teacher-forced: the same contexts
        diff = (stock(seq).logits - patched(seq).logits).abs().max().item()
    assert hf.STATS["decode_attention"] == 2 * (NEW - 1) and not any(
        k.startswith("fallback") for k in hf.STATS), hf.STATS
    top2 = torch.stack(want.logits)[:, 0].topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 2 * diff, (f"prompt not discriminating: min top-2 margin {margin:.3f} <= 2 x "
                               f"logit difference {diff:.3f}; pick another GEN_SEED")
    assert got[0, PROMPT:].tolist() == want.sequences[0, PROMPT:].tolist()
    print(f"{arch}: min top-2 margin {margin:.3f}, max |logit difference| {diff:.3f}")


def test_patched_model_compiles_fullgraph(models):
    """torch.compile(fullgraph=True) traces the whole patched model (fused blocks, the attention
    interface, the ops' fakes) without a graph break, and gives the eager logits."""
    arch, _, patched, _ = models
    if arch != "llama":
        pytest.skip("one architecture is enough: the patched code paths are shared")
    ids = _prompt(6)
    torch._dynamo.reset()
    with torch.no_grad():
        want = patched(ids).logits
        got = torch.compile(patched, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(got, want)


def test_attention_implementation_from_config():
    """from_config(attn_implementation="nki_kernels") alone (no block patching): logits by the
    accuracy rule against stock SDPA; decode with decode_attention and, by option,
    flash_attention (both within the rule against the stock decode step)."""
    nkt.register_attention()
    torch.manual_seed(1)
    stock = transformers.AutoModelForCausalLM.from_config(_config("llama"),
                                                          dtype=torch.bfloat16).eval()
    ours = transformers.AutoModelForCausalLM.from_config(_config("llama"), dtype=torch.bfloat16,
                                                         attn_implementation="nki_kernels").eval()
    ours.load_state_dict(stock.state_dict())
    assert stock.config._attn_implementation == "sdpa"
    exact = copy.deepcopy(stock).double()
    ids = _prompt(2)
    with torch.no_grad():
        for decode in ("decode_attention", "flash_attention"):
            nkt.register_attention(decode=decode)
            hf.STATS.clear()
            out = ours(ids, use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            step = ours(ids[:, :1], **{CACHE_KW: cache}).logits
            assert hf.STATS[decode if decode == "decode_attention"
                            else "flash_attention (S_q < S_kv)"] == 2, hf.STATS
            full = torch.cat([ids, ids[:, :1]], 1)
            assert_attention_close(step.float().numpy(), stock(full).logits[:, -1:].float().numpy(),
                                   exact(full).logits[:, -1:].numpy(), what=f"decode ({decode})")
        assert_attention_close(out.logits.float().numpy(), stock(ids).logits.float().numpy(),
                               exact(ids).logits.numpy(), what="prefill logits")
    nkt.register_attention(decode="decode_attention")


def test_padding_mask_falls_back_visibly(models):
    """Left padding is a mask the kernel cannot express: a plain torch attention runs, counted
    and warned; the valid positions still match the stock model by the accuracy rule."""
    _, stock, patched, _ = models
    ids = _prompt(3, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    exact = copy.deepcopy(stock).double()
    hf.STATS.clear()
    hf._warned.clear()
    with torch.no_grad(), pytest.warns(UserWarning, match="padding or custom attention mask"):
        got = patched(ids, attention_mask=mask).logits.float().numpy()
    assert hf.STATS["fallback: a padding or custom attention mask"] == 2
    with torch.no_grad():
        same = stock(ids, attention_mask=mask).logits.float().numpy()
        ref = exact(ids, attention_mask=mask).logits.numpy()
    assert_attention_close(got[1, 5:], same[1, 5:], ref[1, 5:], what="padded row")
    assert_attention_close(got[0], same[0], ref[0], what="unpadded row")


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_moe_block_routes_like_stock(arch):
    """One sparse block with a real choice (Qwen3-MoE: softmax top-2 of 8, no renormalisation;
    DeepSeek-V3: sigmoid + correction bias, top-2 of 8 within the best 2 of 4 groups, routed
    scaling, shared expert): the patched block picks the stock router's experts and its output
    meets the accuracy rule against the float64 block (stock bf16 block as the same-precision
    reference)."""
    common = dict(vocab_size=VOCAB, hidden_size=256, moe_intermediate_size=128,
                  num_experts_per_tok=2, num_attention_heads=4, initializer_range=0.05)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_experts=8, num_hidden_layers=1, head_dim=64,
                                          num_key_value_heads=2, **common)
    else:
        cfg = transformers.DeepseekV3Config(n_routed_experts=8, n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5, num_hidden_layers=1,
                                            first_k_dense_replace=0, q_lora_rank=64,
                                            kv_lora_rank=64, qk_rope_head_dim=32,
                                            qk_nope_head_dim=32, v_head_dim=64, **common)
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                          experts_implementation="eager").eval()
    layer = model.model.layers[0]
    if arch == "deepseek_v3":
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    exact = copy.deepcopy(layer).double()
    fused = copy.deepcopy(layer)
    hf._fuse_moe(fused)
    h = torch.randn((1, 24, 256), generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        xn = layer.post_attention_layernorm(h).reshape(24, 256)
        _, _, want_ids = layer.mlp.gate(xn)
        got = hf._moe_back(fused, h)
        ids = _routed_ids(layer, xn)
        same = h + layer.mlp(layer.post_attention_layernorm(h))
        ref = h.double() + exact.mlp(exact.post_attention_layernorm(h.double()))
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values.int())
    assert_attention_close(got.float().numpy(), same.float().numpy(), ref.numpy(), what="MoE")


def _routed_ids(layer, xn):
    """The experts router_topk picks for ``xn``, with the arguments _moe_back gives it."""
    gate = layer.mlp.gate
    if hasattr(gate, "e_score_correction_bias"):
        return torch.ops.nki_kernels.router_topk(
            torch.nn.functional.linear(xn.float(), gate.weight.float()), 2, "sigmoid",
            bool(gate.norm_topk_prob), int(gate.num_group), int(gate.topk_group),
            gate.e_score_correction_bias.float(), float(gate.routed_scaling_factor))[1]
    return torch.ops.nki_kernels.router_topk(
        torch.nn.functional.linear(xn, gate.weight), 2, "softmax", bool(gate.norm_topk_prob))[1]


def _tiny_attention(Hq=4, Hkv=2):
    m = torch.nn.Module()
    m.is_causal, m.training = True, False
    return m


@pytest.mark.parametrize("sq,skv", [(24, 24), (1, 40), (3, 40)])
@pytest.mark.parametrize("opts", [dict(sliding_window=8), dict(softcap=5.0), dict(s_aux=True)])
def test_attention_options_pass_through(sq, skv, opts):
    """Sliding window, soft-cap and sinks reach the kernels (prefill and decode) and agree with
    a plain torch attention by the accuracy rule."""
    g = torch.Generator().manual_seed(sq * 100 + skv)
    q = torch.randn((2, 4, sq, 64), generator=g).bfloat16()
    k, v = (torch.randn((2, 2, skv, 64), generator=g).bfloat16() for _ in range(2))
    opts = dict(opts)
    if opts.get("s_aux"):
        opts["s_aux"] = torch.randn(4, generator=g)
    hf.STATS.clear()
    got, _ = hf.nki_attention(_tiny_attention(), q, k, v, None, scaling=0.125, **opts)
    assert not any(k_.startswith("fallback") for k_ in hf.STATS), hf.STATS
    args = (None, 0.125, True, opts.get("sliding_window"), opts.get("softcap"), opts.get("s_aux"))
    same = hf._torch_attention(q, k, v, *args)
    exact = hf._torch_attention(q.double(), k.double(), v.double(), *args)
    assert got.shape == (2, sq, 4, 64)
    assert_attention_close(got.float().numpy(), same.float().numpy(), exact.numpy())


def test_attention_shapes_without_a_kernel_fall_back():
    """MLA-style v head_dim != q head_dim and fp32 run the plain attention, counted."""
    g = torch.Generator().manual_seed(9)
    q, k = (torch.randn((1, 4, 8, 64), generator=g).bfloat16() for _ in range(2))
    v = torch.randn((1, 4, 8, 32), generator=g).bfloat16()
    hf.STATS.clear()
    hf._warned.clear()
    with pytest.warns(UserWarning, match="v head_dim differs"):
        o, _ = hf.nki_attention(_tiny_attention(), q, k, v, None, scaling=0.125)
    with pytest.warns(UserWarning, match="dtype torch.float32"):
        hf.nki_attention(_tiny_attention(), q.float(), k.float(), k.float(), None)
    assert o.shape == (1, 8, 4, 32)
    assert hf.STATS["fallback: v head_dim differs from q/k head_dim (MLA): no kernel for that "
                    "yet"] == 1
    assert hf.STATS["fallback: dtype torch.float32 (the kernel takes bfloat16 / float16)"] == 1


def test_unsupported_architecture_is_left_alone_and_listed():
    """An architecture without a fused mapping (Mistral here): every decoder layer listed, the
    blocks untouched, the attention implementation still switched (it is model-agnostic)."""
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    report = nkt.apply_nki_kernels(model)
    assert not report.patched
    for i in range(2):
        assert report.unsupported[f"model.layers.{i}"].startswith("architecture 'mistral' not "
                                                                  "supported")
        assert "forward" not in vars(model.model.layers[i])


def test_unfusable_layers_are_listed():
    """float32 weights: neither block is fused (the kernels take bf16); both reasons listed."""
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"), dtype=torch.float32)
    report = nkt.apply_nki_kernels(model, attention=False)
    assert report.unsupported["model.layers.0.input_layernorm+self_attn"] == \
        "weights are torch.float32: qkv_proj takes bfloat16"
    assert report.unsupported["model.layers.1.post_attention_layernorm+mlp"] == \
        "weights are torch.float32: swiglu_mlp takes bfloat16"
    assert not report.patched and report.attn_implementation != "nki_kernels"


def test_register_attention_rejects_unknown_decode_kernel():
    with pytest.raises(ValueError, match=r"register_attention: decode must be one of "
                                         r"decode_attention, flash_attention; got 'paged'"):
        nkt.register_attention(decode="paged")
