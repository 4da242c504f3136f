"""Entry points: nki.jit / nki.simulate, LNC=2 launches, targets, install(), backend selection,
torch tensors, and the instruction trace (nki-spec §2, §9.10)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import nki_kernels.emulator as emulator
from nki_kernels import hardware
from nki_kernels.emulator import NkiValidationError, jit, simulate, target, trace
from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
X = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 16


def _plus_one(a):
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# ------------------------------------------------------------------------------ jit / simulate
def test_jit_bare_called_and_at_call_site():
    @jit
    def bare(a):
        return _plus_one(a)

    @jit()
    def called(a):
        return _plus_one(a)

    for y in (bare(X), called(X), jit(_plus_one)(X), bare(a=X)):
        assert isinstance(y, np.ndarray) and y.dtype == np.float32
        np.testing.assert_array_equal(y, X + 1)
    assert repr(bare).startswith("<nki.jit kernel bare")


def test_jit_accepts_compile_config_options():
    k = jit(_plus_one, compile_config=emulator.compiler.CompileConfig(dead_code_elim=True))
    np.testing.assert_array_equal(k(X), X + 1)


def test_simulate_kernel_plain_function_and_lnc2():
    @jit
    def k(a):
        return _plus_one(a)
    np.testing.assert_array_equal(simulate(k)(X), X + 1)
    np.testing.assert_array_equal(simulate(_plus_one)(X), X + 1)        # auto-wrapped
    with target("trn2"):
        np.testing.assert_array_equal(simulate(k[2])(X), X + 1)


def test_non_tensor_arguments_pass_through_and_tuple_outputs():
    seen = {}

    @jit
    def k(a, pair, scale, flag, dt, mode):
        seen.update(scale=scale, flag=flag, dt=dt, mode=mode, pair_shapes=[p.shape for p in pair])
        t = nl.ndarray(a.shape, nl.float32)
        nisa.dma_copy(dst=t, src=a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=scale)
        o1 = nl.ndarray(a.shape, dt, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o1, src=t)
        o2 = nl.ndarray(pair[1].shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o2, src=pair[1])
        return o1, o2
    b = np.ones((2, 3), np.float32)
    o1, o2 = k(X, (X[:2], b), 0.5, True, nl.bfloat16, nisa.oob_mode.skip)
    assert seen == {"scale": 0.5, "flag": True, "dt": nl.bfloat16, "mode": nisa.oob_mode.skip,
                    "pair_shapes": [(2, 16), (2, 3)]}
    assert o1.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(o1.astype(np.float32), X * 0.5)   # exact in bf16
    np.testing.assert_array_equal(o2, b)


def test_in_place_writes_to_inputs_are_copied_back():
    cache = np.zeros((6, 4), np.float32)
    untouched = np.full((2, 4), 3.0, np.float32)
    ro = np.arange(4, dtype=np.float32).reshape(1, 4)
    ro.flags.writeable = False

    @jit
    def k(c, new_rows, r):
        nisa.dma_copy(dst=c[2:4, :], src=new_rows)      # KV-cache style update
        t = nl.ndarray((1, 4), nl.float32)
        nisa.dma_copy(dst=t, src=r)
        nisa.dma_copy(dst=c[5:6, :], src=t)

    new = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32)
    assert k(cache, new, ro) is None
    exp = np.zeros((6, 4), np.float32)
    exp[2:4] = new
    exp[5] = ro[0]
    np.testing.assert_array_equal(cache, exp)
    np.testing.assert_array_equal(untouched, 3.0)


def test_each_call_runs_fresh_state():
    """Registers and PSUM state do not leak from one launch into the next."""
    @jit
    def k(a):
        t = nl.ndarray(a.shape, nl.float32)
        nisa.dma_copy(dst=t, src=a)
        s = nl.ndarray((a.shape[0], 1), nl.float32)
        nisa.activation(dst=t, op=nl.copy, data=t, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reduce, reduce_res=s)
        out = nl.ndarray((a.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=s)
        return out
    first, second = k(X), k(X)
    np.testing.assert_array_equal(first, second)   # a register persisting across launches: 2x


# ------------------------------------------------------------------------------ LNC = 2
def test_lnc2_program_id_shards_rows_of_a_shared_output():
    seen = []

    @jit
    def k(a):
        grid, n, pid = ((0, 1, 0) if nl.program_ndim() == 0
                        else (1, nl.num_programs(axes=0), nl.program_id(axis=0)))
        seen.append((grid, n, pid))
        rows = a.shape[0] // n
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((rows, a.shape[1]), a.dtype)
        nisa.dma_copy(dst=t, src=a[pid * rows:(pid + 1) * rows, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0, op1=nl.add,
                           operand1=float(pid))
        nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows, :], src=t)
        return out
    with target("trn2"):
        y = k[2](X)
    assert sorted(seen) == [(1, 2, 0), (1, 2, 1)]
    exp = X * 2
    exp[4:] += 1
    np.testing.assert_array_equal(y, exp)
    seen.clear()
    np.testing.assert_array_equal(k(X), X * 2)                # no grid: one program
    assert seen == [(0, 1, 0)]
    seen.clear()
    k[1](X)
    assert seen == [(1, 1, 0)]


def test_lnc_from_environment(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    got = []

    @jit
    def k():
        got.append((nl.num_programs(), nl.program_id()))
    with target("trn3"):
        k()
    assert sorted(got) == [(2, 0), (2, 1)]


def test_core_barrier_orders_shared_hbm_between_programs():
    """Each program writes its half, waits at the barrier, then reads the other program's half."""
    @jit
    def k(a):
        pid = nl.program_id(0)
        stage = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 16), a.dtype)
        nisa.dma_copy(dst=t, src=a[pid * 4:(pid + 1) * 4])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=100.0)
        nisa.dma_copy(dst=stage[pid * 4:(pid + 1) * 4], src=t)
        nisa.core_barrier(stage, (0, 1))
        other = 1 - pid
        u = nl.ndarray((4, 16), a.dtype)
        nisa.dma_copy(dst=u, src=stage[other * 4:(other + 1) * 4])
        nisa.dma_copy(dst=out[pid * 4:(pid + 1) * 4], src=u)   # out = halves swapped
        return out
    with target("trn3"):
        y = k[2](X)
    exp = np.concatenate([X[4:], X[:4]]) + 100
    np.testing.assert_array_equal(y, exp)     # without the barrier program 0 reads NaN


@jit
def _race_kernel(a, barrier_on):
    """Each program writes its half of a shared tensor and reads the other program's half,
    with a core_barrier on ``barrier_on`` ("stage", "other" or None) in between."""
    pid = nl.program_id(0)
    stage = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm, name="stage")
    other = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm, name="other")
    t = nl.ndarray((4, 16), a.dtype)
    nisa.dma_copy(dst=t, src=a[pid * 4:(pid + 1) * 4])
    nisa.dma_copy(dst=stage[pid * 4:(pid + 1) * 4], src=t)
    nisa.dma_copy(dst=other[pid * 4:(pid + 1) * 4], src=t)
    if barrier_on is not None:
        nisa.core_barrier(stage if barrier_on == "stage" else other, (0, 1))
    u = nl.ndarray((4, 16), a.dtype)
    nisa.dma_copy(dst=u, src=stage[(1 - pid) * 4:(2 - pid) * 4])
    nisa.dma_copy(dst=other[pid * 4:(pid + 1) * 4], src=u)
    return other


def test_reading_the_other_cores_writes_needs_a_barrier_on_that_tensor():
    """The emulator's lockstep order gets the right values either way; on hardware only a
    core_barrier on the tensor orders the two cores' accesses to it (nki-spec 9.10)."""
    with target("trn3"):
        y = _race_kernel[2](X, "stage")                           # ordered: no warning
        np.testing.assert_array_equal(y, np.concatenate([X[4:], X[:4]]))
        for on in (None, "other"):                                # none, or on another tensor
            with pytest.warns(emulator.isa.NkiHardwareWarning,
                              match=r"dma_copy: operand 'src': program \d reads 64 element\(s\) "
                                    r"of 'stage' \(shared_hbm\) that program \d wrote with no "
                                    r"core_barrier on 'stage' in between: the two cores race"):
                _race_kernel[2](X, on)


def test_both_cores_writing_the_same_output_is_not_a_race():
    """A kernel that does not shard writes its whole output from both cores (the same values)
    and may read it back."""
    @jit
    def k(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, a.dtype)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out, src=t)
        nisa.dma_copy(dst=t, src=out)
        nisa.dma_copy(dst=out, src=t)
        return out
    with target("trn3"):
        np.testing.assert_array_equal(k[2](X), X)


def test_sendrecv_exchanges_sbuf_tiles():
    @jit
    def k():
        pid = nl.program_id(0)
        mine = nl.ndarray((4, 8), nl.float32)
        nisa.memset(mine, float(pid + 1))
        theirs = nl.ndarray((4, 8), nl.float32)
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid,
                      pipe_id=0)
        nisa.tensor_scalar(dst=mine, data=theirs, op0=nl.multiply, operand0=10.0)
        nisa.sendrecv(mine, theirs, 1 - pid, 1 - pid, 1)          # a second round trip
        out = nl.ndarray((2, 4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid], src=theirs)
        return out
    with target("trn2"):
        y = k[2]()
    np.testing.assert_array_equal(y[0], 10.0)     # program 0 got back its own 1 x 10
    np.testing.assert_array_equal(y[1], 20.0)


@pytest.mark.parametrize("skipper", [0, 1])
def test_program_skipping_the_barrier_is_a_deadlock_error(skipper):
    @jit
    def k():
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) != skipper:
            nisa.core_barrier(out, (0, 1))
    waiting = 1 - skipper
    with target("trn2"), pytest.raises(
            NkiValidationError,
            match=rf"k: program {waiting} waits at a core_barrier/sendrecv that program "
                  rf"{skipper} never reached"):
        k[2]()


def test_error_in_one_program_is_reported_not_the_deadlock():
    @jit
    def k():
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 1:
            raise ZeroDivisionError("program 1 failed")
        nisa.core_barrier(out, (0, 1))
    with target("trn2"), pytest.raises(ZeroDivisionError, match="program 1 failed"):
        k[2]()


def test_inputs_are_shared_hbm_under_lnc2_and_private_under_lnc1():
    bufs = []

    @jit
    def k(a):
        bufs.append(a.buffer)
    with target("trn2"):
        k(X)
        k[2](X)
    assert bufs == [nl.hbm, nl.shared_hbm, nl.shared_hbm]


# ------------------------------------------------------------------------------ targets
def _nc_version_and_limits():
    box = {}

    @jit
    def k():
        box["v"] = nisa.get_nc_version()
        box["sbuf"] = nl.tile_size.sbuf_size_bytes
        box["psum_banks"] = nl.tile_size.psum_num_banks
        box["pmax"] = nl.tile_size.pmax
    k()
    return box


def test_default_target_is_trn3(monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    box = _nc_version_and_limits()
    assert box["v"] == 4 and box["v"] is nisa.nc_version.gen4
    assert box["sbuf"] == 32 * 1024 * 1024 and box["psum_banks"] == 8 and box["pmax"] == 128
    assert emulator.current_target_name() == "trn3"


@pytest.mark.parametrize("env,version,sbuf_mib", [("trn2", 3, 28), ("gen3", 3, 28),
                                                   ("trn3", 4, 32), ("gen4", 4, 32),
                                                   ("inf2", 2, 24), ("trn1", 2, 24)])
def test_platform_target_override_env(monkeypatch, env, version, sbuf_mib):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", env)
    box = _nc_version_and_limits()
    assert box["v"] == version and nisa.get_nc_version() >= version
    assert box["sbuf"] == sbuf_mib * 1024 * 1024


def test_target_context_overrides_env_and_nests(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    with target("trn2"):
        assert nisa.get_nc_version() == nisa.nc_version.gen3
        assert _nc_version_and_limits()["v"] == 3
        with target("gen4"):
            assert nisa.get_nc_version() == 4 and emulator.current_target_name() == "trn3"
        assert emulator.current_target_name() == "trn2"
    assert nisa.get_nc_version() == 4


def test_target_changes_limits_matmul_n1024():
    s = np.ones((4, 2), np.float32)
    m = np.ones((4, 1024), np.float32)

    @jit
    def k(a, b):
        sa, sb_ = nl.ndarray(a.shape, nl.float32), nl.ndarray(b.shape, nl.float32)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb_, src=b)
        p = nl.ndarray((2, 1024), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, sa, sb_)
        o = nl.ndarray((2, 1024), nl.float32)
        nisa.tensor_copy(dst=o, src=p)
        out = nl.ndarray((2, 1024), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    with target("trn3"):
        np.testing.assert_array_equal(k(s, m), np.full((2, 1024), 4.0))
    with target("trn2"), pytest.raises(NkiValidationError, match="N=1024; the limit is 512"):
        k(s, m)


def test_kernel_sees_the_hardware_table():
    box = {}

    @jit
    def k():
        box["usable"] = nl.tile_size.sbuf_fmax_bytes
    with target("trn2"):
        k()
    assert box["usable"] == hardware.TRN2.sbuf_usable_bytes < 224 * 1024


# ------------------------------------------------------------------------------ subprocesses
def _run_py(code, **env_overrides):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NKI_", "NEURON_"))}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_install_runs_a_third_party_style_kernel():
    code = """
        import sys
        import numpy as np
        try:
            import nki  # noqa: F401
            raise SystemExit("nki importable before install()")
        except ModuleNotFoundError:
            pass
        import nki_kernels.emulator
        assert nki_kernels.emulator.install() is True
        import nki
        import nki.language as nl
        import nki.isa as nisa
        from nki.isa.constants import oob_mode
        assert nki is nki_kernels.emulator and oob_mode is nisa.oob_mode
        import nki.typing as nt

        @nki.jit
        def rowsum_exp(x: nt.tensor[128, 64]):
            t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            e = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
            s = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
            nisa.activation_reduce(dst=e, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=s)
            out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=s)
            assert nisa.get_nc_version() >= nisa.nc_version.gen3
            return out

        x = (np.arange(128 * 64, dtype=np.float32).reshape(128, 64) % 7) / 7
        y = nki.simulate(rowsum_exp)(x)
        np.testing.assert_allclose(y[:, 0], np.exp(x).sum(axis=1), rtol=1e-5)
        print("OK", y.shape)
    """
    r = _run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK (128, 1)"


def test_backend_emulator_selected_explicitly_and_by_default():
    code = """
        import numpy as np
        from nki_kernels import backend
        from nki_kernels.backend import nki, nl, nisa
        assert backend.is_emulated() and backend.BACKEND == "emulator"

        @nki.jit
        def k(a):
            t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            o = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=t)
            return o
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert (backend.launch(k, x) == x).all() and (backend.launch(k, x, lnc=2) == x).all()
        print("emulator")
    """
    for env in ({"NKI_KERNELS_BACKEND": "emulator"}, {}, {"NKI_KERNELS_BACKEND": " Emulator "}):
        r = _run_py(code, **env)
        assert r.returncode == 0, (env, r.stderr)
        assert r.stdout.strip() == "emulator"


@pytest.mark.parametrize("choice", ["simulator", "hardware"])
def test_backend_without_real_nki_raises_backend_unavailable(choice):
    # importable (the CLI and docs work); the first op, via require(), refuses with the reason
    r = _run_py("import nki_kernels.backend as b; b.require()", NKI_KERNELS_BACKEND=choice)
    assert r.returncode != 0
    assert "BackendUnavailable" in r.stderr
    assert f"NKI_KERNELS_BACKEND={choice} needs the real `nki` package" in r.stderr
    assert "NKI_KERNELS_BACKEND=emulator" in r.stderr          # says how to get going


def test_backend_unknown_value_rejected():
    r = _run_py("import nki_kernels.backend as b; b.require()", NKI_KERNELS_BACKEND="gpu")
    assert r.returncode != 0
    assert "NKI_KERNELS_BACKEND must be one of emulator, simulator, hardware; got 'gpu'" in r.stderr


# ------------------------------------------------------------------------------ torch
@pytest.mark.torch
def test_torch_cpu_tensors_in_and_out():
    torch = pytest.importorskip("torch")

    @jit
    def k(a, b, cache):
        ta = nl.ndarray(a.shape, nl.float32)
        nisa.dma_copy(dst=ta, src=a)
        tb = nl.ndarray(b.shape, nl.float32)
        nisa.dma_copy(dst=tb, src=b)                           # bf16 -> fp32
        s = nl.ndarray(a.shape, nl.float32)
        nisa.tensor_tensor(dst=s, data1=ta, data2=tb, op=nl.add)
        o32 = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o32, src=s)
        o16 = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o16, src=s)
        nisa.dma_copy(dst=cache[0:1, :], src=ta[0:1, :])       # in-place input update
        return o32, o16

    a = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    b = torch.full((3, 4), 0.5, dtype=torch.bfloat16)
    cache = torch.zeros((2, 4), dtype=torch.float32)
    o32, o16 = k(a, b, cache)
    assert isinstance(o32, torch.Tensor) and o32.dtype == torch.float32
    assert o16.dtype == torch.bfloat16 and o16.device.type == "cpu"
    torch.testing.assert_close(o32, a + 0.5, rtol=0, atol=0)
    torch.testing.assert_close(o16, (a + 0.5).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(cache[0], a[0], rtol=0, atol=0)
    assert (cache[1] == 0).all()


@pytest.mark.torch
def test_torch_through_simulate_and_lnc2():
    torch = pytest.importorskip("torch")

    @jit
    def k(a):
        pid, n = nl.program_id(0), nl.num_programs()
        rows = a.shape[0] // n
        t = nl.ndarray((rows, a.shape[1]), a.dtype)
        nisa.dma_copy(dst=t, src=a[pid * rows:(pid + 1) * rows])
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows], src=t)
        return out
    a = torch.randn(4, 6, dtype=torch.bfloat16)
    with target("trn2"):
        y = simulate(k[2])(a)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, a)


# ------------------------------------------------------------------------------ trace
def test_trace_records_engine_opcode_operands():
    @jit
    def k(a):
        t = nl.ndarray(a.shape, nl.float32)
        nisa.dma_copy(dst=t, src=a)
        o = nl.ndarray(a.shape, nl.bfloat16)
        nisa.activation(dst=o, op=nl.exp, data=t, name="act0")
        p = nl.ndarray((16, 16), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, t, t)
        out = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    k(X)                                               # not recorded: no trace open
    with trace() as t:
        k(X)
    with trace() as empty:
        pass
    assert len(empty) == 0
    assert [(i.engine, i.opcode) for i in t] == [("dma", "dma_copy"), ("scalar", "activation"),
                                                 ("tensor", "nc_matmul"), ("dma", "dma_copy")]
    assert t.launches == [{"kernel": "k", "target": "trn3", "lnc": 1, "first_instruction": 0}]
    dma_in, act, mm, dma_out = t.instructions
    assert [i.seq for i in t.instructions] == [0, 1, 2, 3]
    (src,), (dst,) = dma_in.reads, dma_in.writes
    assert (src.role, src.buffer, src.dtype, src.shape) == ("src", "private_hbm", "float32",
                                                            (8, 16))
    assert (dst.role, dst.buffer, dst.partitions, dst.nbytes) == ("dst", "sbuf", (0, 8), 512)
    assert act.name == "act0" and act.attrs["op"] == "exp"
    assert act.writes[0].dtype == "bfloat16" and act.reads[0].alloc == dst.alloc
    assert mm.attrs["K"] == 8 and mm.attrs["M"] == 16 and mm.attrs["N"] == 16
    assert [o.role for o in mm.reads] == ["stationary", "moving"]
    assert mm.writes[0].buffer == "psum"
    assert dma_out.writes[0].buffer == "shared_hbm" and dma_out.reads[0].alloc == act.writes[
        0].alloc
    assert t.summary() == {("dma", "dma_copy"): 2, ("scalar", "activation"): 1,
                           ("tensor", "nc_matmul"): 1}
    assert set(t.by_engine()) == {"dma", "scalar", "tensor"}


def test_trace_lnc2_records_both_programs():
    @jit
    def k():
        t = nl.ndarray((4, 4), nl.float32)
        nisa.memset(t, float(nl.program_id(0)))
    with target("trn2"), trace() as t:
        k[2]()
    assert sorted(i.program for i in t) == [0, 1]
    assert all((i.engine, i.opcode) == ("vector", "memset") for i in t)
    assert t.launches[0]["lnc"] == 2 and t.launches[0]["target"] == "trn2"
