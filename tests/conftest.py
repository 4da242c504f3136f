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
