"""The shapes table shared by the tests and the bench: model configs and per-op shape tiers.

Model configs are the published dimensions of each model (its Hugging Face ``config.json``), held
in frozen dataclasses with named fields. Per-op shapes are built from those configs by small
helper functions, so a model dimension is written down exactly once.

Tiers (``TIERS[name]`` or ``tier(name)``):

* ``FAST``   -- a few small (toy) cases per op: every test run, and ``nki-kernels bench --tier
  fast``, the smoke run;
* ``ODD``    -- edge sizes: 1, primes, 113, 1000, non-multiples of 128, zero-length sequences;
* ``MODELS`` -- real model dims (Llama-3-8B, Llama-3-70B at TP8, Qwen3-30B-A3B, Qwen3-235B-A22B,
  DeepSeek-V3, Mixtral-8x7B, Gemma-3), plus the big square GEMMs;
* ``DEFAULT`` -- one or two real model shapes per op, cheap to emulate: the default
  ``nki-kernels bench`` and the model shapes the default test run checks.

Usage::

    from nki_kernels.reference.shapes import FAST, MODELS, LLAMA3_8B
    for s in FAST.matmul: ...            # MatmulShape(name, M, K, N)
    LLAMA3_70B.tp_shard(8).n_kv_heads    # 1
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

# --------------------------------------------------------------------------------- model configs


@dataclass(frozen=True)
class ModelConfig:
    """Published dimensions of one decoder-only LLM (per model, or per device after ``tp_shard``).

    ``intermediate`` is the dense MLP width (SwiGLU/GeGLU: gate and up are each [hidden,
    intermediate]); for MoE models ``moe_intermediate`` is the width of one routed expert.
    MLA fields (``kv_lora_rank`` ...) are zero for models with ordinary GQA attention.
    """

    name: str
    hidden: int
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float = 1e-5
    rope_theta: float = 10_000.0
    # mixture of experts (0 = dense)
    n_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    n_shared_experts: int = 0
    # sliding-window attention (0 = none); Gemma-3 alternates local and global layers
    sliding_window: int = 0
    # multi-head latent attention (DeepSeek-V3)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    tp: int = 1                  # tensor-parallel degree these per-device dims assume

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.n_q_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:
        return self.n_q_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_out(self) -> int:
        """Output width of a fused QKV projection: (Hq + 2 Hkv) * d."""
        return (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def mla_cache_dim(self) -> int:
        """Per-token latent cache width of MLA (latent + rope part), 576 for DeepSeek-V3."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def tp_shard(self, tp: int) -> ModelConfig:
        """Per-device dims under tensor parallelism of degree ``tp``: heads and MLP width split,
        KV heads split down to 1 (replicated when tp > n_kv_heads), hidden unchanged."""
        if self.n_q_heads % tp or self.intermediate % tp:
            raise ValueError(f"{self.name}: tp={tp} must divide n_q_heads={self.n_q_heads} and "
                             f"intermediate={self.intermediate}")
        return replace(
            self, name=f"{self.name}-TP{tp}", tp=self.tp * tp,
            n_q_heads=self.n_q_heads // tp,
            n_kv_heads=max(1, self.n_kv_heads // tp),
            intermediate=self.intermediate // tp,
            moe_intermediate=self.moe_intermediate // tp if self.moe_intermediate else 0,
            vocab=-(-self.vocab // tp))


# Published configs (Hugging Face config.json of each model).
LLAMA3_8B = ModelConfig(
    "Llama-3-8B", hidden=4096, n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128,
    intermediate=14336, vocab=128256, rms_eps=1e-5, rope_theta=500_000.0)
LLAMA3_70B = ModelConfig(
    "Llama-3-70B", hidden=8192, n_layers=80, n_q_heads=64, n_kv_heads=8, head_dim=128,
    intermediate=28672, vocab=128256, rms_eps=1e-5, rope_theta=500_000.0)
LLAMA3_70B_TP8 = LLAMA3_70B.tp_shard(8)
QWEN3_30B_A3B = ModelConfig(
    "Qwen3-30B-A3B", hidden=2048, n_layers=48, n_q_heads=32, n_kv_heads=4, head_dim=128,
    intermediate=6144, vocab=151936, rms_eps=1e-6, rope_theta=1_000_000.0,
    n_experts=128, top_k=8, moe_intermediate=768)
QWEN3_235B_A22B = ModelConfig(
    "Qwen3-235B-A22B", hidden=4096, n_layers=94, n_q_heads=64, n_kv_heads=4, head_dim=128,
    intermediate=12288, vocab=151936, rms_eps=1e-6, rope_theta=1_000_000.0,
    n_experts=128, top_k=8, moe_intermediate=1536)
# DeepSeek-V3: MLA attention (128 heads, qk head dim 128 nope + 64 rope, v 128), first 3 layers
# dense (intermediate 18432), the rest 256 routed experts (top 8) + 1 shared expert of width 2048.
DEEPSEEK_V3 = ModelConfig(
    "DeepSeek-V3", hidden=7168, n_layers=61, n_q_heads=128, n_kv_heads=128, head_dim=192,
    intermediate=18432, vocab=129280, rms_eps=1e-6, rope_theta=10_000.0,
    n_experts=256, top_k=8, moe_intermediate=2048, n_shared_experts=1,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
MIXTRAL_8X7B = ModelConfig(
    "Mixtral-8x7B", hidden=4096, n_layers=32, n_q_heads=32, n_kv_heads=8, head_dim=128,
    intermediate=14336, vocab=32000, rms_eps=1e-5, rope_theta=1_000_000.0,
    n_experts=8, top_k=2, moe_intermediate=14336)
# Gemma-3: 5 local (sliding window 1024) layers per global layer; 12B has head_dim 256.
GEMMA3_27B = ModelConfig(
    "Gemma-3-27B", hidden=5376, n_layers=62, n_q_heads=32, n_kv_heads=16, head_dim=128,
    intermediate=21504, vocab=262208, rms_eps=1e-6, rope_theta=1_000_000.0, sliding_window=1024)
GEMMA3_12B = ModelConfig(
    "Gemma-3-12B", hidden=3840, n_layers=48, n_q_heads=16, n_kv_heads=8, head_dim=256,
    intermediate=15360, vocab=262208, rms_eps=1e-6, rope_theta=1_000_000.0, sliding_window=1024)

MODEL_CONFIGS = {m.name: m for m in (LLAMA3_8B, LLAMA3_70B, LLAMA3_70B_TP8, QWEN3_30B_A3B,
                                     QWEN3_235B_A22B, DEEPSEEK_V3, MIXTRAL_8X7B, GEMMA3_27B,
                                     GEMMA3_12B)}


# ------------------------------------------------------------------------------ per-op shapes


@dataclass(frozen=True)
class MatmulShape:
    """C[M, N] = A[M, K] @ B[K, N]."""
    name: str
    M: int
    K: int
    N: int


@dataclass(frozen=True)
class AttentionShape:
    """Prefill / flash attention: q [batch, n_q_heads, seq_q, head_dim], k/v [.., seq_kv, ..]."""
    name: str
    batch: int
    seq_q: int
    seq_kv: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool = True
    sliding_window: int = 0


@dataclass(frozen=True)
class DecodeShape:
    """Decode attention over a (paged) KV cache: ``q_len`` new tokens per sequence, ``kv_len``
    cached tokens (0 allowed: an empty sequence), ``page_size`` tokens per KV block."""
    name: str
    batch: int
    q_len: int
    kv_len: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    page_size: int = 16


@dataclass(frozen=True)
class QKVShape:
    """Fused QKV projection: x [tokens, hidden] -> [tokens, (n_q_heads + 2 n_kv_heads) head_dim]."""
    name: str
    tokens: int
    hidden: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MLPShape:
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up)), x [tokens, hidden], gate/up [hidden, inter]."""
    name: str
    tokens: int
    hidden: int
    intermediate: int


@dataclass(frozen=True)
class MoEShape:
    """Routed-expert MLP: ``tokens`` tokens, each routed to ``top_k`` of ``n_experts`` experts of
    width ``intermediate``."""
    name: str
    tokens: int
    hidden: int
    intermediate: int
    n_experts: int
    top_k: int
    # expert parallelism, shared experts, router options (fused_moe / router_topk bench)
    n_local: int = 0                 # experts held by this shard; 0 = all n_experts
    shared_intermediate: int = 0     # width of the shared expert(s); 0 = none
    n_groups: int = 0                # group-limited routing (DeepSeek-V3: 8 groups, keep 4)
    topk_groups: int = 0
    scoring: str = "softmax"         # router scoring: "softmax" | "sigmoid"
    routed_scaling: float = 1.0


@dataclass(frozen=True)
class RMSNormShape:
    """RMSNorm (+ quantization) of x [tokens, hidden]."""
    name: str
    tokens: int
    hidden: int


# ---- builders: shapes named after the model they come from


def _slug(cfg: ModelConfig) -> str:
    return cfg.name.lower()


def attention_of(cfg: ModelConfig, seq: int, batch: int = 1, causal: bool = True) -> AttentionShape:
    return AttentionShape(f"{_slug(cfg)} S={seq}", batch, seq, seq, cfg.n_q_heads, cfg.n_kv_heads,
                          cfg.head_dim, causal, cfg.sliding_window)


def decode_of(cfg: ModelConfig, kv_len: int, batch: int = 1, q_len: int = 1,
              page_size: int = 16) -> DecodeShape:
    return DecodeShape(f"{_slug(cfg)} B={batch} L={kv_len}", batch, q_len, kv_len, cfg.n_q_heads,
                       cfg.n_kv_heads, cfg.head_dim, page_size)


@dataclass(frozen=True)
class DecodeBenchShape:
    """A decode-attention bench row: ``lens`` (tokens per sequence, new ones included),
    ``q_len`` new tokens, the cache (``page_size`` 0 = contiguous) and its dtype, cores used."""
    name: str
    lens: tuple
    q_len: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    page_size: int = 0
    kv_dtype: str = "bfloat16"
    lnc: int = 1

    @property
    def batch(self) -> int:
        return len(self.lens)


def decode_bench_of(cfg: ModelConfig, kv_len: int, batch: int = 1, q_len: int = 1,
                    page_size: int = 0, kv_dtype: str = "bfloat16", lnc: int = 1,
                    lens: tuple = ()) -> DecodeBenchShape:
    lens = tuple(lens) or (kv_len,) * batch
    tag = f"B={len(lens)} L={_k(kv_len)}" if not lens or len(set(lens)) == 1 else \
        f"1x{_k(max(lens))} + {len(lens) - 1}x{_k(min(lens))}"
    extra = "".join([f" s_q={q_len}" if q_len > 1 else "",
                     f" paged/{page_size}" if page_size else "",
                     " fp8" if kv_dtype != "bfloat16" else "", f" LNC={lnc}" if lnc > 1 else ""])
    return DecodeBenchShape(f"{_slug(cfg)} {tag}{extra}", lens, q_len, cfg.n_q_heads,
                            cfg.n_kv_heads, cfg.head_dim, page_size, kv_dtype, lnc)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def qkv_of(cfg: ModelConfig, tokens: int) -> QKVShape:
    return QKVShape(f"{_slug(cfg)} T={tokens}", tokens, cfg.hidden, cfg.n_q_heads, cfg.n_kv_heads,
                    cfg.head_dim)


def mlp_of(cfg: ModelConfig, tokens: int) -> MLPShape:
    return MLPShape(f"{_slug(cfg)} T={tokens}", tokens, cfg.hidden, cfg.intermediate)


def moe_of(cfg: ModelConfig, tokens: int) -> MoEShape:
    if not cfg.is_moe:
        raise ValueError(f"{cfg.name} is not a mixture-of-experts model")
    return MoEShape(f"{_slug(cfg)} T={tokens}", tokens, cfg.hidden, cfg.moe_intermediate,
                    cfg.n_experts, cfg.top_k)


def moe_shard_of(cfg: ModelConfig, tokens: int, ep: int = 1, **routing) -> MoEShape:
    """One expert-parallel rank of ``cfg``'s MoE layer: ``n_experts // ep`` local experts, the
    shared expert(s) (``n_shared_experts`` x ``moe_intermediate`` wide) and the router options
    ``routing`` (n_groups, topk_groups, scoring, routed_scaling)."""
    s = moe_of(cfg, tokens)
    name = f"{_slug(cfg)} EP{ep} T={tokens}" if ep > 1 else s.name
    return replace(s, name=name, n_local=cfg.n_experts // ep,
                   shared_intermediate=cfg.n_shared_experts * cfg.moe_intermediate, **routing)


def rmsnorm_of(cfg: ModelConfig, tokens: int) -> RMSNormShape:
    return RMSNormShape(f"{_slug(cfg)} T={tokens}", tokens, cfg.hidden)


def square(n: int) -> MatmulShape:
    return MatmulShape(f"{n}^3", n, n, n)


def linear_of(cfg: ModelConfig, tokens: int, which: str) -> MatmulShape:
    """A named linear layer of ``cfg`` applied to ``tokens`` tokens, as a plain GEMM.

    which: ``up`` (hidden -> intermediate), ``down`` (intermediate -> hidden), ``qkv``,
    ``o`` (n_q_heads * head_dim -> hidden), ``expert_up`` / ``expert_down`` (one routed expert),
    ``lm_head`` (hidden -> vocab).
    """
    kn = {
        "up": (cfg.hidden, cfg.intermediate),
        "down": (cfg.intermediate, cfg.hidden),
        "qkv": (cfg.hidden, cfg.qkv_out),
        "o": (cfg.q_dim, cfg.hidden),
        "expert_up": (cfg.hidden, cfg.moe_intermediate),
        "expert_down": (cfg.moe_intermediate, cfg.hidden),
        "lm_head": (cfg.hidden, cfg.vocab),
    }
    if which not in kn:
        raise ValueError(f"linear must be one of {', '.join(kn)}; got {which!r}")
    K, N = kn[which]
    if K == 0 or N == 0:
        raise ValueError(f"{cfg.name} has no {which!r} layer")
    return MatmulShape(f"{_slug(cfg)} {which} M={tokens}", tokens, K, N)


# Decode attention bench rows (issue 15): Llama-3-8B at B = 1 / 8 / 64 and 2K-128K contexts,
# Llama-3-70B TP8, a skewed batch, paged (block 64) and contiguous, bf16 and FP8 caches, s_q = 4,
# LNC=2. The skewed batch (1 x 128K + 63 x 1K) is paged, as a server holds it: a contiguous
# [64, 128K] cache would be 17 GB of mostly unused rows. "fp8" is the target's FP8 (e4m3 on
# Trn2, e4m3fn on Trn3). DECODE_DEFAULT: the default bench's row (one: the serving path, a paged
# Llama-3-8B batch; ~25 s on the emulator).
DECODE_MODELS = (
    decode_bench_of(LLAMA3_8B, 2048),
    decode_bench_of(LLAMA3_8B, 32768),
    decode_bench_of(LLAMA3_8B, 131072),
    decode_bench_of(LLAMA3_8B, 2048, batch=8),
    decode_bench_of(LLAMA3_8B, 2048, batch=8, page_size=64),
    decode_bench_of(LLAMA3_8B, 32768, batch=8),
    decode_bench_of(LLAMA3_8B, 2048, batch=64),
    decode_bench_of(LLAMA3_8B, 2048, batch=64, page_size=64),
    decode_bench_of(LLAMA3_8B, 32768, page_size=64),
    decode_bench_of(LLAMA3_8B, 32768, kv_dtype="fp8"),
    decode_bench_of(LLAMA3_8B, 2048, batch=8, page_size=64, kv_dtype="fp8"),
    decode_bench_of(LLAMA3_8B, 2048, batch=8, q_len=4),
    decode_bench_of(LLAMA3_8B, 32768, lnc=2),
    decode_bench_of(LLAMA3_8B, 1024, lens=(131072,) + (1024,) * 63, page_size=64),
    decode_bench_of(LLAMA3_8B, 1024, lens=(131072,) + (1024,) * 63, page_size=64, lnc=2),
    decode_bench_of(LLAMA3_70B_TP8, 32768),
    decode_bench_of(LLAMA3_70B_TP8, 8192, batch=8, page_size=64),
)
DECODE_DEFAULT = (decode_bench_of(LLAMA3_8B, 2048, batch=8, page_size=64),)



# MLA decode bench rows (issue 17): DeepSeek-V3 absorbed MLA (576-wide latent: kv_lora_rank 512 +
# rope 64) with H = 128 heads (one device) and H = 16 (TP8), B = 1 / 32 / 128, contexts 4K and
# 32K, s_q 1 and 2 (MTP), bf16 and FP8 caches, paged (block 64) and contiguous.
@dataclass(frozen=True)
class MLADecodeShape:
    """An MLA decode row: ``lens`` (tokens per sequence, new ones included), ``q_len`` new tokens,
    ``n_heads`` query heads, the latent widths, the cache (``page_size`` 0 = contiguous), its
    dtype ("fp8" = the target's FP8), cores used and the FP8 scale granularity (``kv_scale``
    "tensor" or "token": one fp32 scale per cache slot)."""
    name: str
    lens: tuple
    q_len: int
    n_heads: int
    kv_lora_rank: int = 512
    rope_dim: int = 64
    page_size: int = 0
    kv_dtype: str = "bfloat16"
    lnc: int = 1
    kv_scale: str = "tensor"

    @property
    def batch(self) -> int:
        return len(self.lens)


def mla_decode_of(cfg: ModelConfig, kv_len: int, batch: int = 1, q_len: int = 1,
                  page_size: int = 0, kv_dtype: str = "bfloat16", lnc: int = 1,
                  kv_scale: str = "tensor") -> MLADecodeShape:
    if not cfg.is_mla:
        raise ValueError(f"{cfg.name} has no multi-head latent attention")
    extra = "".join([f" s_q={q_len}" if q_len > 1 else "",
                     f" paged/{page_size}" if page_size else "",
                     " fp8" if kv_dtype != "bfloat16" else "",
                     " per-token" if kv_scale == "token" else "", f" LNC={lnc}" if lnc > 1 else ""])
    return MLADecodeShape(f"{_slug(cfg)} MLA H={cfg.n_q_heads} B={batch} L={_k(kv_len)}{extra}",
                          (kv_len,) * batch, q_len, cfg.n_q_heads, cfg.kv_lora_rank,
                          cfg.qk_rope_head_dim, page_size, kv_dtype, lnc, kv_scale)


DEEPSEEK_V3_TP8 = DEEPSEEK_V3.tp_shard(8)
MLA_MODELS = (
    mla_decode_of(DEEPSEEK_V3, 4096),
    mla_decode_of(DEEPSEEK_V3, 32768),
    mla_decode_of(DEEPSEEK_V3, 32768, q_len=2),
    mla_decode_of(DEEPSEEK_V3, 32768, kv_dtype="fp8"),
    mla_decode_of(DEEPSEEK_V3, 4096, batch=32, page_size=64),
    mla_decode_of(DEEPSEEK_V3, 4096, batch=128, page_size=64),
    mla_decode_of(DEEPSEEK_V3, 32768, batch=32, page_size=64, kv_dtype="fp8"),
    mla_decode_of(DEEPSEEK_V3_TP8, 4096),
    mla_decode_of(DEEPSEEK_V3_TP8, 32768),
    mla_decode_of(DEEPSEEK_V3_TP8, 32768, q_len=2),
    mla_decode_of(DEEPSEEK_V3_TP8, 32768, kv_dtype="fp8"),
    mla_decode_of(DEEPSEEK_V3_TP8, 4096, batch=32, page_size=64),
    mla_decode_of(DEEPSEEK_V3_TP8, 4096, batch=128, page_size=64, kv_dtype="fp8"),
    mla_decode_of(DEEPSEEK_V3_TP8, 32768, batch=32, page_size=64, q_len=2),
)
# FP8 latent caches with per-token scales (the per-tensor FP8 rows of MLA_MODELS, per token)
MLA_TOKEN_MODELS = (
    mla_decode_of(DEEPSEEK_V3, 32768, kv_dtype="fp8", kv_scale="token"),
    mla_decode_of(DEEPSEEK_V3, 32768, batch=32, page_size=64, kv_dtype="fp8", kv_scale="token"),
    mla_decode_of(DEEPSEEK_V3_TP8, 32768, kv_dtype="fp8", kv_scale="token"),
    mla_decode_of(DEEPSEEK_V3_TP8, 4096, batch=128, page_size=64, kv_dtype="fp8",
                  kv_scale="token"),
)
MLA_DEFAULT = (mla_decode_of(DEEPSEEK_V3_TP8, 4096),)
MLA_FAST = (MLADecodeShape("small mla H=16 B=2 L=300", (300, 77), 1, 16, page_size=16),
            MLADecodeShape("small mla H=128 B=1 L=200 s_q=2", (200,), 2, 128))


# Paged attention bench rows (issue 16): ragged serving steps over a paged cache (block 64), bf16
# and FP8 KV ("fp8" = the target's FP8). Chunked prefill of Llama-3-8B on one KV-head group (its 4
# query heads and their KV head, as the prefill bench) with a 2K chunk over 0 / 8K / 32K cached
# tokens; a mixed step of 32 decodes at 4K + one fresh 2K chunk on 4 of the 8 KV heads (16 query
# heads: one full decode row group, as the decode bench's slices). The names say which slice runs.
@dataclass(frozen=True)
class PagedBenchShape:
    """A paged-attention step: request ``r`` has ``q_lens[r]`` new tokens, the last ones of its
    ``seq_lens[r]`` (cached prefix + the new tokens, already appended); the heads that run, the
    page size, the cache dtype and the cores used."""
    name: str
    q_lens: tuple
    seq_lens: tuple
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    page_size: int = 64
    kv_dtype: str = "bfloat16"
    lnc: int = 1

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)


def paged_chunk_of(cfg: ModelConfig, chunk: int, prefix: int, page_size: int = 64,
                   kv_dtype: str = "bfloat16") -> PagedBenchShape:
    """A ``chunk``-token prompt chunk over ``prefix`` cached tokens, one KV-head group of cfg."""
    g = cfg.gqa_group
    fp8 = " fp8" if kv_dtype != "bfloat16" else ""
    return PagedBenchShape(f"{_slug(cfg)} chunk {_k(chunk)} over {_k(prefix)} paged/{page_size}"
                           f"{fp8} ({g} of {cfg.n_q_heads} q-heads)", (chunk,), (prefix + chunk,),
                           g, 1, cfg.head_dim, page_size, kv_dtype)


def paged_mixed_of(cfg: ModelConfig, n_decode: int, decode_len: int, chunk: int, prefix: int = 0,
                   kv_heads: int = 0, page_size: int = 64,
                   kv_dtype: str = "bfloat16") -> PagedBenchShape:
    """``n_decode`` decodes at ``decode_len`` tokens + one ``chunk`` over ``prefix``, on
    ``kv_heads`` of cfg's KV heads (0 = all) and their query heads."""
    hkv = kv_heads or cfg.n_kv_heads
    fp8 = " fp8" if kv_dtype != "bfloat16" else ""
    over = f" over {_k(prefix)}" if prefix else ""
    part = f" ({hkv} of {cfg.n_kv_heads} KV heads)" if hkv != cfg.n_kv_heads else ""
    return PagedBenchShape(f"{_slug(cfg)} {n_decode}x{_k(decode_len)} decodes + {_k(chunk)} chunk"
                           f"{over} paged/{page_size}{fp8}{part}", (1,) * n_decode + (chunk,),
                           (decode_len,) * n_decode + (prefix + chunk,), cfg.gqa_group * hkv, hkv,
                           cfg.head_dim, page_size, kv_dtype)


PAGED_MODELS = tuple(paged_chunk_of(LLAMA3_8B, 2048, p, kv_dtype=dt)
                     for dt in ("bfloat16", "fp8") for p in (0, 8192, 32768)) + tuple(
    paged_mixed_of(LLAMA3_8B, 32, 4096, 2048, kv_heads=4, kv_dtype=dt) for dt in ("bfloat16", "fp8"))
# the serving path: the mixed step (bf16), both the decode and the prefill paths (~50 s emulated)
PAGED_DEFAULT = (PAGED_MODELS[6],)
PAGED_FAST = (
    PagedBenchShape("small mixed 3 decodes + chunk 200 over 100 + idle paged/16", (1, 1, 1, 200, 0),
                    (300, 77, 1, 300, 50), 4, 1, 128, 16),
    PagedBenchShape("small chunk 256 over 512 gqa 8/2 d=64 paged/64", (256,), (768,), 8, 2, 64, 64),
)

# ---------------------------------------------------------------------------------------- tiers


@dataclass(frozen=True)
class Tier:
    """One tier of the shapes table: a tuple of shapes per op family."""
    name: str
    matmul: tuple[MatmulShape, ...] = ()
    mx_matmul: tuple[MatmulShape, ...] = ()
    attention: tuple[AttentionShape, ...] = ()
    decode: tuple[DecodeShape, ...] = ()
    qkv: tuple[QKVShape, ...] = ()
    mlp: tuple[MLPShape, ...] = ()
    moe: tuple[MoEShape, ...] = ()
    rmsnorm: tuple[RMSNormShape, ...] = ()

    def of(self, family: str) -> tuple:
        """The shapes of one op family: ``FAST.of("matmul")``."""
        if family not in FAMILIES:
            raise ValueError(f"shape family must be one of {', '.join(FAMILIES)}; got {family!r}")
        return getattr(self, family)


FAMILIES = tuple(f.name for f in fields(Tier) if f.name != "name")


DECODE_TOKENS = (1, 8, 32, 64)   # decode-like GEMM row counts (batch x q_len)

FAST = Tier(
    "fast",
    # Emulated cost grows with M*K*N: 2048^3 takes ~5-10 s on this machine, so FAST stops there.
    matmul=(
        MatmulShape("128x256x512", 128, 256, 512),
        square(512),
        square(2048),
        linear_of(DEEPSEEK_V3, 8, "expert_up"),     # 8 x 7168 -> 2048 (decode, weight-bound)
        linear_of(DEEPSEEK_V3, 64, "expert_up"),
    ),
    mx_matmul=(square(512), MatmulShape("256x1024x512", 256, 1024, 512)),
    attention=(
        AttentionShape("small causal", 1, 256, 256, 4, 1, 128, True),
        AttentionShape("small non-causal d64", 1, 128, 384, 2, 2, 64, False),
    ),
    decode=(
        DecodeShape("small gqa4", 2, 1, 512, 8, 2, 128, 16),
        DecodeShape("small mha", 1, 1, 256, 2, 2, 64, 16),
    ),
    qkv=(QKVShape("small", 64, 512, 8, 2, 64), QKVShape("small T=1", 1, 512, 8, 2, 64)),
    mlp=(MLPShape("small", 64, 512, 1024), MLPShape("small T=1", 1, 512, 1024)),
    moe=(MoEShape("small", 32, 512, 256, 8, 2),),
    rmsnorm=(RMSNormShape("small", 128, 1024), RMSNormShape("one row", 1, 4096)),
)

ODD = Tier(
    "odd",
    matmul=(
        MatmulShape("1x128x128", 1, 128, 128),
        MatmulShape("113x257x129", 113, 257, 129),
        MatmulShape("1000x384x200", 1000, 384, 200),
        MatmulShape("7x1000x513", 7, 1000, 513),
    ),
    mx_matmul=(MatmulShape("1x512x128", 1, 512, 128), MatmulShape("113x1024x200", 113, 1024, 200)),
    attention=(
        AttentionShape("S=1", 1, 1, 1, 2, 1, 128, True),
        AttentionShape("S=113", 1, 113, 113, 4, 2, 64, True),
        AttentionShape("Sq=100 Skv=1000", 1, 100, 1000, 2, 1, 128, False),
        AttentionShape("S=1000 window 97", 1, 1000, 1000, 2, 2, 64, True, 97),
    ),
    decode=(
        DecodeShape("empty cache", 2, 1, 0, 4, 1, 128, 16),
        DecodeShape("L=1", 1, 1, 1, 4, 1, 128, 16),
        DecodeShape("L=113", 3, 1, 113, 8, 2, 128, 16),
        DecodeShape("L=1000 q_len=3", 1, 3, 1000, 4, 2, 64, 32),
    ),
    qkv=(QKVShape("T=113", 113, 384, 6, 2, 64), QKVShape("T=1000", 1000, 256, 4, 1, 64)),
    mlp=(MLPShape("T=113", 113, 384, 1000), MLPShape("T=1 H=200", 1, 200, 300)),
    moe=(MoEShape("T=1", 1, 256, 128, 8, 2), MoEShape("T=113", 113, 384, 200, 16, 4)),
    rmsnorm=(RMSNormShape("T=113 H=1000", 113, 1000), RMSNormShape("T=1 H=127", 1, 127),
             RMSNormShape("T=0", 0, 512)),
)

# Fused-MoE targets (issue 18): Qwen3-30B-A3B, DeepSeek-V3 as one EP rank of 8 (32 local experts
# of 256, one shared expert, sigmoid routing with 8 groups keep 4, scaling 2.5), Mixtral-8x7B at
# TP8; decode T = 1, 8, 64 and prefill T = 4096.
MIXTRAL_8X7B_TP8 = MIXTRAL_8X7B.tp_shard(8)
DEEPSEEK_V3_ROUTING = dict(n_groups=8, topk_groups=4, scoring="sigmoid", routed_scaling=2.5)
MOE_TARGETS = (tuple(moe_of(QWEN3_30B_A3B, t) for t in (1, 8, 64, 4096))
               + tuple(moe_shard_of(DEEPSEEK_V3, t, ep=8, **DEEPSEEK_V3_ROUTING)
                       for t in (1, 8, 64, 4096))
               + tuple(moe_of(MIXTRAL_8X7B_TP8, t) for t in (1, 8, 64, 4096)))
# MXFP8 expert weights (Trn3) of issue 18: Qwen3-30B-A3B T = 1, 8, 64, 4096; DeepSeek-V3 EP8
# T = 8 and 4096 (a subset of MOE_TARGETS, benched with dtype "mx").
MOE_MX_TARGETS = MOE_TARGETS[0:4] + (MOE_TARGETS[5], MOE_TARGETS[7])

MODELS = Tier(
    "models",
    matmul=(
        square(4096),
        *(linear_of(LLAMA3_8B, m, "up") for m in DECODE_TOKENS),        # 4096 -> 14336
        *(linear_of(DEEPSEEK_V3, m, "expert_up") for m in DECODE_TOKENS),  # 7168 -> 2048
        linear_of(LLAMA3_70B_TP8, 128, "o"),                               # 1024 -> 8192
        linear_of(QWEN3_30B_A3B, 64, "expert_down"),                       # 768 -> 2048
    ),
    mx_matmul=(square(4096),
               *(linear_of(DEEPSEEK_V3, m, "expert_up") for m in (1, 16, 64, 256, 1024))),
    attention=(
        attention_of(LLAMA3_8B, 2048), attention_of(LLAMA3_8B, 8192),
        attention_of(LLAMA3_8B, 32768),
        AttentionShape("llama-3-8b heads d=64 S=8192", 1, 8192, 8192, 32, 8, 64),
        attention_of(LLAMA3_70B_TP8, 8192), attention_of(GEMMA3_27B, 4096),
        attention_of(GEMMA3_12B, 2048), attention_of(GEMMA3_12B, 8192),      # head_dim 256
    ),
    decode=(
        decode_of(LLAMA3_8B, 8192), decode_of(LLAMA3_8B, 2048, batch=8),
        decode_of(LLAMA3_70B_TP8, 8192, batch=4), decode_of(QWEN3_30B_A3B, 4096, batch=4),
        decode_of(QWEN3_235B_A22B, 4096, batch=4), decode_of(MIXTRAL_8X7B, 4096, batch=2),
    ),
    qkv=tuple(qkv_of(LLAMA3_8B, t) for t in (1, 8, 32, 128, 512, 2048, 8192))
    + tuple(qkv_of(LLAMA3_70B_TP8, t) for t in (1, 8, 32, 128, 512, 2048, 8192)),
    mlp=tuple(mlp_of(LLAMA3_8B, t) for t in (1, 8, 32, 128, 512, 2048, 8192))
    + tuple(mlp_of(LLAMA3_70B_TP8, t) for t in (1, 8, 32, 128, 2048, 8192)),
    moe=tuple(moe_of(MIXTRAL_8X7B, t) for t in (1, 64, 256))
    + tuple(moe_of(QWEN3_30B_A3B, t) for t in (1, 64, 256, 1024))
    + (moe_of(QWEN3_235B_A22B, 256), moe_of(DEEPSEEK_V3, 1), moe_of(DEEPSEEK_V3, 256))
    + tuple(moe_of(QWEN3_30B_A3B, t) for t in (8, 4096))      # the rest of MOE_TARGETS
    + MOE_TARGETS[4:],
    rmsnorm=(rmsnorm_of(LLAMA3_8B, 2048), rmsnorm_of(LLAMA3_70B, 2048),
             rmsnorm_of(LLAMA3_70B, 32768), rmsnorm_of(DEEPSEEK_V3, 128),
             rmsnorm_of(GEMMA3_27B, 512)),
)

# DEFAULT: the plain ``nki-kernels bench`` run and the model shapes the default test run checks:
# one or two real model shapes per op, the cheapest to emulate that still exercise the op's main
# path (an MLP model shape alone costs ~30 s of emulation; the rest of MODELS stays slow).
DEFAULT = Tier(
    "default",
    matmul=(
        linear_of(DEEPSEEK_V3, 8, "expert_up"),        # decode regime, weight-bound
        linear_of(LLAMA3_70B_TP8, 128, "o"),           # prefill regime, K = 1024
    ),
    mx_matmul=(linear_of(DEEPSEEK_V3, 16, "expert_up"),),
    attention=(attention_of(GEMMA3_12B, 2048),),        # causal + sliding window, d = 256
    decode=(decode_of(LLAMA3_8B, 2048, batch=8),),
    qkv=(qkv_of(LLAMA3_70B_TP8, 8),),                   # decode regime (prefill: FAST, MODELS)
    mlp=(mlp_of(LLAMA3_70B_TP8, 128),),            # the bench runs its FP8 (W8A8) form only
    moe=(moe_of(QWEN3_30B_A3B, 64),),
    rmsnorm=(rmsnorm_of(DEEPSEEK_V3, 128), rmsnorm_of(LLAMA3_8B, 2048)),
)

TIERS = {t.name: t for t in (FAST, ODD, MODELS, DEFAULT)}


def tier(name: str) -> Tier:
    """Look up a tier by name (``fast``, ``odd``, ``models``)."""
    key = str(name).lower()
    if key not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)}; got {name!r}")
    return TIERS[key]


# KV-cache append bench rows (issue 16): one layer's new K/V written into a paged cache (block 64)
# by ``kv_cache_append``: a decode step of 64 sequences (T = 64, one token each, scattered slots)
# and a 2K prefill chunk (T = 2048, whole pages), Llama-3-8B (8 KV heads) and Llama-3-70B TP8
# (1 KV head: 256-byte rows), bf16 and FP8 caches ("fp8" = the target's FP8).
@dataclass(frozen=True)
class KVAppendShape:
    """``tokens`` new tokens of ``n_kv_heads`` x ``head_dim`` into a paged cache of
    ``block_size``-token pages; ``prefill``: the tokens fill whole pages (one prompt chunk),
    else one token per sequence at a random offset (a decode step)."""
    name: str
    tokens: int
    n_kv_heads: int
    head_dim: int
    block_size: int = 64
    kv_dtype: str = "bfloat16"
    prefill: bool = False
    decodes: int = 0             # prefill: this many single decode tokens come first (mixed step)


def kv_append_of(cfg: ModelConfig, tokens: int, prefill: bool, block_size: int = 64,
                 kv_dtype: str = "bfloat16", decodes: int = 0) -> KVAppendShape:
    what = f"prefill chunk T={tokens}" if prefill else f"decode step T={tokens}"
    if decodes:
        what = f"mixed step {decodes} decodes + chunk {tokens}"
    fp8 = " fp8" if kv_dtype != "bfloat16" else ""
    return KVAppendShape(f"{_slug(cfg)} {what} paged/{block_size}{fp8}", tokens + decodes,
                         cfg.n_kv_heads, cfg.head_dim, block_size, kv_dtype, prefill, decodes)


KV_APPEND_MODELS = tuple(kv_append_of(cfg, t, t > 64, kv_dtype=dt)
                         for cfg in (LLAMA3_8B, LLAMA3_70B_TP8) for dt in ("bfloat16", "fp8")
                         for t in (64, 2048)) + tuple(
    kv_append_of(LLAMA3_8B, 2048, True, kv_dtype=dt, decodes=32) for dt in ("bfloat16", "fp8"))
KV_APPEND_DEFAULT = (KV_APPEND_MODELS[1],)     # Llama-3-8B prefill chunk, bf16
KV_APPEND_FAST = (KVAppendShape("small decode T=7 H=2 d=64 paged/16", 7, 2, 64, 16),
                  KVAppendShape("small decode T=300 H=2 d=64 paged/16", 300, 2, 64, 16),
                  KVAppendShape("small chunk T=300 H=2 d=64 paged/16 fp8", 300, 2, 64, 16, "fp8",
                                prefill=True))
