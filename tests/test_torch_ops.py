"""nki_kernels.torch: every op registered in torch.library, its CPU kernel path bit-identical to
the NumPy API, the reference path close to it, fake implementations that let
torch.compile(fullgraph=True) trace a call, and the refusals (XLA without Neuron, bad options)."""
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import nki_kernels  # noqa: E402
import nki_kernels.torch as nkt  # noqa: E402
from nki_kernels.reference.compare import assert_attention_close, assert_rows_close  # noqa: E402
from nki_kernels.reference.flash_attention import flash_attention_ref  # noqa: E402
from nki_kernels.torch import ops as nko  # noqa: E402
from nki_kernels.torch._convert import to_numpy  # noqa: E402

pytestmark = pytest.mark.torch
torch.set_num_threads(1)       # one core per test process (pytest -n 2 already uses both)
BF = torch.bfloat16


def _same(a, b):
    """Bit-identical: a torch result vs the NumPy API's result."""
    a_np = to_numpy(a)
    assert a_np.shape == np.asarray(b).shape and a_np.dtype == np.asarray(b).dtype
    assert np.array_equal(a_np.view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def _t(shape, seed, scale=1.0, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _np(t):
    return to_numpy(t)


# -------------------------------------------------------------------------- the op cases
def _cases():
    """name -> (args, kwargs for torch.ops.nki_kernels.<name>, the NumPy API call)."""
    x, w = _t((16, 256), 1), _t((256, 128), 2, 1 / 16)
    q, k, v = _t((1, 4, 16, 64), 3), _t((1, 2, 24, 64), 4), _t((1, 2, 24, 64), 5)
    sinks = _t((4,), 6, dtype=torch.float32)
    wqkv = _t((256, 512), 7, 1 / 16)
    nw = (1 + 0.1 * _t((256,), 8, dtype=torch.float32))
    cos, sin = torch.cos(torch.arange(16.0)[:, None] * 0.1 * torch.arange(1, 33)), \
        torch.sin(torch.arange(16.0)[:, None] * 0.1 * torch.arange(1, 33))
    wg, wu, wd = _t((256, 384), 9, 1 / 16), _t((256, 384), 10, 1 / 16), _t((384, 256), 11, 1 / 20)
    w128 = _t((128, 256), 12, 1 / 16)
    x512, b512 = _t((16, 512), 13), _t((512, 256), 14, 1 / 22)
    g512 = torch.ones(512)
    wq_mx = nki_kernels.quantize_weights_mx(_np(b512))
    dq, kc, vc = _t((2, 1, 4, 64), 15), _t((2, 40, 2, 64), 16), _t((2, 40, 2, 64), 17)
    lens = torch.tensor([33, 7], dtype=torch.int32)
    oa, ob = _t((2, 1, 4, 64), 18), _t((2, 1, 4, 64), 19)
    la, lb = _t((2, 1, 4), 24, dtype=torch.float32), _t((2, 1, 4), 25, dtype=torch.float32)
    logits = _t((12, 16), 26, dtype=torch.float32)
    g = torch.Generator().manual_seed(27)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)]).to(torch.int32)
    tw = torch.rand((12, 2), generator=g) + 0.1
    xm = _t((12, 256), 28)
    wgu, wdn = _t((8, 256, 256), 29, 1 / 16), _t((8, 128, 256), 30, 1 / 12)
    qn, qr, lat = _t((2, 1, 16, 512), 31, 0.05), _t((2, 1, 16, 64), 32), _t((2, 40, 576), 33)
    mla_lens = torch.tensor([40, 9], dtype=torch.int32)
    # a ragged batch: a decode, a 40-token chunk over a 30-token prefix, a 3-token draft
    plens, pqsl = torch.tensor([20, 70, 9]), torch.tensor([0, 1, 41, 44])
    pkc, pvc = _t((12, 16, 2, 64), 34), _t((12, 16, 2, 64), 35)
    pbt = torch.tensor([[3, 7, 0, 0, 0], [1, 5, 9, 11, 2], [8, 0, 0, 0, 0]], dtype=torch.int32)
    pq = _t((44, 4, 64), 36)
    return {
        "matmul": ((x, w), {}, lambda: nki_kernels.matmul(_np(x), _np(w))),
        "flash_attention": ((q, k, v), dict(causal=True, window=8, softcap=20.0, sinks=sinks),
                            lambda: nki_kernels.flash_attention(_np(q), _np(k), _np(v), window=8,
                                                                softcap=20.0, sinks=_np(sinks))),
        "flash_attention_lse": ((q, k, v), {}, lambda: nki_kernels.flash_attention(
            _np(q), _np(k), _np(v), return_lse=True)),
        "qkv_proj": ((x, wqkv, 4, 2, 64), dict(residual=x, norm_weight=nw, cos=cos, sin=sin),
                     lambda: nki_kernels.qkv_proj(_np(x), _np(wqkv), n_q_heads=4, n_kv_heads=2,
                                                  head_dim=64, residual=_np(x), norm_weight=_np(nw),
                                                  cos=_np(cos), sin=_np(sin))),
        "swiglu_mlp": ((x, wg, wu, wd), dict(norm_weight=nw, residual=x),
                       lambda: nki_kernels.swiglu_mlp(_np(x), _np(wg), _np(wu), _np(wd),
                                                      norm_weight=_np(nw), residual=_np(x))),
        "tile_weight": ((w128,), {}, lambda: nki_kernels.tile_weight(_np(w128))),
        "rmsnorm_quant": ((x, nw), dict(residual=x), lambda: nki_kernels.rmsnorm_quant(
            _np(x), _np(nw), residual=_np(x))),
        "rmsnorm_quant_mx": ((x512, g512), {}, lambda: tuple(nki_kernels.rmsnorm_quant(
            _np(x512), _np(g512), quant="mx"))[:2]),
        "mxfp8_matmul": ((x512, torch.from_numpy(wq_mx.data)),
                         dict(b_scale=torch.from_numpy(wq_mx.scale), k=512),
                         lambda: nki_kernels.mxfp8_matmul(_np(x512), wq_mx)),
        "quantize_weights_mx": ((b512,), {}, lambda: tuple(nki_kernels.quantize_weights_mx(
            _np(b512)))[:2]),
        "decode_attention": ((dq, kc, vc, lens), dict(window=16, sinks=sinks),
                             lambda: nki_kernels.decode_attention(
                                 _np(dq), _np(kc), _np(vc), _np(lens), window=16,
                                 sinks=_np(sinks))),
        "decode_attention_lse": ((dq, kc, vc, lens), {}, lambda: nki_kernels.decode_attention(
            _np(dq), _np(kc), _np(vc), _np(lens), return_lse=True)),
        "paged_attention": ((pq, pkc, pvc, pbt, plens, pqsl), dict(window=24),
                            lambda: nki_kernels.paged_attention(
                                _np(pq), _np(pkc), _np(pvc), _np(pbt), _np(plens), _np(pqsl),
                                window=24)),
        "paged_attention_lse": ((pq, pkc, pvc, pbt, plens, pqsl), {},
                                lambda: nki_kernels.paged_attention(
                                    _np(pq), _np(pkc), _np(pvc), _np(pbt), _np(plens), _np(pqsl),
                                    return_lse=True)),
        "merge_attention_states": ((oa, la, ob, lb), {}, lambda: nki_kernels.merge_attention_states(
            _np(oa), _np(la), _np(ob), _np(lb))),
        "router_topk": ((logits, 2), dict(scoring="sigmoid", n_groups=4, topk_groups=2),
                        lambda: nki_kernels.router_topk(_np(logits), 2, scoring="sigmoid",
                                                        n_groups=4, topk_groups=2)),
        "fused_moe": ((xm, wgu, wdn, tw, ids), {}, lambda: nki_kernels.fused_moe(
            _np(xm), _np(wgu), _np(wdn), _np(tw), _np(ids))),
        "tile_expert_weights": ((wdn,), {}, lambda: nki_kernels.tile_expert_weights(_np(wdn))),
        "mla_decode": ((qn, qr, lat, mla_lens, 0.07), {}, lambda: nki_kernels.mla_decode(
            _np(qn), _np(qr), _np(lat), _np(mla_lens), scale=0.07)),
    }


CASES = _cases()


def test_every_public_op_is_registered():
    """Every op of nki_kernels.__all__ has a torch op (helpers and result types excepted)."""
    helpers = {"QKVOutput", "MXTensor", "plan_paged_attention", "PagedAttentionPlan",
               "quantize_expert_weights_mx"}       # host-side weight layout (MX: no torch op)
    for name in set(nki_kernels.__all__) - helpers:
        assert hasattr(torch.ops.nki_kernels, name), name
        assert name in nko.OPS
    # ops that write their arguments in place (kv_cache_append) return nothing: their torch
    # tests (eager, compiled) live in their own test files
    in_place = {n for n, o in nko.OPS.items() if o.mutates}
    assert set(CASES) == set(nko.OPS) - in_place, "a registered op has no test case"


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_kernel_is_the_numpy_op(name):
    """CPU tensors run the emulated kernel: bit for bit what the NumPy API returns."""
    args, kw, np_call = CASES[name]
    got = getattr(torch.ops.nki_kernels, name)(*args, **kw)
    want = np_call()
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    want = [w for w in want if w is not None]
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compile_fullgraph_uses_the_fake(name):
    """torch.compile(fullgraph=True) traces the op with its fake implementation (no graph
    break) and the compiled call returns the eager result's shapes, dtypes and bits."""
    args, kw, _ = CASES[name]
    op = getattr(torch.ops.nki_kernels, name)

    def f(*a):
        return op(*a, **kw)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    ref = f(*args)
    out, ref = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert o.numel() == 0 or torch.equal(o.contiguous().view(torch.uint8),
                                             r.contiguous().view(torch.uint8))


@pytest.mark.parametrize("name", ["flash_attention", "qkv_proj", "swiglu_mlp", "matmul"])
def test_fake_matches_the_kernel(name):
    args, kw, _ = CASES[name]
    op = getattr(torch.ops.nki_kernels, name)
    torch.library.opcheck(op, args, kw, test_utils=("test_schema", "test_faketensor"))


def test_compile_a_block_calling_several_ops():
    """One fullgraph trace through qkv_proj -> flash_attention -> swiglu_mlp, with reshapes
    and a residual: the ops compose without graph breaks."""
    x = _t((16, 256), 20)
    wqkv, wg, wd = _t((256, 512), 21, 1 / 16), _t((256, 256), 22, 1 / 16), _t((256, 256), 23, 1 / 16)
    pos = torch.arange(16)

    def block(x):
        q, k, v, _ = torch.ops.nki_kernels.qkv_proj(x, wqkv, 4, 2, 64, positions=pos)
        o = torch.ops.nki_kernels.flash_attention(q[None], k[None], v[None])
        h = x + o[0].transpose(0, 1).reshape(16, 256)
        return torch.ops.nki_kernels.swiglu_mlp(h, wg, wg, wd, residual=h)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(block, fullgraph=True, backend="aot_eager")(x), block(x))


@pytest.mark.parametrize("name", ["flash_attention", "qkv_proj", "swiglu_mlp", "matmul",
                                  "rmsnorm_quant", "decode_attention", "merge_attention_states",
                                  "router_topk", "fused_moe", "mla_decode"])
def test_reference_implementation(name, monkeypatch):
    """NKI_KERNELS_TORCH_IMPL=reference (and the context manager) runs the NumPy reference:
    close to the kernel, not the same code."""
    args, kw, _ = CASES[name]
    op = getattr(torch.ops.nki_kernels, name)
    kern = op(*args, **kw)
    monkeypatch.setenv(nko.IMPL_ENV, "reference")
    ref_env = op(*args, **kw)
    monkeypatch.delenv(nko.IMPL_ENV)
    with nkt.implementation("reference"):
        ref = op(*args, **kw)
    kern, ref, ref_env = ((t,) if not isinstance(t, tuple) else t for t in (kern, ref, ref_env))
    for a, b in zip(ref, ref_env):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if name == "rmsnorm_quant":          # fp8 codes: compare the dequantized rows
        kern = (kern[0].float() * kern[1],)
        ref = (ref[0].float() * ref[1],)
    if name == "router_topk":            # ids exact, weights fp32
        assert torch.equal(kern[1], ref[1])
        kern, ref = kern[:1], ref[:1]
    for a, b in zip(kern, ref):
        if a.numel():
            assert_rows_close(_np(a.float()), _np(b.float()), dtype="bfloat16", norm_tol=6.0,
                              elem_tol=16.0, what=name)


def test_reference_falls_back_to_the_kernel_where_it_has_no_path():
    """Tile-major swiglu_mlp weights have no reference: the kernel runs (same bits)."""
    x, nw = _t((8, 256), 30), torch.ones(256)
    wg, wd = _t((256, 256), 31, 1 / 16), _t((256, 256), 32, 1 / 16)
    tg, td = nkt.tile_weight(wg), nkt.tile_weight(wd)
    want = nkt.swiglu_mlp(x, tg, tg, td, norm_weight=nw)
    with nkt.implementation("reference"):
        assert torch.equal(nkt.swiglu_mlp(x, tg, tg, td, norm_weight=nw), want)


def test_flash_attention_bshd_layout_is_a_view():
    """layout='bshd' takes [B, S, H, d] views and returns one: the same numbers as bhsd."""
    q, k, v = _t((2, 4, 16, 64), 40), _t((2, 2, 16, 64), 41), _t((2, 2, 16, 64), 42)
    o = nkt.flash_attention(q, k, v)
    ob = nkt.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             layout="bshd")
    assert ob.shape == (2, 16, 4, 64) and torch.equal(ob.transpose(1, 2), o)
    ref = flash_attention_ref(_np(q), _np(k), _np(v), p_dtype="bfloat16")
    exact = flash_attention_ref(_np(q), _np(k), _np(v), compute_dtype=np.float64)
    assert_attention_close(_np(o), ref, exact)


def test_wrappers_return_the_numpy_api_types():
    x, w = _t((8, 256), 50), _t((256, 512), 51, 1 / 16)
    r = nkt.qkv_proj(x, w, n_q_heads=4, n_kv_heads=2, head_dim=64)
    assert isinstance(r, nkt.QKVOutput) and r.residual is None and r.q.shape == (4, 8, 64)
    x5 = _t((8, 512), 52)
    mx = nkt.rmsnorm_quant(x5, torch.ones(512), quant="mx")
    assert isinstance(mx, nkt.MXTensor) and mx.data.dtype == torch.uint32 and mx.k == 512
    wq = nkt.quantize_weights_mx(_t((512, 128), 53, 1 / 22))
    y = nkt.mxfp8_matmul(mx, wq, out_dtype="float32")
    assert y.shape == (8, 128) and y.dtype == torch.float32
    q, s = nkt.rmsnorm_quant(x, torch.ones(256))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (8, 1)


def test_trn2_fp8_travels_as_uint8():
    """torch has no float8_e4m3 (Trn2's format): its codes come back as uint8 bits, and uint8
    weights go into matmul as that format."""
    from nki_kernels.emulator import target
    x = _t((8, 256), 60)
    with target("trn2"):
        q, s = nkt.rmsnorm_quant(x, torch.ones(256))
        want = nki_kernels.rmsnorm_quant(_np(x), np.ones(256, np.float32))
        assert q.dtype == torch.uint8
        _same(q, want[0].view(np.uint8))
        a = torch.from_numpy(_np(x).astype(ml_dtypes.float8_e4m3).view(np.uint8))
        b = torch.from_numpy(_np(_t((256, 128), 61, 1 / 16)).astype(ml_dtypes.float8_e4m3)
                             .view(np.uint8))
        _same(nkt.matmul(a, b), nki_kernels.matmul(
            _np(a).view(ml_dtypes.float8_e4m3), _np(b).view(ml_dtypes.float8_e4m3)))


# ------------------------------------------------------------------------------ refusals
def test_op_errors_are_the_numpy_api_errors():
    with pytest.raises(ValueError, match=r"flash_attention: head_dim must be one of"):
        nkt.flash_attention(_t((1, 2, 8, 80), 70), _t((1, 2, 8, 80), 71), _t((1, 2, 8, 80), 72))
    with pytest.raises(TypeError, match=r"matmul: b.dtype must equal a.dtype"):
        nkt.matmul(_t((8, 128), 73), _t((128, 8), 74, dtype=torch.float32))


def test_bad_implementation_choice(monkeypatch):
    with pytest.raises(ValueError, match=r"implementation: name must be one of kernel, "
                                         r"reference; got 'numpy'"):
        with nkt.implementation("numpy"):
            pass
    monkeypatch.setenv(nko.IMPL_ENV, "fast")
    with pytest.raises(ValueError, match=r"NKI_KERNELS_TORCH_IMPL must be one of kernel, "
                                         r"reference \(or unset\); got 'fast'"):
        nkt.matmul(_t((8, 128), 75), _t((128, 8), 76))


def test_xla_tensors_without_neuron_are_refused():
    """The XLA kernel names what is missing (torch-neuronx, the real nki) instead of failing
    somewhere inside torch-xla."""
    with pytest.raises(nkt.NeuronUnavailable, match=r"nki_kernels::matmul: got XLA \(Neuron\) "
                                                    r"tensors, but torch-neuronx is not importable"):
        nko._neuron_ready("matmul")


def test_unsupported_layout_options():
    q = _t((1, 2, 8, 64), 80)
    with pytest.raises(ValueError, match=r"flash_attention: layout must be 'bhsd' or 'bshd'; "
                                         r"got 'sbhd'"):
        nkt.flash_attention(q, q, q, layout="sbhd")
    with pytest.raises(ValueError, match=r"k_layout='bhds' needs layout='bhsd'"):
        nkt.flash_attention(q, q, q, layout="bshd", k_layout="bhds")
    with pytest.raises(ValueError, match=r"rmsnorm_quant: quant must be 'fp8' or 'mx'; got 'int8'"):
        nkt.rmsnorm_quant(_t((8, 256), 81), torch.ones(256), quant="int8")


def test_ops_are_inference_only():
    x = _t((8, 128), 82).requires_grad_()
    y = torch.ops.nki_kernels.matmul(x, _t((128, 8), 83))
    with pytest.raises(RuntimeError, match=r"inference-only"):
        y.float().sum().backward()
