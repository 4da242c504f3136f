"""KV-cache layouts for decode kernels: contiguous and paged (vLLM), and how a tile of keys lands
in SBUF.

Host side: :class:`KVLayout` (cache geometry, compile-time) and :func:`tokens_per_partition`.
Kernel side: :func:`page_rows` (the block table of one sequence turned into per-partition row
indices on chip) and :func:`load_kv_tile` (one tile of keys of all KV heads, contiguous or
gathered through the block table).

Caches (token-major, every KV head of a token together, as vLLM stores them):

* contiguous ``[B, S_max, H_kv, d]``;
* paged ``[num_blocks, block_size, H_kv, d]`` with ``block_table [B, max_blocks]`` int32.

A **KV tile** holds ``128 * T`` consecutive keys of one sequence as ``[128, T, H_kv, d]``:
partition ``p`` holds keys ``k0 + p*T ... k0 + p*T + T - 1``, all heads. In HBM those ``T``
tokens are one contiguous run of ``T * H_kv * d`` elements (inside one page: ``T`` divides the
block size), so every DMA descriptor moves one long run per partition (4-16 KiB) instead of one
256-byte head row: the DMA queues stream at their best efficiency (hardware.md A.6).

Paged gather: the cache is viewed as rows of ``T`` tokens (``[num_blocks * R, T * H_kv * d]``,
``R = block_size / T`` rows per page) and one DMA per tile gathers partition ``p``'s row through
a ``vector_offset`` (software DGE), row ``= block_table[b, page] * R + p % R``. The indices are
built on chip from the block table: one contiguous DMA of the sequence's table entries (tiles on
partitions), one VectorE op that expands every page into its ``R`` rows, one TensorE transpose
that puts the rows of a tile on partitions (fp32: exact below 2^24 rows). Table entries past a
sequence's end are never read, nor are the cache rows they would point to.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..backend import nisa, nl

P = 128
RUN_BYTES = 16384      # target contiguous bytes per partition of a KV tile
MAX_T = 16             # tokens per partition: a tile is <= 2048 keys (4 PSUM banks of fp32 scores)
MIN_RUN = 4096         # ... but runs of at least 4 KiB (97% DMA efficiency, hardware.md A.6)
PAGE_REG = False       # paged: page numbers as (1, 1) SBUF offsets (True: a register_load per
                       # page first; on Llama-3-70B TP8 paged/64 the Sync queue then binds:
                       # 222 vs 190 us, Trn3 modeled)
MIN_TILES = 4          # tiles per program wanted for the pipeline (short batches: smaller tiles)
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class KVLayout(nl.NKIObject):
    """Geometry of a KV cache and of its tiles (compile-time).

    paged: vLLM paged layout (block_size tokens per page) or contiguous per sequence.
    T: tokens per partition of a tile; R: partitions per page (paged; ``block_size / T``).
    """
    paged: bool
    block_size: int
    h_kv: int
    d: int
    T: int

    @property
    def tile_keys(self) -> int:
        return P * self.T

    @property
    def R(self) -> int:
        return self.block_size // self.T if self.paged else 1

    @property
    def row(self) -> int:
        """Elements per partition of a tile (one contiguous HBM run)."""
        return self.T * self.h_kv * self.d


def tokens_per_partition(h_kv: int, d: int, itemsize: int, block_size: int | None = None,
                         max_len: int | None = None, total: int | None = None) -> int:
    """T: the largest power of two with ``T * H_kv * d * itemsize <= RUN_BYTES`` (and <= MAX_T,
    dividing the block size when paged); no larger than the longest sequence needs, and small
    enough that a program's ``total`` keys make MIN_TILES tiles (a pipeline needs tiles to
    overlap) unless runs would drop below MIN_RUN bytes."""
    t = 1 if block_size is None else max(1, block_size // P)    # at most 128 partitions per page
    while (t * 2 <= MAX_T and t * 2 * h_kv * d * itemsize <= RUN_BYTES
           and (block_size is None or block_size % (t * 2) == 0)
           and (max_len is None or P * t < max_len)
           and (total is None or t * h_kv * d * itemsize < MIN_RUN
                or P * t * 2 * MIN_TILES <= total)):
        t *= 2
    return t


# ------------------------------------------------------------------------------ kernel helpers


def page_rows(block_table, b: int, k0: int, nkeys: int, lay: KVLayout):
    """Row indices of the gather for the tiles covering keys ``[k0, k0 + nkeys)`` of sequence
    ``b`` (``k0`` a multiple of ``128 T``): int32 SBUF ``[128, ntiles]`` with
    ``idx[p, c] = block_table[b, page(c, p)] * R + p % R``.

    Reads only the table entries of the pages these keys occupy (``ceil`` of the last key over
    the block size); slots of pages past the end hold 0 and are never used. ``ntiles <= 128``."""
    R = lay.R
    ppt = P // R                                   # pages per tile
    ntiles = -(-nkeys // lay.tile_keys)
    page0 = k0 // lay.block_size
    need = -(-(k0 + nkeys) // lay.block_size) - page0
    full, rest = need // ppt, need % ppt
    bt_i = nl.ndarray((ntiles, ppt), dtype=nl.int32, buffer=nl.sbuf)           # [ntiles, ppt]
    bt_f = nl.ndarray((ntiles, ppt), dtype=nl.float32, buffer=nl.sbuf)
    if full < ntiles:
        nisa.memset(dst=bt_i[full:ntiles, :], value=0, engine=nisa.engine.gpsimd)
    if full > 0:
        src = block_table[b, page0:page0 + full * ppt].reshape((full, ppt))
        nisa.dma_copy(dst=bt_i[0:full, :], src=src)
    if rest:
        a = page0 + full * ppt
        nisa.dma_copy(dst=bt_i[full:full + 1, 0:rest],
                      src=block_table[b, a:a + rest].reshape((1, rest)))
    nisa.tensor_copy(dst=bt_f, src=bt_i, engine=nisa.engine.vector)
    rows_f = nl.ndarray((ntiles, ppt, R), dtype=nl.float32, buffer=nl.sbuf)    # [ntiles, ppt, R]
    if R > 1:
        rmod = nl.ndarray((ntiles, ppt, R), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=rmod, pattern=[[0, ppt], [1, R]], offset=0, channel_multiplier=0)
        rmod_f = nl.ndarray((ntiles, ppt, R), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=rmod_f, src=rmod, engine=nisa.engine.gpsimd)
        nisa.scalar_tensor_tensor(dst=rows_f, data=bt_f.expand_dim(2).broadcast(2, R),
                                  op0=nl.multiply, operand0=float(R), op1=nl.add,
                                  operand1=rmod_f)
    else:
        nisa.tensor_copy(dst=rows_f, src=bt_f.expand_dim(2), engine=nisa.engine.vector)
    rows_ps = nl.ndarray((P, ntiles), dtype=nl.float32, buffer=nl.psum)          # [128, ntiles]
    nisa.nc_transpose(dst=rows_ps, data=rows_f.reshape((ntiles, P)), engine=nisa.engine.tensor)
    idx = nl.ndarray((P, ntiles), dtype=nl.int32, buffer=nl.sbuf)               # [128, ntiles]
    nisa.tensor_copy(dst=idx, src=rows_ps, engine=nisa.engine.vector)
    return idx


def load_kv_tile(dst, cache, lay: KVLayout, b: int, k0: int, n: int, idx=None, zero_tail=False):
    """Keys ``[k0, k0 + n)`` of sequence ``b`` (``n <= 128 T``, ``k0`` a multiple of ``128 T``)
    into ``dst [128, T, H_kv, d]`` SBUF: partition ``p`` gets keys ``k0 + p T ...``.

    Full partitions move in one DMA (contiguous slice, or a gather through ``idx [128, 1]`` int32,
    see :func:`page_rows`); a last partial partition (``n % T`` keys) in a second small one. Slots
    past ``n`` are left unwritten (``zero_tail``: the partial partition's are zeroed, for tiles
    that enter a matmul whole): nothing past a sequence's end is read."""
    T, row = lay.T, lay.row
    nfull, rem = n // T, n % T
    flat = dst.reshape((P, row))
    tok = lay.h_kv * lay.d
    if rem and zero_tail:
        nisa.memset(dst=flat[nfull:nfull + 1, rem * tok:row], value=0.0, engine=nisa.engine.gpsimd)
    if not lay.paged:
        if nfull:
            src = cache[b, k0:k0 + nfull * T].reshape((nfull, row))
            nisa.dma_copy(dst=flat[0:nfull, :], src=src)
        if rem:
            a = k0 + nfull * T
            nisa.dma_copy(dst=flat[nfull:nfull + 1, 0:rem * tok],
                          src=cache[b, a:a + rem].reshape((1, rem * tok)))
        return
    rows = cache.reshape((cache.shape[0] * lay.R, row))                    # [num_blocks * R, row]
    if nfull:
        nisa.dma_copy(dst=flat[0:nfull, :],
                      src=rows.ap([[row, nfull], [1, row]], offset=0,
                                  vector_offset=idx[0:nfull, :], indirect_dim=0))
    if rem:
        nisa.dma_copy(dst=flat[nfull:nfull + 1, 0:rem * tok],
                      src=rows.ap([[row, 1], [1, rem * tok]], offset=0,
                                  vector_offset=idx[nfull:nfull + 1, :], indirect_dim=0))


def load_kv_tile_pages(pairs, lay: KVLayout, b: int, k0: int, n: int, bt_sb, page0: int,
                       swdge_every: int = 0):
    """The paged form of :func:`load_kv_tile` with one DMA per page and cache: each page's
    physical number, an element of ``bt_sb [1, pages]`` (int32 SBUF: the sequence's block-table
    entries from ``page0`` on), addresses the page as a scalar dynamic offset (a (1, 1) SBUF
    offset, or a register loaded from it with PAGE_REG; any DGE, no per-row index
    descriptors), shared by K and V. Partitions
    ``[i R, (i + 1) R)`` of the tile get page ``i`` of the tile (``T`` tokens each; a partial last
    partition gets the remaining keys). ``pairs``: ``(dst [128, T, H_kv, d], cache, zero_tail)``.
    ``swdge_every`` k > 0: every k-th page's DMAs go through the software DGE (GpSimd builds their
    descriptors) instead of a Sync trigger each, for callers whose page DMAs outrun the Sync
    queue."""
    T, row, R, bs = lay.T, lay.row, lay.R, lay.block_size
    tok = lay.h_kv * lay.d
    nfull, rem = n // T, n % T
    views = []
    for dst, cache, zero_tail in pairs:
        flat = dst.reshape((P, row))
        if rem and zero_tail:
            nisa.memset(dst=flat[nfull:nfull + 1, rem * tok:row], value=0.0,
                        engine=nisa.engine.gpsimd)
        views.append((flat, cache.reshape((cache.shape[0], bs * tok))))   # [num_blocks, page]
    for i in range(-(-n // bs)):
        p0 = i * R
        j = (k0 - page0 * bs) // bs + i            # entry of bt_sb
        if PAGE_REG:
            reg = nisa.register_alloc()
            nisa.register_load(dst=reg, src=bt_sb[0:1, j:j + 1])
        else:
            reg = bt_sb[0:1, j:j + 1]
        full = max(0, min(R, nfull - p0))
        kw = {}
        if swdge_every and i % swdge_every == swdge_every - 1:
            kw = dict(dge_mode=nisa.dge_mode.swdge)
        for flat, pages in views:
            if full:
                nisa.dma_copy(dst=flat[p0:p0 + full, :],
                              src=pages.ap([[row, full], [1, row]], offset=0, scalar_offset=reg,
                                           indirect_dim=0), **kw)
            if rem and p0 <= nfull < p0 + R:
                a = (nfull - p0) * row               # partition nfull inside the page
                nisa.dma_copy(dst=flat[nfull:nfull + 1, 0:rem * tok],
                              src=pages.ap([[row, 1], [1, rem * tok]], offset=a,
                                           scalar_offset=reg, indirect_dim=0))


def pair_heads(d: int):
    """FP8 K^T by DMA transpose: ``(dp, hpt)``, the 2-byte pairs per head (``d / 2``) and the
    heads whose pairs share the 128 partitions of one transpose; None where ``d / 2`` does not
    divide 128 (d = 192)."""
    dp = d // 2
    if d % 2 or dp > P or P % dp:
        return None
    return dp, P // dp


def load_kT_pairs(dst, cache, lay: KVLayout, b: int, k0: int, n: int, h0: int, hn: int):
    """FP8 keys ``[k0, k0 + n)`` of heads ``[h0, h0 + hn)`` of sequence ``b`` of a contiguous
    cache as K^T pairs, by DMA transposes of 2-byte elements (DMA transposes move 2- or 4-byte
    elements, nki-spec 9.2.2): ``dst [128, >= n rounded up to 16]`` uint16 SBUF, partition
    ``(h - h0) d/2 + i`` holds dims ``2i`` (low byte) and ``2i + 1`` (high byte) of head ``h``,
    column ``c`` key ``k0 + c``; viewed as FP8 ``[128, 2 cols]``, the even / odd dims are the even /
    odd columns. Columns from ``n`` to the next multiple of 16 are zero.

    One transpose of ``[16, m, C]`` blocks (``C = hn d/2`` contiguous elements per key, 16 keys
    per block: the hardware-DGE shape rule); the last ``n % 16`` keys go through a zeroed 16-key
    SBUF block. Nothing past a sequence's end is read."""
    dp = lay.d // 2
    C, tok = hn * dp, lay.h_kv * dp
    c16 = cache.view(nl.uint16)                                    # [B, S_max, H_kv, d/2]
    base = ((b * cache.shape[1] + k0) * lay.h_kv + h0) * dp
    m = n // 16 * 16
    if m:
        nisa.dma_transpose(dst=dst[0:C, 0:m].reshape_dim(1, (m // 16, 16)),
                           src=c16.ap([[tok, 16], [16 * tok, m // 16], [1, C]], offset=base))
    if n > m:
        blk = nl.ndarray((16, C), dtype=nl.uint16, buffer=nl.sbuf)              # [16 keys, C]
        nisa.memset(dst=blk, value=0, engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=blk[0:n - m, :], src=c16.ap([[tok, n - m], [1, C]], offset=base + m * tok))
        nisa.dma_transpose(dst=dst[0:C, m:m + 16].reshape_dim(1, (1, 16)), src=blk.expand_dim(1))
