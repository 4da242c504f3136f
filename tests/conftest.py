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
