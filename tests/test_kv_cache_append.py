"""kv_cache_append against its NumPy reference, byte for byte: every written row, and every byte
of the caches that must not change (caches filled with random bytes, NaN patterns included).
bf16 / fp16 and FP8 caches (saturation at the FP8 max, per-head scales), both targets, NumPy and
torch inputs, the torch op (eager and torch.compile), and one negative test per refused input."""
import ml_dtypes
import numpy as np
import pytest

from nki_kernels import kv_cache_append
from nki_kernels.attention.kv_cache_append import _clamp_bound, segments
from nki_kernels.emulator import target
from nki_kernels.reference.kv_cache_append import (
    bytes_kv_cache_append,
    flops_kv_cache_append,
    kv_cache_append_ref,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"trn2": np.dtype(ml_dtypes.float8_e4m3), "trn3": np.dtype(ml_dtypes.float8_e4m3fn)}
FP8_MAX = {"trn2": 240.0, "trn3": 448.0}


def _bytes(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _setup(rng, T, H, d, bs, cache_dtype, in_dtype=BF16, skip=0.15, spare=1.5):
    """k, v, caches of random bytes (sentinels), shuffled distinct slots with some -1."""
    nb = max(2, int(np.ceil(T * spare / bs)) + 1)
    k = (rng.standard_normal((T, H, d)) * 3).astype(in_dtype)
    v = (rng.standard_normal((T, H, d)) * 3).astype(in_dtype)
    kc = rng.integers(0, 256, (nb, bs, H, d * cache_dtype.itemsize), dtype=np.uint8)
    vc = rng.integers(0, 256, (nb, bs, H, d * cache_dtype.itemsize), dtype=np.uint8)
    kc, vc = kc.view(cache_dtype), vc.view(cache_dtype)
    slots = rng.choice(nb * bs, size=T, replace=False).astype(np.int64)
    slots[rng.random(T) < skip] = -1
    if T and skip < 1.0 and slots[0] < 0:             # token 0 kept: tests look at its row
        slots[0] = np.setdiff1d(np.arange(nb * bs), slots)[0]
    return k, v, kc, vc, slots


def _check(kc, vc, kc0, vc0, want_k, want_v, slots):
    """Byte-exact against the reference, and every untouched byte equal to the original."""
    H, d = kc.shape[2], kc.shape[3]
    for got, old, want in ((kc, kc0, want_k), (vc, vc0, want_v)):
        rows, rows0 = got.reshape(-1, H, d), old.reshape(-1, H, d)
        touched = np.zeros(rows.shape[0], bool)
        touched[slots[slots >= 0]] = True
        assert np.array_equal(_bytes(rows[~touched]), _bytes(rows0[~touched])), \
            "a byte outside the written slots changed"
        assert np.array_equal(_bytes(got), _bytes(want)), "written rows differ from the reference"


CASES = [  # T, H_kv, d, block_size
    (1, 8, 128, 16),
    (7, 1, 64, 16),
    (128, 8, 64, 64),
    (300, 1, 128, 128),
    (300, 8, 128, 64),
    (130, 8, 64, 16),
]


@pytest.mark.parametrize("T, H, d, bs", CASES)
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_against_reference(tgt, T, H, d, bs, kind):
    rng = np.random.default_rng(T * 1000 + H * 10 + bs)
    cdt = FP8[tgt] if kind == "fp8" else BF16
    k, v, kc, vc, slots = _setup(rng, T, H, d, bs, cdt)
    kw = {}
    if kind == "fp8":
        # k: one scale (values up to ~12 / 0.02 = 600: saturates); v: one per head
        kw = dict(k_scale=0.02, v_scale=np.linspace(0.015, 0.06, H).astype(np.float32))
        k[0, 0, :6] = np.array([0.0, -0.0, 1e3, -1e3, np.inf, -np.inf], np.float32).astype(BF16)
    kc0, vc0 = kc.copy(), vc.copy()
    want_k, want_v = kv_cache_append_ref(k, v, kc0, vc0, slots, **kw)
    out = kv_cache_append(k, v, kc, vc, slots, **kw)
    assert out[0] is kc and out[1] is vc
    _check(kc, vc, kc0, vc0, want_k, want_v, slots)
    if kind == "fp8":
        code = kc.reshape(-1, H, d)[slots[0], 0, :6]
        assert _bytes(code)[1] == 0x80                 # -0 stays -0
        top = FP8_MAX[tgt]                             # saturation at the FP8 max, inf too
        assert np.array_equal(code.astype(np.float32)[2:], [top, -top, top, -top])
    if kind == "fp8":
        written = kc.reshape(-1, H, d)[slots[slots >= 0]].astype(np.float32)
        assert np.all(np.isfinite(written)) and np.abs(written).max() == FP8_MAX[tgt]


def _chunk_slots(rng, T, bs, nb, pad=0, lead=0):
    """A prompt chunk: pages in shuffled order filled in order from offset ``lead`` of the first
    one (the first two pages adjacent in the cache), then ``pad`` skipped tokens (vLLM padding)."""
    n = -(-(T - pad + lead) // bs)
    p0 = int(rng.integers(0, nb - 1))
    rest = [int(x) for x in rng.permutation(nb) if x not in (p0, p0 + 1)]
    pages = np.array([p0, p0 + 1] + rest, np.int64)[:n]
    slots = (pages[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)[lead:lead + T - pad]
    return np.concatenate([slots, -np.ones(pad, np.int64)]).astype(np.int64)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_prompt_chunk_in_runs(tgt, kind):
    """Consecutive slots go out as runs of r rows per descriptor; skipped padding and a run
    crossing into the adjacent page included."""
    rng = np.random.default_rng(31)
    T, H, d, bs = 1024, 2, 64, 16
    cdt = FP8[tgt] if kind == "fp8" else BF16
    k, v, kc, vc, _ = _setup(rng, T, H, d, bs, cdt, spare=2.0)
    slots = _chunk_slots(rng, T, bs, kc.shape[0], pad=64)
    fp8 = kind == "fp8"
    assert segments(slots, H * d, 2, fp8) == [(0, 240, 4)]
    kw = dict(k_scale=0.02, v_scale=[0.02, 0.05]) if fp8 else {}
    kc0, vc0 = kc.copy(), vc.copy()
    kv_cache_append(k, v, kc, vc, slots, **kw)
    _check(kc, vc, kc0, vc0, *kv_cache_append_ref(k, v, kc0, vc0, slots, **kw), slots)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_mixed_step(tgt, kind):
    """A serving step: skipped padding, decode tokens (one slot each), a prompt chunk starting
    mid-page, more decodes: single-token and run segments in one launch."""
    rng = np.random.default_rng(43)
    H, d, bs, nb = 2, 64, 16, 200
    cdt = FP8[tgt] if kind == "fp8" else BF16
    chunk = _chunk_slots(rng, 1100, bs, 100, lead=5) + 100 * bs     # pages 100..199
    dec = rng.choice(100 * bs, 50, replace=False)                   # pages 0..99
    slots = np.concatenate([-np.ones(3, np.int64), dec[:20], -np.ones(4, np.int64), chunk,
                            dec[20:]])
    T = slots.size
    segs = segments(slots, H * d, 2, kind == "fp8")
    assert [r for _, _, r in segs] == [1, 8, 1]
    k, v, kc, vc, _ = _setup(rng, T, H, d, bs, cdt)
    kc, vc = (np.resize(x, (nb, bs, H, d)) for x in (kc, vc))
    kw = dict(k_scale=0.03, v_scale=0.01) if kind == "fp8" else {}
    kc0, vc0 = kc.copy(), vc.copy()
    kv_cache_append(k, v, kc, vc, slots, **kw)
    _check(kc, vc, kc0, vc0, *kv_cache_append_ref(k, v, kc0, vc0, slots, **kw), slots)


def test_segments():
    rng = np.random.default_rng(37)
    s = _chunk_slots(rng, 2048, 64, 80)
    assert segments(s, 1024) == [(0, 256, 8)]          # 16 KiB of bf16 per partition
    assert segments(s, 128) == [(0, 128, 16)]          # at least 128 runs
    assert segments(s, 1024, fp8=True) == [(0, 256, 8)]
    assert segments(s, 128, fp8=True) == [(0, 256, 8)]  # FP8: at least 129 runs (2 columns)
    assert segments(s[:300], 128, fp8=True) == [(0, 150, 2)]
    scattered = rng.permutation(4096)[:2048]
    assert segments(scattered, 128) == [(0, 2048, 1)]
    odd = _chunk_slots(rng, 2048, 64, 80, lead=3)      # starts at offset 3 of a page
    assert segments(odd, 128) == [(0, 5, 1), (5, 255, 8), (2045, 3, 1)]  # from offset 8
    hole = s.copy()
    hole[4:8] = -1                                     # a skipped run of 4 inside a page
    assert segments(hole, 1024) == [(0, 4, 1), (8, 255, 8)]  # the 4 skipped: not loaded
    pad = np.concatenate([-np.ones(9, np.int64), s[:200], -np.ones(20, np.int64)])
    assert segments(pad, 1024) == [(9, 200, 1)]        # < 128 runs of 2; pads dropped
    pad = np.concatenate([-np.ones(9, np.int64), s[:300], -np.ones(20, np.int64)])
    assert segments(pad, 1024) == [(9, 150, 2)]
    assert segments(np.array([-1, -1]), 128) == []


def _edge_values(dt, scale, top, n):
    """n values of dtype dt (both signs) around the saturation edge top * scale: every
    representable value from half to twice the edge (the rest of n: random)."""
    edge = np.array([top * scale], np.float64)
    lo = np.array(edge / 2, dt).view(np.uint16)[0]
    hi = np.array(edge * 2, dt).view(np.uint16)[0]
    vals = np.arange(lo, hi + 1, dtype=np.uint16).view(dt).astype(np.float32)
    vals = np.concatenate([vals, -vals])
    return np.resize(vals, n).astype(dt)


@pytest.mark.parametrize("in_dt", [BF16, np.dtype(np.float16)])
def test_fp8_saturation_edge(tgt, in_dt):
    """Every input value from half to twice the saturation edge x = max * scale, per head, with
    scales of very different sizes: the codes equal fp8(clip(x * (1 / scale))) exactly."""
    rng = np.random.default_rng(41)
    T, H, d = 128, 4, 64
    k_scales = np.array([3e-4, 0.0123, 0.77, 9.1], np.float32)
    v_scales = np.array([0.02, 0.02, 0.02, 0.02], np.float32)
    k, v, kc, vc, slots = _setup(rng, T, H, d, 16, FP8[tgt], in_dt)
    for h in range(H):
        k[:, h, :] = _edge_values(in_dt, k_scales[h], FP8_MAX[tgt], T * d).reshape(T, d)
    v[:, 0, :] = _edge_values(in_dt, v_scales[0], FP8_MAX[tgt], T * d).reshape(T, d)
    kc0, vc0 = kc.copy(), vc.copy()
    kv_cache_append(k, v, kc, vc, slots, k_scale=k_scales, v_scale=v_scales)
    _check(kc, vc, kc0, vc0, *kv_cache_append_ref(k, v, kc0, vc0, slots, k_scale=k_scales,
                                                  v_scale=v_scales), slots)
    got = kc.reshape(-1, H, d)[slots[slots >= 0]].astype(np.float32)
    assert np.all(np.isfinite(got)) and np.abs(got).max() == FP8_MAX[tgt]


@pytest.mark.parametrize("in_dt", [BF16, np.dtype(np.float16)])
@pytest.mark.parametrize("fp8", ["float8_e4m3", "float8_e4m3fn"])
def test_clamp_bound(in_dt, fp8):
    """B is the largest input value whose fp32 product with 1 / scale stays <= max, and that
    product rounds to max: the kernel never relies on how the FP8 cast treats overflow."""
    top = float(ml_dtypes.finfo(getattr(ml_dtypes, fp8)).max)
    f8 = getattr(ml_dtypes, fp8)
    for scale in (1e-4, 3e-4, 0.0123, 0.02, 0.77, 1.0, 9.1, 100.0):
        inv = np.float32(1) / np.float32(scale)
        B = _clamp_bound("op", "k_scale", inv, top, in_dt, fp8)
        nxt = (np.array([B], in_dt).view(np.uint16) + 1).view(in_dt).astype(np.float32)[0]
        assert np.float32(B) * inv <= top < nxt * inv or B == float(np.finfo(in_dt).max
                                                                   if in_dt != BF16 else
                                                                   ml_dtypes.finfo(BF16).max)
        assert float(np.array([np.float32(B) * inv]).astype(f8).astype(np.float32)[0]) == top
    with pytest.raises(ValueError, match=r"op: k_scale = .* is too small for float16 inputs"):
        _clamp_bound("op", "k_scale", np.float32(1e12), 448.0, np.float16, "float8_e4m3fn")


def test_power_of_two_scale_is_the_true_quotient(tgt):
    """With a power-of-two scale the reciprocal is exact: the codes are fp8(clip(x / s))."""
    rng = np.random.default_rng(7)
    k, v, kc, vc, slots = _setup(rng, 64, 4, 64, 16, FP8[tgt], skip=0.0)
    kv_cache_append(k, v, kc, vc, slots, k_scale=0.0078125, v_scale=[0.25, 0.5, 2.0, 4.0])
    top = FP8_MAX[tgt]
    wk = np.clip(k.astype(np.float32) / np.float32(0.0078125), -top, top).astype(FP8[tgt])
    s = np.array([0.25, 0.5, 2.0, 4.0], np.float32)[:, None]
    wv = np.clip(v.astype(np.float32) / s, -top, top).astype(FP8[tgt])
    assert np.array_equal(_bytes(kc.reshape(-1, 4, 64)[slots]), _bytes(wk))
    assert np.array_equal(_bytes(vc.reshape(-1, 4, 64)[slots]), _bytes(wv))


def test_nothing_to_write(tgt):
    rng = np.random.default_rng(9)
    for T, skip in ((0, 0.0), (5, 1.0)):
        k, v, kc, vc, slots = _setup(rng, T, 2, 64, 16, BF16, skip=skip)
        kc0, vc0 = kc.copy(), vc.copy()
        out = kv_cache_append(k, v, kc, vc, slots)
        assert out[0] is kc and np.array_equal(_bytes(kc), _bytes(kc0))
        assert np.array_equal(_bytes(vc), _bytes(vc0))


def test_list_and_int32_slots_and_views_of_k():
    """slot_mapping as a list or int32; k, v as strided views (the kernel gets copies)."""
    rng = np.random.default_rng(11)
    k, v, kc, vc, slots = _setup(rng, 40, 2, 64, 16, BF16)
    buf = np.zeros(k.shape + (2,), BF16)
    buf[..., 0] = k
    big = buf[..., 0]                                      # [T, 2, 64], element stride 2
    assert not big.flags.c_contiguous
    kc0, vc0 = kc.copy(), vc.copy()
    with target("trn3"):
        kv_cache_append(big, v, kc, vc, slots.astype(np.int32).tolist())
    _check(kc, vc, kc0, vc0, *kv_cache_append_ref(k, v, kc0, vc0, slots), slots)


def test_bytes_and_flops():
    assert bytes_kv_cache_append(10, 8, 128, 2, 1) == 2 * 10 * 1024 * 2 + 40 + 2 * 10 * 1024
    assert bytes_kv_cache_append(10, 8, 128, 2, 2, written=4) == 4 * 10 * 1024 + 40 + 4 * 4 * 1024
    assert flops_kv_cache_append(10, 8, 128) == 0


# ------------------------------------------------------------------------------------ torch
# torch has no float8_e4m3 (Trn2's FP8): that case is test_torch_op_trn2_fp8_as_uint8
@pytest.mark.parametrize("tgt, kind", [("trn2", "bf16"), ("trn3", "bf16"), ("trn3", "fp8")])
def test_torch_inputs_match_numpy(tgt, kind):
    torch = pytest.importorskip("torch")
    from nki_kernels.torch._convert import to_numpy
    with target(tgt):
        _torch_inputs_match_numpy(torch, to_numpy, tgt, kind)


def _torch_inputs_match_numpy(torch, to_numpy, tgt, kind):
    rng = np.random.default_rng(13)
    cdt = FP8[tgt] if kind == "fp8" else BF16
    k, v, kc, vc, slots = _setup(rng, 150, 4, 64, 32, cdt)
    kw = dict(k_scale=0.03, v_scale=[0.02, 0.03, 0.04, 0.05]) if kind == "fp8" else {}
    want_k, want_v = kc.copy(), vc.copy()
    kv_cache_append(k, v, want_k, want_v, slots, **kw)
    tk, tv, tkc, tvc = (to_torch(x.copy()) for x in (k, v, kc, vc))
    assert tkc.dtype == (torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn)
    out = kv_cache_append(tk, tv, tkc, tvc, torch.from_numpy(slots), **kw)
    assert out[0] is tkc and out[1] is tvc
    assert np.array_equal(_bytes(to_numpy(tkc)), _bytes(want_k))
    assert np.array_equal(_bytes(to_numpy(tvc)), _bytes(want_v))


def to_torch(a):
    from nki_kernels.torch._convert import to_torch as tt
    return tt(a)


def _torch_case(torch, seed, cache_dtype=BF16, T=45):
    rng = np.random.default_rng(seed)
    k, v, kc, vc, slots = _setup(rng, T, 2, 64, 16, cache_dtype)
    return [to_torch(x.copy()) for x in (k, v, kc, vc)] + [torch.from_numpy(slots)], \
        (k, v, kc, vc, slots)


def test_torch_op_eager_and_compiled():
    """torch.ops.nki_kernels.kv_cache_append mutates its cache arguments (schema ``Tensor(a!)``):
    eager, and inside torch.compile(fullgraph=True), both write the NumPy API's bytes."""
    torch = pytest.importorskip("torch")
    import nki_kernels.torch as nkt
    from nki_kernels.torch._convert import to_numpy
    (tk, tv, tkc, tvc, ts), (k, v, kc, vc, slots) = _torch_case(torch, 17)
    want_k, want_v = kc.copy(), vc.copy()
    with target("trn3"):
        kv_cache_append(k, v, want_k, want_v, slots)
        out = nkt.kv_cache_append(tk, tv, tkc, tvc, ts)
        assert out[0] is tkc and out[1] is tvc
        assert np.array_equal(_bytes(to_numpy(tkc)), _bytes(want_k))
        assert np.array_equal(_bytes(to_numpy(tvc)), _bytes(want_v))

        def step(k, v, kc, vc, s):
            torch.ops.nki_kernels.kv_cache_append(k, v, kc, vc, s)
            return k * 2

        ck, cv = (to_torch(x.copy()) for x in (kc, vc))
        torch._dynamo.reset()
        out = torch.compile(step, fullgraph=True, backend="aot_eager")(tk, tv, ck, cv, ts)
        assert torch.equal(out, tk * 2)
        assert np.array_equal(_bytes(to_numpy(ck)), _bytes(want_k))
        assert np.array_equal(_bytes(to_numpy(cv)), _bytes(want_v))


def test_torch_op_trn2_fp8_as_uint8():
    """Trn2's float8_e4m3 travels as uint8 bits through the torch op (torch has no such dtype)."""
    torch = pytest.importorskip("torch")
    import nki_kernels.torch as nkt
    rng = np.random.default_rng(19)
    k, v, kc, vc, slots = _setup(rng, 60, 2, 64, 16, FP8["trn2"])
    with target("trn2"):
        want_k, want_v = kc.copy(), vc.copy()
        kv_cache_append(k, v, want_k, want_v, slots, k_scale=0.05, v_scale=0.07)
        tkc, tvc = (torch.from_numpy(x.view(np.uint8).copy()) for x in (kc, vc))
        nkt.kv_cache_append(to_torch(k), to_torch(v), tkc, tvc, slots, k_scale=0.05,
                            v_scale=0.07)
    assert np.array_equal(tkc.numpy(), _bytes(want_k))
    assert np.array_equal(tvc.numpy(), _bytes(want_v))


def test_torch_reference_implementation():
    """NKI_KERNELS_TORCH_IMPL=reference writes the reference's bytes in place (here the same)."""
    torch = pytest.importorskip("torch")
    import nki_kernels.torch as nkt
    from nki_kernels.torch._convert import to_numpy
    (tk, tv, tkc, tvc, ts), (k, v, kc, vc, slots) = _torch_case(torch, 23)
    want_k, want_v = kv_cache_append_ref(k, v, kc, vc, slots)
    with nkt.implementation("reference"):
        nkt.kv_cache_append(tk, tv, tkc, tvc, ts)
    assert np.array_equal(_bytes(to_numpy(tkc)), _bytes(want_k))
    assert np.array_equal(_bytes(to_numpy(tvc)), _bytes(want_v))


# --------------------------------------------------------------------------------- refusals
def _args(**over):
    rng = np.random.default_rng(29)
    k, v, kc, vc, slots = _setup(rng, 8, 2, 64, 16, BF16, skip=0.0)
    a = dict(k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    a.update(over)
    return a


def _fp8_cache(shape=(2, 16, 2, 64)):
    return np.zeros(shape, FP8["trn3"])


_RO = np.zeros((2, 16, 2, 64), BF16)
_RO.flags.writeable = False

BAD = [
    (dict(slot_mapping=np.arange(7)), ValueError, r"slot_mapping must have shape \(8,\)"),
    (dict(slot_mapping=np.array([0, 1, 2, 3, 4, 5, 6, 32])), ValueError,
     r"slot_mapping values must be -1 \(skip\) or slots in \[0, 32\).*got \[32\]"),
    (dict(slot_mapping=np.array([0, 1, 2, 3, 4, 5, 6, -2])), ValueError,
     r"values must be -1 \(skip\) or slots.*got \[-2\]"),
    (dict(slot_mapping=np.array([0, 1, 2, 3, 4, 5, 6, 3])), ValueError,
     r"duplicated slots \[3\]"),
    (dict(slot_mapping=np.arange(8.0)), TypeError, r"slot_mapping must be an integer array"),
    (dict(v=np.zeros((8, 2, 64), np.float16)), TypeError,
     r"k and v must share one dtype of bfloat16, float16; got bfloat16 and float16"),
    (dict(k=np.zeros((8, 2, 64), np.float32), v=np.zeros((8, 2, 64), np.float32)), TypeError,
     r"got float32 and float32"),
    (dict(k_cache=np.zeros((2, 16, 2, 64), np.float16), v_cache=np.zeros((2, 16, 2, 64),
                                                                         np.float16)),
     TypeError, r"k_cache and v_cache must both be bfloat16 \(k's dtype\) or float8_e4m3fn"),
    (dict(k_cache=np.zeros((2, 16, 2, 64), FP8["trn2"]), v_cache=np.zeros((2, 16, 2, 64),
                                                                          FP8["trn2"])),
     TypeError, r"or float8_e4m3fn \(FP8 on this target\); got float8_e4m3 and float8_e4m3"),
    (dict(v_cache=_fp8_cache()), TypeError, r"got bfloat16 and float8_e4m3fn"),
    (dict(v=np.zeros((8, 2, 32), BF16)), ValueError, r"k and v must have the same shape"),
    (dict(k_cache=np.zeros((2, 16, 4, 64), BF16), v_cache=np.zeros((2, 16, 4, 64), BF16)),
     ValueError, r"the caches' \[H_kv, d\] must equal k's \(2, 64\); got \(4, 64\)"),
    (dict(v_cache=np.zeros((3, 16, 2, 64), BF16)), ValueError,
     r"k_cache and v_cache must have the same shape"),
    (dict(k=np.zeros((8, 128), BF16)), ValueError, r"k must be a 3-D array \[T, H_kv, d\]"),
    (dict(k_cache=np.zeros((32, 2, 64), BF16)), ValueError,
     r"k_cache must be a 4-D array \[num_blocks, block_size, H_kv, d\]"),
    (dict(k=np.zeros((8, 64, 128), BF16), v=np.zeros((8, 64, 128), BF16),
          k_cache=np.zeros((1, 1, 64, 128), BF16), v_cache=np.zeros((1, 1, 64, 128), BF16),
          slot_mapping=-np.ones(8, np.int64)),
     ValueError, r"H_kv \* d must be at most 4096 elements per token; got 64 \* 128 = 8192"),
    (dict(k_scale=0.5), ValueError, r"k_scale / v_scale apply to FP8 caches only"),
    (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), v_scale=0.1), ValueError,
     r"k_scale is required for an FP8 cache"),
    (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), k_scale=-1.0, v_scale=0.1), ValueError,
     r"k_scale must be finite and > 0; got \[-1.0\]"),
    (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), k_scale=0.1, v_scale=[0.1, 0.2, 0.3]),
     ValueError, r"v_scale must be a scalar or have H_kv = 2 values"),
    (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), k_scale=float("nan"), v_scale=0.1),
     ValueError, r"k_scale must be finite and > 0"),
    (dict(k_cache=_fp8_cache(), v_cache=_fp8_cache(), k_scale=1e-45, v_scale=0.1), ValueError,
     r"k_scale must be a positive float32 whose reciprocal is finite"),
    (dict(k_cache=_RO), ValueError, r"k_cache is read-only"),
    (dict(v_cache=np.zeros((2, 16, 2, 128), BF16)[..., ::2]), ValueError,
     r"v_cache must be C-contiguous"),
    (dict(k_cache=[[0]]), ValueError, r"k_cache must be a 4-D array"),
]


@pytest.mark.parametrize("over, err, msg", BAD)
def test_bad_input(over, err, msg):
    a = _args(**over)
    kc, vc = a["k_cache"], a["v_cache"]
    before = [x.copy() for x in (kc, vc) if isinstance(x, np.ndarray)]
    with target("trn3"), pytest.raises(err, match=r"kv_cache_append: .*" + msg):
        kv_cache_append(a.pop("k"), a.pop("v"), a.pop("k_cache"), a.pop("v_cache"),
                        a.pop("slot_mapping"), **a)
    after = [x for x in (kc, vc) if isinstance(x, np.ndarray)]
    for b, x in zip(before, after):          # refused before anything was written
        assert np.array_equal(_bytes(b), _bytes(x))


def test_same_array_for_both_caches():
    a = _args()
    with target("trn3"), pytest.raises(ValueError, match=r"kv_cache_append: k_cache and "
                                                         r"v_cache must be distinct arrays"):
        kv_cache_append(a["k"], a["v"], a["k_cache"], a["k_cache"], a["slot_mapping"])


def test_wrong_target():
    a = _args()
    with target("trn1"), pytest.raises(ValueError, match=r"kv_cache_append: target trn1 is not "
                                                         r"supported; supported targets: trn2, trn3"):
        kv_cache_append(a["k"], a["v"], a["k_cache"], a["v_cache"], a["slot_mapping"])


def test_too_many_tokens():
    big = np.zeros((65537, 1, 1), BF16)
    with target("trn3"), pytest.raises(ValueError, match=r"kv_cache_append: at most 65536 "
                                                         r"tokens per call; got T = 65537"):
        kv_cache_append(big, big, np.zeros((1, 16, 1, 1), BF16), np.zeros((1, 16, 1, 1), BF16),
                        np.zeros(65537, np.int64))
