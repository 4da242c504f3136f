"""Trainium NeuronCore numbers: one source for the emulator's limits, the cost model, the roofline.

Every number carries a source tag; docs/cost-model.md lists what each key names:
[D] documented (key names the doc), [Der] derived, [M] measured by a third party, [Est] estimate.
Source keys: AT2/AT3 = NKI Trainium2/3 architecture guides, NC3/NC4 = NeuronCore-v3/v4 pages,
A2 = NKI Trn1/Inf2 architecture guide, ISA = nki.isa API docstrings (SDK 2.32/2.33), TS = the
``nki.language.tile_size`` page, DBW/DMA = NKI DMA bandwidth guide / DMA overview, PG = NKI
performance guide, ISA26 = per-instruction cost sections of the SDK 2.26 ISA docs, GL = Neuron
Explorer glossary, SCH = profile schema, LNC = logical NeuronCore page, T2/T3 = chip pages.

Performance numbers (the cost model and the roofline) live in one frozen :class:`CostParams` per
generation: ``generation("trn3").cost`` or ``cost_params("trn3")``; ``peak_tflops`` and ``hbm_bw``
give the per-NeuronCore roofline denominators (docs/cost-model.md, "Roofline").
"""
from __future__ import annotations

from dataclasses import dataclass, field

KiB = 1024


@dataclass(frozen=True, kw_only=True)
class CostParams:
    """Performance parameters of one NeuronCore generation for the cost model and the roofline.

    Units: clocks in GHz, times in ns, bandwidths in B/ns (= GB/s), sizes in bytes, costs in cycles
    of the named engine. Tags (docs/cost-model.md): [D key] documented, [Der] derived, [M] measured
    by a third party, [Est] estimate / calibration parameter, [C] sources conflict (choice
    explained).
    """

    # ---- engine clocks (GHz)
    f_pe: float                    # TensorE
    f_dve: float                   # VectorE
    f_act: float                   # ScalarE
    f_pool: float                  # GpSimdE
    f_sp: float                    # Sync engine / NeuronCore base clock (semaphores, DMA triggers)

    # ---- TensorE
    pe_rows: int = 128             # 128x128 PE array [D A2, ISA, AT3]
    pe_cols: int = 128
    fp8_speedup: int = 2           # FP8 double_row: K=256 per instruction [D AT2, ISA]
    mx_speedup: int = 0            # MXFP8/MXFP4: K=512 per instruction (v4 only) [D NC4, AT3]
    fp32_factor: int = 4           # fp32 matmul at 1/4 rate [D ISA26 nc_matmul]
    onezero_factor: float = 0.5    # fp32 0/1 operand hint: 2x [D ISA]
    mm_min_ii: int = 64            # MM_INIT_LATENCY: min interval between MMs, cycles [D A2, ISA26]
    # LoadStationary up to 4x faster than an MM of equal free size [D A2, PG]
    ls_speedup: int = 4
    mm_latency_cycles: int = 256   # extra cycles until an MM result is visible (+ N_moving) [Est]
    # fp32 PE transpose: transpose mode is 2x faster than fp32 MM [D AT2]
    transpose_fp32_factor: int = 2
    background_transpose: bool = False  # v4 overlaps a PE transpose with matmuls [D AT3]
    pe_tile_slots: int = 4         # PE tiling granularity: 4 row x 4 column tiles of 32 [D ISA]

    # ---- dI/dt throttle of TensorE [D GL, overview-summary-page]
    throttle: bool = True
    throttle_start: float = 0.5    # utilization limit when work begins [D GL]
    throttle_ramp_ns: float = 3000.0    # ramps to 1.0 over ~3 us [D GL]
    throttle_window_ns: float = 3000.0  # re-engages after a ~3 us window below ... [D GL]
    throttle_threshold: float = 0.5     # ... 50% utilization [D GL]

    # ---- Vector / Scalar / GpSimd
    min_ii: int = 64               # MIN_II for small tiles, cycles [D ISA26]
    # static overhead when the next instruction depends on it [D A2, PG]
    dve_dep_cycles: int = 100
    # ScalarE dependent-chain overhead; 264-cycle dependent II on NC-v2 [Est from D PG]
    act_dep_cycles: int = 200
    pool_dep_cycles: int = 150     # GpSimd result latency [Est]
    pool_start_cycles: int = 150   # GPSIMD_START (iota, affine_select, local_gather) [D ISA26]
    # ActReadAccumulator (activation_reduce, tensor_scalar_reduce) [D A2]
    act_accum_cycles: int = 64
    dve_perf_modes: bool = False   # 4x / 2x VectorE perf modes for 16-bit data (v3+) [D AT2]
    dve_perf_fp8: bool = False     # v4: the 512 elem/cycle class includes FP8 [D AT3]
    # copy/tensor_scalar, 16-bit in and out, SBUF->SBUF, contiguous [D AT2]
    dve_perf_4x: int = 4
    dve_perf_2x: int = 2           # non-contiguous or PSUM side; tensor_tensor bf16 in SBUF [D AT2]
    act_bf16_speedup: int = 1      # v4 ScalarE tensor_scalar / tensor_copy with bf16: 2x [D AT3]
    dve_mx_speedup: int = 1        # v4 quantize_mx / exponential: 4 elem/lane/cycle [D AT3]
    strided_factor: int = 2        # port at half rate when the innermost stride > 16 B [D A2]
    strided_bytes: int = 16        # [D A2]
    dynamic_copy_cycles: int = 600  # dynamic-offset copies: max(~600, N) [D ISA26]
    pool_cycles_per_elem: float = 1.0  # generic GpSimd elementwise: max(MIN_II, N) [Est]

    # live-range renaming: a write that starts a new value of an on-chip region does not wait for
    # the accesses of the value before it (the compiler's address rotation over 2 buffers) [C]
    rename_onchip: bool = True
    # SBUF capacity bounds prefetch: a tile that does not fit waits for the last accesses of the
    # tiles, dead in program order, whose space it takes (the space freed first) [D capacity]
    sbuf_bound: bool = True

    # ---- semaphores
    # cross-engine semaphore wake-up, L_sem: 50-100 ns (midpoint) [Est]
    sem_ns: float = 75.0

    # ---- DMA
    dma_queues: int = 16           # DMA engines (rings) per NC [D AT2, AT3, DMA]
    dma_partitions_per_queue: int = 8  # 128-partition tile = 8 partitions per engine [D A2, DMA]
    dma_bw_q: float = 23.0         # practical B/ns per queue [D DBW]
    # each engine has 16 rings (queue IDs), in order within a ring, served round robin across
    # rings; a transfer's ring follows its trigger engine and descriptor generation [D DMA]
    dma_ring_per_trigger: bool = True
    # descriptor cost floor, bytes: t = (max(b, B_min) + B_fix) / BW_q [M bound, C]. The DMA
    # overview's throughput-vs-bytes-per-partition figure alone fits B_min ~ 2.35 KB; the measured
    # 90.92%-MFU nki-autotune GEMM (Trn2, 236 us, 3072 1-KiB descriptors per queue, scheduler off)
    # bounds it below 236e3 * 23 / 3072 - 100 ~ 1.67 KB for streamed transfers (its queues are not busy
    # every cycle); 1.5 KiB keeps the model at or under that bound with its own stream overheads
    # (docs/cost-model.md, "DMA descriptor floor").
    dma_b_min: float = 1536.0
    dma_b_fix: float = 100.0       # per-descriptor fixed bytes [Est]
    dma_lat_ns: float = 1300.0     # semaphore-to-start latency of every transfer [D DBW]
    # transfers in flight per queue (setup pipelined): 2-4 (midpoint) [Est]
    dma_outstanding: int = 3
    dma_sem_cycles: int = 64       # completion semaphore T_sem, f_sp cycles [Est]
    # static-descriptor trigger on the issuing queue, issuer cycles [Est]
    dma_trigger_cycles: int = 64
    hwdge_ns: float = 600.0        # one hardware-DGE DMA instruction [D AT2; Trn3 assumed equal]
    hwdge_instances: int = 2       # HW DGE instances, driven from SP or ACT [D AT2, DGE]
    # software DGE descriptor generation on GpSimd: 150 + a * n_desc [Est]
    swdge_start_cycles: int = 150
    swdge_cycles_per_desc: float = 6.0  # a = 4-8 (midpoint) [Est]
    dma_transpose_eff_hbm: float = 0.9   # HBM->SBUF DMA transpose vs copy [D AT2]
    dma_transpose_eff_sbuf: float = 0.5  # SBUF->SBUF DMA transpose vs copy [D AT2]
    # a DMA transpose is priced by [128, 16]-element output blocks written by all 16 queues
    # together (the efficiencies above are for whole blocks), not by its per-partition descriptors
    # [D AT2]; False: priced as per-partition descriptors like a copy (the model before issue 12's
    # attention fit; sensitivity only)
    dma_transpose_blocks: bool = True

    # ---- HBM
    hbm_chip_gbps: float = 2900.0  # chip HBM bandwidth [D T2]
    hbm_stacks: int = 4            # [D T2, T3, LNC]
    ncs_per_chip: int = 8          # [D T2, T3]
    hbm_share_gbps: float = 362.5  # per NC = chip / 8 [Der]
    hbm_stack_gbps: float = 725.0  # per stack (the 2 NCs of an LNC=2 pair) = chip / 4 [Der, D LNC]

    # ---- launch
    # fixed device-side cost per kernel launch inside the profiled kernel time: 0 (see [C] below)
    launch_ns: float = 0.0
    # host-side launch overhead of one kernel call, reported apart as CostReport.launch_e2e_ns and
    # added only to end_to_end_ns: the neuron-bench NCL floor of a tiny kernel (10-15 us [M CS149])
    # less its ~3.1 us device time (nrtpy 3.0-3.2 us [M]) [Der]
    launch_e2e_ns: float = 9400.0
    # ACT function-set switch, 1-2 us [Est]; not modeled (no table map)
    act_table_switch_ns: float = 1500.0

    # [C] launch_ns: the nrtpy tutorial's "3 us" device-mode figure [M] is
    # the device time of the whole trivial load-load-add-store kernel, whose two serial DMA
    # latencies alone are 2 x 1.3 us [D DBW]. Adding 3 us on top would count it twice, so
    # device-mode launch overhead is 0 and the trivial kernel is checked end to end (tests, docs).

    # ---- derived peaks (per NeuronCore)
    @property
    def tflops_bf16(self) -> float:
        """Dense BF16/FP16/TF32 TensorE peak: 2 * 128 * 128 * f_PE [Der]; 78.6 TF at 2.4 GHz."""
        return 2 * self.pe_rows * self.pe_cols * self.f_pe / 1000.0

    @property
    def tflops_fp8(self) -> float:
        """FP8 peak: double_row doubles K per instruction (v3+); v2 cFP8 runs at the BF16 rate."""
        return self.tflops_bf16 * self.fp8_speedup

    @property
    def tflops_mx(self) -> float | None:
        """MXFP8/MXFP4 peak (v4: 4x BF16, 315 TF) or None where there is no MX matmul."""
        return self.tflops_bf16 * self.mx_speedup if self.mx_speedup else None

    @property
    def tflops_fp32(self) -> float:
        return self.tflops_bf16 / self.fp32_factor

    @property
    def dma_peak_gbps(self) -> float:
        """Practical DMA peak per NC: queues x BW_q [D DBW]."""
        return self.dma_queues * self.dma_bw_q

    @property
    def hbm_bw_gbps(self) -> float:
        """Memory roof per NC: min(HBM share, DMA practical peak) [Der]."""
        return min(self.hbm_share_gbps, self.dma_peak_gbps)


TRN1_COST = CostParams(
    f_pe=2.8, f_dve=1.12, f_act=1.4, f_pool=1.4,  # [D A2]
    f_sp=1.4,                                     # NC-v2 base clock [D SCH]
    fp8_speedup=1,                                # cFP8 at the BF16 rate [D A2]
    transpose_fp32_factor=4,                      # no transpose mode on v2: an fp32 MM [D ISA]
    # dI/dt throttle documented for Trn2/Trn3 only [D GL]
    throttle=False,
    dma_bw_q=17.0,                                # [D DBW]
    hwdge_instances=0,                            # SW DGE only [D AT2]
    dma_transpose_blocks=False,                   # the cooperative block transpose is v3+ [D AT2]
    hbm_chip_gbps=820.0, hbm_stacks=1, ncs_per_chip=2,  # [D A2]
    hbm_share_gbps=410.0, hbm_stack_gbps=820.0,   # [Der] approximate
)
TRN2_COST = CostParams(
    f_pe=2.4,                                     # [D AT2]
    f_dve=0.96,                                   # [D AT2]
    f_act=1.2, f_pool=1.2,                        # [D AT2]
    # NeuronCore base clock [D SCH neuroncore_cycle_count]
    f_sp=1.2,
    fp8_speedup=2,                                # double_row [D NC3, AT2]
    dve_perf_modes=True,                          # [D AT2]
    dma_bw_q=23.0,                                # 16 x 23 = 368 GB/s practical [D DBW]
    hbm_chip_gbps=2900.0,                         # [D T2] ([C] older AT2: 3.0 TB/s)
    hbm_share_gbps=2900.0 / 8,                    # 362.5 [Der]
    hbm_stack_gbps=2900.0 / 4,                    # 725 [Der]
)
TRN3_COST = CostParams(
    f_pe=2.4,                                     # [D AT3]
    f_dve=1.2,                                    # [D AT3]
    f_act=1.2, f_pool=1.2,                        # [D AT3]
    f_sp=1.2,                                     # not stated for v4; the v3 base clock [Est]
    fp8_speedup=2,                                # double_row also on v4 [Der from ISA]
    mx_speedup=4,                                 # 315 TF MXFP8/MXFP4 [D NC4]
    background_transpose=True,                    # [D AT3]
    dve_perf_modes=True, dve_perf_fp8=True,       # [D AT3]
    act_bf16_speedup=2,                           # [D AT3]
    dve_mx_speedup=4,                             # quantize_mx / exponential [D AT3]
    dma_bw_q=33.0,                                # 16 x 33 = 528 GB/s practical [D DBW]
    hbm_chip_gbps=4900.0,                         # [D T3] ([C] AT3: 4.7 TB/s)
    hbm_share_gbps=4900.0 / 8,                    # 612.5 [Der]
    hbm_stack_gbps=4900.0 / 4,                    # 1225 [Der]
)


@dataclass(frozen=True)
class Generation:
    """Per-NeuronCore limits of one hardware generation (what the emulator enforces)."""

    name: str                     # "trn2" | "trn3" (| "trn1")
    nc_version: int               # 2, 3, 4 (nisa.get_nc_version())
    pmax: int = 128               # partitions [D A2]
    sbuf_bytes_per_partition: int = 192 * KiB   # physical [D A2/AT2/AT3]
    # runtime reserve [Der]: the NKI docs give no figure; NKI Library sizes its own SBUF budgets
    # as 224 KiB - 16384 - (a few hundred bytes) on Trn2 (mlp_cte_constants.py,
    # bwmm_bwd_dropless.py: MAX_AVAILABLE_SBUF_SIZE), i.e. 16 KiB off the physical partition
    sbuf_reserved_bytes: int = 16 * KiB
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
    cost: CostParams | None = None              # performance parameters (cost model, roofline)

    @property
    def sbuf_usable_bytes(self) -> int:
        return self.sbuf_bytes_per_partition - self.sbuf_reserved_bytes


TRN1 = Generation(name="trn1", nc_version=2, sbuf_bytes_per_partition=192 * KiB, cost=TRN1_COST)
TRN2 = Generation(
    name="trn2", nc_version=3, sbuf_bytes_per_partition=224 * KiB,
    double_row=True, scalar_bias_float=True, scalar_tensor_copy=True, hwdge=True,
    dma_transpose=True, range_select=True, cost=TRN2_COST,
)
TRN3 = Generation(
    name="trn3", nc_version=4, sbuf_bytes_per_partition=256 * KiB,
    gemm_moving_fmax_fp32_dst=4096, gemm_moving_fmax_bf16_dst=8192,  # [D ISA nc_matmul]
    double_row=True, mx=True, bf16_psum=True, e4m3fn_matmul=True, scalar_bias_float=True,
    scalar_tensor_copy=True, hwdge=True, dma_transpose=True, range_select=True, cost=TRN3_COST,
)

GENERATIONS = {"trn1": TRN1, "trn2": TRN2, "trn3": TRN3}
# NEURON_PLATFORM_TARGET_OVERRIDE spellings [D NKI docs, nki.simulate / target override].
TARGET_ALIASES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2",
                  "trn3": "trn3", "gen4": "trn3"}
DEFAULT_TARGET = "trn3"  # the official simulator's default with no chip [D NKI docs, nki.simulate]


def generation(target: str) -> Generation:
    """Look up a target name (``trn2``, ``trn3``, ``gen3`` ...)."""
    key = TARGET_ALIASES.get(str(target).lower())
    if key is None:
        raise ValueError(f"target must be one of {sorted(TARGET_ALIASES)}; got {target!r}")
    return GENERATIONS[key]


def cost_params(target: str) -> CostParams:
    """The cost-model parameters of ``target`` (``trn2``, ``trn3``, ``gen4`` ...)."""
    return generation(target).cost


_DTYPE_KINDS = ("bf16", "fp8", "mx", "fp32")


def peak_tflops(target: str, dtype_kind: str) -> float | None:
    """Dense TensorE peak of ONE NeuronCore in TFLOP/s for ``dtype_kind`` (bf16|fp8|mx|fp32).

    bf16 also covers fp16/tf32; fp8 is the double_row rate; mx is MXFP8/MXFP4 (Trn3 only: None
    elsewhere). Use 8 x this for a chip, never the marketing chip figure.
    """
    if dtype_kind not in _DTYPE_KINDS:
        raise ValueError(f"dtype_kind must be one of {', '.join(_DTYPE_KINDS)}; got {dtype_kind!r}")
    c = cost_params(target)
    return {"bf16": c.tflops_bf16, "fp8": c.tflops_fp8, "mx": c.tflops_mx,
            "fp32": c.tflops_fp32}[dtype_kind]


def hbm_bw(target: str) -> float:
    """Memory roof of ONE NeuronCore in GB/s: min(HBM share, DMA practical peak) [Der].

    Trn2: min(362.5, 368) = 362.5; Trn3: min(612.5, 528) = 528.
    """
    return cost_params(target).hbm_bw_gbps
