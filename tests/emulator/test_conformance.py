"""The emulator as a drop-in NKI CPU simulator: NumPy-compatible dtypes, NKI versions, the module
table, outputs aliasing inputs, and the runner for a project's own pytest suite."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import nki_kernels.emulator as emu
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import jit, versions
from nki_kernels.emulator import language as nl
from nki_kernels.emulator.errors import NkiValidationError


# ------------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("d, name", [(nl.float32, "float32"), (nl.bfloat16, "bfloat16"),
                                     (nl.float16, "float16"), (nl.int32, "int32"),
                                     (nl.float8_e4m3, "float8_e4m3"), (nl.uint8, "uint8")])
def test_nl_dtypes_are_numpy_dtypes(d, name):
    assert str(d) == name
    assert np.dtype(d) == np.dtype(name)
    a = np.zeros((2, 3), dtype=d)
    assert a.dtype == np.dtype(name) and a.dtype == d
    assert np.ones(3, np.float32).astype(d).dtype == np.dtype(name)


def test_dtype_equality_is_by_kind_not_by_container():
    assert nl.float32 == np.float32 and nl.float32 != nl.tfloat32
    assert nl.bfloat16 == "bfloat16" and nl.bfloat16 != nl.float16
    assert {nl.float32: 1}[nl.float32] == 1
    assert f"{nl.bfloat16}" == "nl.bfloat16"       # the emulator's messages keep the nl. prefix


def test_x4_host_arrays_keep_their_mx_type():
    a = np.zeros((4, 2), dtype=nl.float8_e4m3fn_x4)
    assert a.dtype.itemsize == 4 and a.dtype.metadata["nki_dtype"] == "float8_e4m3fn_x4"
    from nki_kernels.emulator import runtime as rt
    from nki_kernels.emulator.tensor import hbm_tensor
    assert hbm_tensor(a, rt.hbm, "a").dtype is nl.float8_e4m3fn_x4
    assert hbm_tensor(np.zeros((4, 2), np.uint32), rt.hbm, "b").dtype is nl.uint32


def test_x4_host_dtype_is_named_and_survives_numpy():
    # NKI Library's harness keeps x4 inputs as NumPy when 'x4' is in str(arr.dtype), its MX
    # goldens look the dtype up in a dict keyed by nl dtypes, and its input generators
    # np.concatenate per-batch x4 arrays: all three must keep the type
    a = np.zeros((2, 4), dtype=nl.float4_e2m1fn_x4)
    assert "float4_e2m1fn_x4" in str(a.dtype) and a.dtype.itemsize == 2
    assert {nl.float4_e2m1fn_x4: 1, nl.float8_e5m2_x4: 2}.get(a.dtype) == 1
    assert a.dtype == nl.float4_e2m1fn_x4 and a.dtype != nl.float8_e5m2_x4
    for b in (np.concatenate([a, a]), np.stack([a, a]), a.T.copy(), np.zeros_like(a)):
        assert b.dtype == a.dtype and b.dtype.metadata == a.dtype.metadata
    assert a.view(np.uint16).dtype == np.uint16         # the packed words


def test_x4_outputs_reach_the_host_as_x4():
    @emu.jit
    def k(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    words = np.arange(1, 9, dtype=np.uint32).reshape(2, 4)
    x = np.concatenate([words[:1], words[1:]]).view(nl.float8_e5m2_x4.dtype)
    with emu.target("trn3"):
        out = k(x)
    assert out.dtype == nl.float8_e5m2_x4
    np.testing.assert_array_equal(out.view(np.uint32), words)
    # NKI Library's harness casts every output to its golden's dtype; its MX goldens hold the
    # packed words viewed as float32: the cast keeps the bits
    np.testing.assert_array_equal(np.asarray(out, dtype=np.float32).view(np.uint32), words)


def test_fresh_x4_storage_holds_the_integer_sentinel():
    # x4 types are uint containers: the simulator's integer sentinel 4, not an fp8 NaN code
    @emu.jit
    def k(x):
        t = nl.ndarray(x.shape, nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        out = nl.ndarray(x.shape, nl.float8_e4m3fn_x4, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    with emu.target("trn3"):
        out = k(np.zeros((4, 2), np.uint32))
    np.testing.assert_array_equal(out.view(np.uint32), np.full((4, 2), 4, np.uint32))


# ------------------------------------------------------------------------------------------ versions
def test_version_default_and_selection(monkeypatch):
    monkeypatch.delenv(versions.ENV, raising=False)
    assert versions.current() == "0.7"
    monkeypatch.setenv(versions.ENV, "0.3")
    assert versions.current() == "0.3"
    with versions.nki_version("0.6"):
        assert versions.current() == "0.6"
    with pytest.raises(ValueError, match="0.9.*supported: 0.3"):
        versions.set_version("0.9")


def _dma_int_enum():
    src = nl.ndarray((4, 8), nl.float32, buffer=nl.hbm)
    dst = nl.ndarray((4, 8), nl.float32)
    nisa.dma_copy(dst=dst, src=src, dge_mode=3)
    return dst


def _run(fn):
    @jit
    def k(x):
        fn()
        return None
    return k(np.zeros((1, 1), np.float32))


def test_integer_enums_removed_in_07_deprecated_in_03():
    with versions.nki_version("0.7"):
        with pytest.raises(NkiValidationError, match=r"integer enum values are rejected \(removed "
                                                     r"in NKI 0.7"):
            _run(_dma_int_enum)
    with versions.nki_version("0.3"):
        with pytest.warns(DeprecationWarning, match="integer enum values deprecated in NKI 0.3"):
            _run(_dma_int_enum)


def test_jit_mode_trace_under_03_warns_and_runs():
    with versions.nki_version("0.3"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            k = jit(mode="trace")(lambda x: None)
        assert k(np.zeros((1, 1), np.float32)) is None
    with pytest.raises(NkiValidationError, match=r"mode=\.\.\.\) removed in NKI 0.7"):
        jit(mode="trace")(lambda x: None)


def test_lnc2_programs_follow_the_callers_version(monkeypatch):
    """The programs of an LNC=2 launch run in threads of their own: each follows the version set
    around the call (a thread-local nki_version, as the --vs-nkilib bench sets 0.3)."""
    monkeypatch.delenv(versions.ENV, raising=False)
    seen = []

    @jit
    def k(x):
        seen.append(versions.current())
        return None

    with versions.nki_version("0.3"):
        k[2](np.zeros((1, 1), np.float32))
    k[2](np.zeros((1, 1), np.float32))
    assert seen == ["0.3", "0.3", "0.7", "0.7"]


def test_string_dtype_only_before_07():
    with versions.nki_version("0.3"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            _run(lambda: nl.ndarray((4, 8), dtype="float32"))
    with pytest.raises(TypeError, match="not accepted inside kernels since NKI 0.7"):
        _run(lambda: nl.ndarray((4, 8), dtype="float32"))


# ------------------------------------------------------------------------------------------ modules
def test_retired_neuronxcc_namespace_gives_one_clear_error():
    code = textwrap.dedent("""
        import nki_kernels.emulator as e
        e.install(force=True)
        try:
            import neuronxcc.nki.language
        except ImportError as x:
            print(x)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "neuronxcc.nki namespace (NKI Beta 1) is retired" in out
    assert "migration guide" in out


def test_module_table_covers_the_harness_imports():
    table = emu._module_table()
    for name in ("nki", "nki.language", "nki.language.dtypes", "nki.dtype", "nki.isa",
                 "nki.isa.constants", "nki.compiler", "nki.typing", "nki.tensor", "nki.builtin",
                 "nki.collectives"):
        assert name in table
    assert table["nki.language.dtypes"].bfloat16 is nl.bfloat16
    assert emu.collectives.rank_id() == 0
    with pytest.raises(NotImplementedError, match="all_to_all_v"):
        emu.collectives.all_to_all_v()


def test_import_nki_dtype_as_module_names_the_dtypes():
    """NKI Library writes ``import nki.dtype as nt; nt.float8_e4m3`` (qkv_tkg's static quant):
    ``import a.b as c`` binds the package attribute ``nki.dtype``, which is also the dtype
    (annotation) class; it must carry every dtype name and stay the class of the dtypes."""
    code = textwrap.dedent("""
        import nki_kernels.emulator as emu
        emu.install(force=True)
        import nki.dtype as nt
        import nki.language as nl
        print(nt.float8_e4m3 is nl.float8_e4m3, nt.bfloat16 is nl.bfloat16,
              isinstance(nl.int32, nt))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr[-2000:]


# ------------------------------------------------------------------------------------------ outputs
def _rope_like(x, out):
    t = nl.ndarray(x.shape, x.dtype)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_returning_an_input_written_in_place():
    k = jit(_rope_like)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = np.zeros_like(x)
    r = k(x, out)
    np.testing.assert_array_equal(r, 2 * x)
    np.testing.assert_array_equal(out, 2 * x)


def test_returning_private_hbm_or_sbuf_stays_an_error():
    def private(x):
        o = nl.ndarray(x.shape, x.dtype, buffer=nl.private_hbm)
        nisa.dma_copy(dst=o, src=x)
        return o

    def sbuf(x):
        o = nl.ndarray(x.shape, x.dtype)
        nisa.dma_copy(dst=o, src=x)
        return o
    for fn, where in ((private, "private_hbm"), (sbuf, "sbuf")):
        with pytest.raises(NkiValidationError, match=f"is in {where}; kernel outputs must"):
            jit(fn)(np.ones((4, 8), np.float32))


def test_cpu_simulate_spelling():
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    r = emu.cpu_simulate(_rope_like)[1](x=x, out=np.zeros_like(x))
    np.testing.assert_array_equal(r, 2 * x)


# ------------------------------------------------------------------------------------------ runner
def test_runner_runs_a_projects_suite_with_the_standins(tmp_path, monkeypatch):
    log = tmp_path / "times.tsv"
    monkeypatch.setenv("NKI_SUITE_TIMES", str(log))
    (tmp_path / "test_k.py").write_text(textwrap.dedent("""
        import time
        import numpy as np
        import neuron_dtypes as dt
        import nki, nki.language as nl, nki.isa as nisa
        from nki_cpu_simulator.nki.language import dtypes as sim_dtypes

        @nki.jit
        def double(x):
            out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray(x.shape, x.dtype)
            nisa.dma_copy(dst=t, src=x)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
            nisa.dma_copy(dst=out, src=t)
            return out

        def test_double():
            x = dt.static_cast(np.arange(16, dtype=np.float32).reshape(2, 8), nl.bfloat16)
            assert x.dtype == np.dtype("bfloat16") and sim_dtypes.bfloat16 is nl.bfloat16
            r = nki.cpu_simulate(double)[1](x=x)
            assert np.array_equal(r.astype(np.float32), 2 * x.astype(np.float32))
            time.sleep(0.3)                      # harness time, outside the kernel
    """))
    from nki_kernels.emulator.pytest_plugin import main
    rc = main([str(tmp_path), "--nki-version", "0.3", "--", "-q", "-p", "no:cacheprovider",
               "test_k.py"])
    assert rc == 0
    # the log: node, phase, outcome, wall s, message, CPU s, emulator s (the kernel's share)
    (line,) = [ln.split("\t") for ln in log.read_text().splitlines()]
    assert line[0].endswith("test_double") and line[1:3] == ["call", "passed"]
    wall, emu = float(line[3]), float(line[6])
    assert 0 < emu < 0.3 <= wall


def test_runner_runs_every_rank_of_a_collective_test(tmp_path, monkeypatch):
    """The harness's simulation path runs one rank; the runner's patch runs all ranks of a test
    with collective_ranks > 1 and writes each rank's outputs to output_worker_<rank>/ (a minimal
    harness of the same shape, written here)."""
    pkg = tmp_path / "fakeh" / "utils"
    pkg.mkdir(parents=True)
    (tmp_path / "fakeh" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "simulation_setup.py").write_text(textwrap.dedent("""
        from nki_kernels.emulator import cpu_simulate
        def simulate_kernel(kernel_func, kernel_input, lnc_count):
            out = cpu_simulate(kernel_func)[lnc_count](**kernel_input)
            return list(out) if isinstance(out, (list, tuple)) else [out]
        def normalize_golden_output(golden, rank_id=0):
            return golden.for_rank(rank_id) if hasattr(golden, "for_rank") else golden
    """))
    (pkg / "test_orchestrator.py").write_text(textwrap.dedent("""
        import os
        import numpy as np
        INF_ARTIFACT_DIR_NAME = "infer_result"
        class InferenceException(Exception):
            pass
        class Orchestrator:
            def _run_simulator_inference(self, kut):
                raise AssertionError("single-rank path")
            def __dump_tensors__(self, d, tensors, name_fn):
                os.makedirs(d, exist_ok=True)
                for n, v in tensors.items():
                    np.save(os.path.join(d, name_fn(n) + ".npy"), v)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import types

    from nki_kernels.emulator import collectives as cc
    from nki_kernels.emulator.pytest_plugin import _patch_harness_bugs
    mod = importlib.import_module("fakeh.utils.test_orchestrator")
    _patch_harness_bugs()
    assert getattr(mod.Orchestrator._run_simulator_inference, "_nki_kernels_ranks", False)

    @jit
    def gather(x, rg):
        src = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm, name="src")
        dst = nl.ndarray((2 * x.shape[0], x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm,
                         name="dst")
        nisa.dma_copy(dst=src, src=x)
        cc.all_gather([src], [dst], rg, 0)
        return dst

    xs = [np.full((4, 8), r + 1, np.float32) for r in range(2)]
    rg = cc.ReplicaGroup([[0, 1]])

    class PerRank:
        def __init__(self, f):
            self.for_rank = f
    kut = types.SimpleNamespace(
        kernel_func=gather,
        kernel_input=PerRank(lambda r: {"x": xs[r], "rg": rg}),
        inference_args=types.SimpleNamespace(collective_ranks=2),
        compiler_input=types.SimpleNamespace(
            logical_nc_config=1, platform_target=types.SimpleNamespace(get_nc_gen=lambda: "gen3")),
        validation_args=types.SimpleNamespace(
            golden_output=PerRank(lambda r: {"out": np.zeros((8, 8), np.float32)})))
    orch = mod.Orchestrator()
    orch.fs_config = types.SimpleNamespace(artifacts_output_directory_path=str(tmp_path / "a"))
    monkeypatch.setenv("NKI_NC_VERSION", "gen3")
    out = orch._run_simulator_inference(kut)
    for r in range(2):
        got = np.load(os.path.join(out, f"output_worker_{r}", "out.npy"))
        np.testing.assert_array_equal(got, np.concatenate(xs, 0))


def test_neuron_dtypes_standin_packs_mx():
    from nki_kernels.emulator.pytest_plugin import static_cast
    v = np.array([[0.5, -1.0, 2.0, 448.0, 0.0, 1.5, -0.25, 3.0]], np.float32)
    packed = static_cast(v, nl.float8_e4m3fn_x4)
    assert packed.shape == (1, 2) and packed.dtype.itemsize == 4
    np.testing.assert_array_equal(static_cast(packed, np.float32), v)


# ------------------------------------------------------------------------------------------ nl ops
def test_getting_started_style_kernel_runs():
    @jit
    def add_kernel(a, b):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        x = nl.load(a)
        y = nl.load(b)
        nl.store(out, nl.add(x, y))
        return out
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    np.testing.assert_array_equal(add_kernel(a, 2 * a), 3 * a)


def test_convenience_math_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    y = rng.standard_normal((16, 24)).astype(np.float32)

    @jit
    def k(x, y):
        o1 = nl.ndarray((16, 32), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((32, 24), nl.float32, buffer=nl.shared_hbm)
        o3 = nl.ndarray((16, 1), nl.float32, buffer=nl.shared_hbm)
        o4 = nl.ndarray((32, 16), nl.float32, buffer=nl.shared_hbm)
        o5 = nl.ndarray((16, 32), nl.float32, buffer=nl.shared_hbm)
        xt, yt = nl.load(x), nl.load(y)
        nl.store(o1, nl.multiply(nl.exp(xt), 2.0))
        nl.store(o2, nl.matmul(xt, yt, transpose_x=True))
        nl.store(o3, nl.max(xt, axis=1, keepdims=True))
        nl.store(o4, nl.transpose(xt))
        nl.store(o5, nl.broadcast_to(nl.sum(xt, axis=1, keepdims=True), (16, 32)))
        return o1, o2, o3, o4, o5
    o1, o2, o3, o4, o5 = k(x, y)
    np.testing.assert_allclose(o1, 2 * np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(o2, x.T @ y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(o3, x.max(axis=1, keepdims=True))
    np.testing.assert_array_equal(o4, x.T)
    np.testing.assert_allclose(o5, np.broadcast_to(x.sum(axis=1, keepdims=True), (16, 32)),
                               rtol=1e-5, atol=1e-5)


def test_broadcast_to_rejects_incompatible_shapes():
    def body():
        nl.broadcast_to(nl.ndarray((4, 3), nl.float32), (4, 6))
    with pytest.raises(NkiValidationError, match=r"cannot broadcast \(4, 3\) to \(4, 6\)"):
        _run(body)


# ------------------------------------------------------------------------------------------ misc
def test_dataclass_nkiobject_takes_unannotated_attributes_as_fields():
    from dataclasses import dataclass

    @dataclass
    class Params(nl.NKIObject):
        n: int = 1
        tile = None
        flags = [1]

    p = Params(n=2, tile=5)
    assert (p.n, p.tile, p.flags) == (2, 5, [1]) and Params().flags is not p.flags


def test_plain_nkiobject_subclass_is_built_from_its_fields():
    # nki-spec 3.2: @dataclass is optional on NKIObject subclasses (NKI Library's moe_cte
    # OutputTensors is a plain annotated subclass built with keywords)
    class Outs(nl.NKIObject):
        output: object
        gate_up: object = None
        flags = [1]

        def rows(self):
            return 1

    a = Outs(output=3, gate_up=4)
    b = Outs(5)
    assert (a.output, a.gate_up, b.output, b.gate_up, a.rows()) == (3, 4, 5, None, 1)
    assert a.flags == [1] and a.flags is not b.flags
    with pytest.raises(TypeError, match="unexpected keyword argument 'down'"):
        Outs(output=1, down=2)
    with pytest.raises(TypeError, match="missing required argument 'output'"):
        Outs(gate_up=1)
    with pytest.raises(TypeError, match="takes 3 positional arguments but 4 were given"):
        Outs(1, 2, 3, 4)


def test_nkiobject_field_left_unset_under_the_parser_front_end():
    # NKI 0.3-0.6 (parser): a dataclass field the constructor is not given stays unset (NKI
    # Library's mlp_tkg constants, measured on devices); NKI 0.7 (Python tracer) refuses the call
    from dataclasses import dataclass

    @dataclass
    class Dims(nl.NKIObject):
        T: int
        unused: int
        K: object = None

    with versions.nki_version("0.3"):
        d = Dims(T=4, K=2)
        assert (d.T, d.K) == (4, 2)
        with pytest.raises(AttributeError, match="unused"):
            assert d.unused is None  # never reached
        with pytest.raises(TypeError, match="unexpected keyword argument 'E'"):
            Dims(T=1, E=2)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'unused'"):
        Dims(T=4)


def test_compiler_frontend_traces_by_running_on_the_emulator():
    # NKI Library's trace_only tests: ParserFrontend().compile(kernel, inputs=, target=, lnc=)
    import importlib

    emu.install(force=True)
    fe = importlib.import_module("nki.compiler.frontend")

    @jit
    def copy(a):
        o = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=o, src=t)
        return o

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    r = fe.ParserFrontend().compile(copy, inputs={"a": x}, target="trn2", lnc=1)
    assert r.module is None and np.array_equal(r.outputs, x)
    with pytest.raises(NkiValidationError, match="partition"):
        fe.TracerFrontend().compile(copy, inputs={"a": np.zeros((200, 4), np.float32)},
                                    target="trn3")


def test_memset_integral_float_on_int_tile():
    def body():
        t = nl.ndarray((4, 8), nl.uint32)
        nisa.memset(dst=t, value=0.0)
        with pytest.raises(NkiValidationError, match="must be an int for the integer dtype"):
            nisa.memset(dst=t, value=0.5)
    _run(body)


def test_dynamic_range_by_version():
    def body():
        for _i in nl.dynamic_range(0, 3):
            nl.ndarray((1, 1), nl.int32)
    with versions.nki_version("0.6"):
        with pytest.warns(DeprecationWarning, match="deprecated in NKI 0.6"):
            _run(body)
    with pytest.raises(NkiValidationError, match="nl.dynamic_range removed in NKI 0.7"):
        _run(body)
    assert list(nl.range(3)) == [0, 1, 2]


def _step(reg, cnt, acc):
    nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1)
    nisa.tensor_scalar(dst=cnt, data=cnt, op0=nl.subtract, operand0=1)
    nisa.register_load(reg, cnt)


def _drain(reg, cnt, acc):
    """A ``while reg:`` that ends its function (CPython repeats the return after the loop, so the
    loop's exit jump does not land right after its backward jump; NKI Library's MX moe_cte)."""
    while reg:
        _step(reg, cnt, acc)


@jit
def _count_down(x, tail=False):
    """``while reg:`` (NKI 0.3-0.5): the body runs while the register is not 0, the register
    reloaded at the end of each iteration; the output counts the iterations. ``tail``: the loop
    ends a helper function."""
    out = nl.ndarray((1, 4), nl.int32, buffer=nl.shared_hbm)
    cnt = nl.ndarray((1, 1), nl.int32)
    nisa.dma_copy(dst=cnt, src=x)
    acc = nl.ndarray((1, 4), nl.int32)
    nisa.memset(dst=acc, value=0)
    reg = nisa.register_alloc()
    nisa.register_load(reg, cnt)
    if tail:
        _drain(reg, cnt, acc)
    else:
        while reg:
            _step(reg, cnt, acc)
    nisa.dma_copy(dst=out, src=acc)
    return out


@jit
def _if_register(x):
    cnt = nl.ndarray((1, 1), nl.int32)
    nisa.dma_copy(dst=cnt, src=x)
    reg = nisa.register_alloc()
    nisa.register_load(reg, cnt)
    if reg:
        nisa.memset(dst=cnt, value=0)
    return None


def test_while_register_by_version():
    """``while reg:`` runs under NKI 0.3-0.5 (NKI Library's MX moe_cte dynamic-block loop), warns
    under 0.6, is refused under 0.7 naming nl.while_loop; ``if reg:`` is refused at every
    version (a register's value is unknown while the kernel is specialised)."""
    x = np.array([[3]], np.int32)
    with versions.nki_version("0.3"):
        assert np.asarray(_count_down(x)).tolist() == [[3, 3, 3, 3]]
        assert np.asarray(_count_down(np.zeros((1, 1), np.int32))).tolist() == [[0, 0, 0, 0]]
        assert np.asarray(_count_down(x, tail=True)).tolist() == [[3, 3, 3, 3]]
        with pytest.raises(TypeError, match="cannot be used in Python conditions"):
            _if_register(x)
    with versions.nki_version("0.6"):
        with pytest.warns(DeprecationWarning, match="while reg: deprecated in NKI 0.6"):
            assert np.asarray(_count_down(x)).tolist() == [[3, 3, 3, 3]]
    with pytest.raises(TypeError, match="while reg: removed in NKI 0.7.*nl.while_loop"):
        _count_down(x)


def test_unused_sbuf_buffers_take_no_space():
    """SBUF by liveness: 8 never-used 120 KB-per-partition buffers beside two used ones fit."""
    @jit
    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        spare = [nl.ndarray((128, 30000), nl.float32) for _ in range(8)]  # noqa: F841
        t = nl.ndarray(x.shape, x.dtype)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out
    x = np.ones((128, 64), np.float32)
    with emu.target("trn2"):
        np.testing.assert_array_equal(k(x), x)


def test_tiles_past_their_last_use_free_their_space():
    """The compiler frees a tile after its last use. A small PSUM tile (and a big SBUF one) still
    bound to a Python name but never used again must not keep eight full PSUM banks (or a second
    big SBUF buffer) from fitting: NKI Library's moe_tkg allocates 8 banks after an earlier
    128-byte PSUM tile."""
    @jit
    def k(x):
        out = nl.ndarray((128, 512), x.dtype, buffer=nl.shared_hbm)
        small = nl.ndarray((128, 32), nl.float32, buffer=nl.psum)
        nisa.memset(small, 0.0)                      # used once, then dead (still bound)
        big = nl.ndarray((128, 30000), nl.float32)
        nisa.memset(big, 0.0)                        # 120 KB per partition, dead after this
        big2 = nl.ndarray((128, 30000), nl.float32)  # does not fit beside big: big was dead
        nisa.memset(big2, 1.0)
        banks = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
        t = nl.ndarray((128, 512), x.dtype)
        nisa.dma_copy(dst=t, src=x)
        for b in banks:
            nisa.tensor_copy(dst=b, src=t)
        acc = nl.ndarray((128, 512), x.dtype)
        nisa.tensor_copy(dst=acc, src=banks[0])
        for b in banks[1:]:
            nisa.tensor_tensor(dst=acc, data1=acc, data2=b, op=nl.add)
        nisa.dma_copy(dst=out, src=acc)
        return out
    x = np.ones((128, 512), np.float32)
    with emu.target("trn2"):
        np.testing.assert_array_equal(k(x), 8 * x)

    @jit
    def still_live(x):
        small = nl.ndarray((128, 32), nl.float32, buffer=nl.psum, name="small")
        nisa.memset(small, 0.0)
        banks = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, name=f"b{i}") for i in range(8)]
        for b in banks:
            nisa.memset(b, 0.0)
        nisa.memset(small, 1.0)                      # small was live after all: 8 banks + it
    with emu.target("trn2"), pytest.raises(
            NkiValidationError, match=r"'small' \(psum\) allocated at test_conformance.py:\d+ is used "
                                      r"after its space was reused: its space went to 'b7' "
                                      r"allocated at test_conformance.py:\d+, which did not fit "
                                      r"beside the live psum tiles"):
        still_live(x)


def test_lnc2_programs_interleave_on_shared_hbm():
    """Both programs zero-fill the whole shared output, then each stores its half: running the
    cores side by side (not program 0 to its end first) keeps both halves."""
    @jit
    def k(x):
        n = x.shape[0]
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        z = nl.ndarray((n, x.shape[1]), x.dtype)
        nisa.memset(z, 0.0)
        nisa.dma_copy(dst=out, src=z)
        half = n // 2
        pid = nl.program_id(0)
        t = nl.ndarray((half, x.shape[1]), x.dtype)
        nisa.dma_copy(dst=t, src=x[pid * half:(pid + 1) * half, :])
        nisa.dma_copy(dst=out[pid * half:(pid + 1) * half, :], src=t)
        return out
    x = np.arange(64, dtype=np.float32).reshape(8, 8) + 1
    with emu.target("trn2"):
        np.testing.assert_array_equal(k[2](x), x)


def test_quantize_mx_scale_follows_the_version():
    """NKI 0.3/0.4: the OCP scale 2^(floor(log2 amax) - Emax) with saturation; 0.5+: twice it."""
    x = np.full((32, 4), 3.0, np.float32)
    x[0, 0] = 300.0                        # amax 300: floor(log2) = 8, Emax(e4m3fn) = 8

    @jit
    def k(x):
        s = nl.ndarray((32, 4), nl.bfloat16)
        nisa.dma_copy(dst=s, src=x)
        q = nl.ndarray((32, 1), nl.float8_e4m3fn_x4)
        sc = nl.ndarray((32, 1), nl.uint8)
        nisa.memset(sc, 0)
        nisa.quantize_mx(dst=q, src=s, dst_scale=sc)
        out = nl.ndarray((32, 1), nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=sc)
        return out
    with emu.target("trn3"):
        with versions.nki_version("0.3"):
            assert k(x)[0, 0] == 127 + 8 - 8
        assert k(x)[0, 0] == 127 + 8 - 7


def test_trace_mode_kernel_is_inlined_into_its_caller_under_03():
    with versions.nki_version("0.3"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)

            @jit(mode="trace")
            def sub(t):
                nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)

        x = np.ones((4, 8), np.float32)
        np.testing.assert_array_equal(jit(_top_calling(sub))(x), 3 * x)


def _top_calling(sub):
    """An undecorated top-level body that loads x, calls ``sub`` on the tile and stores it."""
    def top(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype)
        nisa.dma_copy(dst=t, src=x)
        sub(t)
        nisa.dma_copy(dst=out, src=t)
        return out
    return top


def _sub_kernel_pair(**sub_options):
    @jit(**sub_options)
    def sub(t):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
    return sub, _top_calling(sub)


@pytest.mark.parametrize("version", ["0.3", "0.7"])
def test_nested_jit_sub_kernel_is_inlined(version):
    # NKI Library's moe_tkg calls @nki.jit helpers from its kernels; NKI 0.7 documents nested
    # @nki.jit sub-kernels inlined under the top-level kernel's config
    _, top = _sub_kernel_pair()
    x = np.ones((4, 8), np.float32)
    with versions.nki_version(version):
        np.testing.assert_array_equal(jit(top)(x), 3 * x)
        np.testing.assert_array_equal(jit(top)[2](x), 3 * x)


def test_nested_jit_sub_kernel_config_must_agree_under_07():
    cc = emu.compiler.CompileConfig(address_rotation=False)
    _, top = _sub_kernel_pair(compile_config=cc)
    x = np.ones((4, 8), np.float32)
    with pytest.raises(NkiValidationError, match="sub: nested @nki.jit sub-kernel's compile_config "
                                                 "differs from the top-level kernel top's"):
        jit(top)(x)
    # the same config agrees
    np.testing.assert_array_equal(
        jit(top, compile_config=emu.compiler.CompileConfig(address_rotation=False))(x), 3 * x)
    override = emu.compiler.SpecializationConfig(allow_nested_config_override=True)
    with pytest.warns(UserWarning, match="allow_nested_config_override"):
        np.testing.assert_array_equal(jit(top, specialization_config=override)(x), 3 * x)


def test_nested_jit_sub_kernel_with_a_launch_grid_is_refused():
    sub, _ = _sub_kernel_pair()

    @jit
    def top(x):
        t = nl.ndarray(x.shape, x.dtype)
        nisa.dma_copy(dst=t, src=x)
        sub[2](t)
    with pytest.raises(NkiValidationError, match=r"sub\[2\]: a sub-kernel called from inside top "
                                                 "runs under that kernel's LNC"):
        top(np.ones((4, 8), np.float32))
