"""``nki.isa.constants``: the ISA enums, re-exported (nki-spec §8.1)."""
from ._common import (  # noqa: F401
                      dge_mode,
                      dma_engine,
                      engine,
                      matmul_perf_mode,
                      nc_version,
                      oob_mode,
                      reduce_cmd,
)
