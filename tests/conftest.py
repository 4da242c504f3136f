import os

# one BLAS thread per test process: the emulator runs many small matmuls, which multi-threaded
# BLAS slows down badly on a loaded 2-core machine (pytest -n 2 already uses both cores)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

from nki_kernels.emulator import target


@pytest.fixture(params=["trn2", "trn3"])
def tgt(request):
    """Run the test body for both targets."""
    with target(request.param):
        yield request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def sbuf_peak(monkeypatch):
    """``sbuf_peak()`` -> the largest per-partition SBUF use the emulator measured (bytes) in the
    kernels launched since the fixture started (or since the last ``sbuf_peak(reset=True)``)."""
    from nki_kernels.emulator import runtime
    seen = []
    orig = runtime.OnChipAllocator.__init__

    def init(self, region, gen):
        orig(self, region, gen)
        seen.append(self)

    monkeypatch.setattr(runtime.OnChipAllocator, "__init__", init)

    def peak(reset=False):
        got = max((a.peak for a in seen if a.region is runtime.sbuf), default=0)
        if reset:
            seen.clear()
        return got
    return peak
