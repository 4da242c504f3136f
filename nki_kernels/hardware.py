"""Trainium NeuronCore numbers: one source for the emulator's limits, the cost model and the roofline.

Every number carries its source tag from ``shared/docs/hardware.md`` / ``nki-spec.md``:
[D] documented (key names the doc), [Der] derived, [M] measured by a third party, [Est] our estimate.
Source keys: AT2/AT3 = NKI Trainium2/3 architecture guides, NC3/NC4 = NeuronCore-v3/v4 pages,
A2 = NKI Trn1/Inf2 architecture guide, ISA = nki.isa API docstrings (SDK 2.32/2.33), TS = the
``nki.language.tile_size`` page, DBW/DMA = NKI DMA bandwidth guide / DMA overview.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KiB = 1024


@dataclass(frozen=True)
class Generation:
    """Per-NeuronCore limits of one hardware generation (what the emulator enforces)."""

    name: str                     # "trn2" | "trn3" (| "trn1")
    nc_version: int               # 2, 3, 4 (nisa.get_nc_version())
    pmax: int = 128               # partitions [D A2]
    sbuf_bytes_per_partition: int = 192 * KiB   # physical [D A2/AT2/AT3]
    sbuf_reserved_bytes: int = 16 * KiB         # runtime reserve [Est]: real value undocumented (nki-spec §4.3)
    psum_bytes_per_partition: int = 16 * KiB    # 8 banks x 2 KiB [D A2, AT2, AT3]
    psum_bank_bytes: int = 2 * KiB              # [D A2]
    psum_num_banks: int = 8                     # [D TS]
    gemm_stationary_fmax: int = 128             # [D TS, ISA nc_matmul]
    gemm_moving_fmax: int = 512                 # per-bank rule [D TS]; gen4 up to 4096/8192 [D ISA]
    gemm_moving_fmax_fp32_dst: int = 512
    gemm_moving_fmax_bf16_dst: int = 512
    bn_stats_fmax: int = 512                    # [D TS]
    double_row: bool = False                    # FP8 double_row matmul [D ISA] gen3+
    mx: bool = False                            # nc_matmul_mx / quantize_mx [D ISA] gen4
    bf16_psum: bool = False                     # bf16 matmul dst [D ISA] gen4
    e4m3fn_matmul: bool = False                 # float8_e4m3fn matmul input [D ISA] gen4
    scalar_bias_float: bool = False             # activation(bias=float) [D ISA] gen3+
    scalar_tensor_copy: bool = False            # ScalarE tensor_copy [D ISA] gen3+
    hwdge: bool = False                         # hardware DGE [D AT2] gen3+
    dma_transpose: bool = False                 # [D ISA dma_transpose] gen3+
    range_select: bool = False                  # [D ISA] gen3+
    extra: dict = field(default_factory=dict)

    @property
    def sbuf_usable_bytes(self) -> int:
        return self.sbuf_bytes_per_partition - self.sbuf_reserved_bytes


TRN1 = Generation(name="trn1", nc_version=2, sbuf_bytes_per_partition=192 * KiB)
TRN2 = Generation(
    name="trn2", nc_version=3, sbuf_bytes_per_partition=224 * KiB,
    double_row=True, scalar_bias_float=True, scalar_tensor_copy=True, hwdge=True,
    dma_transpose=True, range_select=True,
)
TRN3 = Generation(
    name="trn3", nc_version=4, sbuf_bytes_per_partition=256 * KiB,
    gemm_moving_fmax_fp32_dst=4096, gemm_moving_fmax_bf16_dst=8192,  # [D ISA nc_matmul]
    double_row=True, mx=True, bf16_psum=True, e4m3fn_matmul=True, scalar_bias_float=True,
    scalar_tensor_copy=True, hwdge=True, dma_transpose=True, range_select=True,
)

GENERATIONS = {"trn1": TRN1, "trn2": TRN2, "trn3": TRN3}
# NEURON_PLATFORM_TARGET_OVERRIDE spellings [D nki-spec §2.1].
TARGET_ALIASES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2",
                  "trn3": "trn3", "gen4": "trn3"}
DEFAULT_TARGET = "trn3"  # the official simulator's default with no chip [D nki-spec §2.3]


def generation(target: str) -> Generation:
    """Look up a target name (``trn2``, ``trn3``, ``gen3`` ...)."""
    key = TARGET_ALIASES.get(str(target).lower())
    if key is None:
        raise ValueError(f"target must be one of {sorted(TARGET_ALIASES)}; got {target!r}")
    return GENERATIONS[key]
