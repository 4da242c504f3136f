"""Online softmax over key blocks: running max, running sum, rescale of the output accumulator.

Kernel helpers (called inside a jitted kernel) shared by flash attention, flash-decoding,
paged attention and MLA decode. Rows live on partitions (one query row per partition); state
tiles are fp32 SBUF.

Units. Scores reach the softmax as a tile ``X`` with ``logit = xmul * X``: ``xmul = 1`` when the
kernel already scaled the scores (Trn3, whose VectorE ``exponential`` has no scale operand),
``xmul = scale`` when the exponential reads raw ``Q K^T`` from PSUM (ScalarE ``activation`` applies
the scale for free). The running max ``m`` is kept in X units too.

Per block (``m_old`` = running max before the block)::

    m_new = max(m_old, partial row maxes of the block)            # combine_max (1 VectorE op)
    p     = exp(xmul * (X - m_new))                                # exp_rows
    alpha = exp(xmul * (m_old - m_new))                           # rescale_factor
    o     = o * alpha + P @ V_aug                                  # accumulate_o
    end:  out = o[:, :d] / o[:, d],  lse = xmul * m + log(o[:, d]) # finalize

The running sum ``l`` rides in the output accumulator: ``V_aug = [V | 1]`` has a ones column, so
``P @ V_aug`` yields ``sum_j p_j`` (of the bf16 probabilities actually used, which makes the
normalisation consistent) in column ``d`` and one rescale updates numerator and denominator
together (``sum_in_o=True``). With ``sum_in_o=False`` the sum comes from the exponential's fused
reduction instead (``exp_rows(..., with_sum=True)`` then ``update_sum``).

The partial maxes are written by the instructions that evict / mask the scores (their fused
``reduce_res``) into columns of one ``[rows, MAX_PARTS]`` tile whose column 0 already holds
``m_old``; ``combine_max`` reduces the used columns straight into column 0 of the next block's
tile, so no copy is made. The running max starts at ``M_FLOOR`` (or the attention sink), a finite
floor above ``FP32_MIN``: masked scores then give ``exp(FP32_MIN - m) = 0`` exactly, also for a
row that has seen only masked keys so far.

Attention sinks (GPT-OSS) start the state at ``m = sink / xmul`` with ``l = 1``
(``exp(sink - m) = 1``) and ``o = 0``: ``exp(sink)`` joins the denominator only.
"""
from __future__ import annotations

from ..backend import nisa, nl

M_FLOOR = -1.0e30      # running-max floor (X units); any real logit is far above it
MAX_PARTS = 8          # column 0 = m_old, then up to 7 partial maxes per block

_ENG = {"vector": "vector", "scalar": "scalar", "gpsimd": "gpsimd"}


def _engine(name):
    return getattr(nisa.engine, _ENG[name])


class SoftmaxState:
    """Trace-time holder of one row tile's softmax state (tiles, not values).

    rows: partitions used; d: output width; xmul: logit = xmul * X (see module doc);
    sink: optional fp32 ``[rows, 1]`` tile holding the sink logit of every row (logit units);
    resume: ``(o_hbm [rows, d+1], m_hbm [rows, 1])`` fp32 HBM views of a saved state;
    sum_in_o: the row sum is column d of ``o`` (V carries a ones column).
    """

    def __init__(self, rows: int, d: int, xmul: float, sink=None, resume=None,
                 sum_in_o: bool = True):
        self.rows = rows
        self.d = d
        self.xmul = float(xmul)
        self.sum_in_o = sum_in_o
        self.ncols = 1
        self.mp = nl.ndarray((rows, MAX_PARTS), dtype=nl.float32, buffer=nl.sbuf)  # [rows, 8]
        self.l = None                   # [rows, 1] (sum_in_o=False)
        self.pending_sums = []          # deferred l updates (exp_block(defer_sum=True))
        self.o = None                   # [rows, d (+1)] fp32 SBUF, None until the first block
        self.started = False            # a block (or sink, or resumed state) is accumulated
        self.m_old = self.m_new = self.alpha = None
        self._prev_mp = None
        if resume is not None:
            self._load(*resume)
        elif sink is None:
            nisa.memset(dst=self.mp[:, 0:1], value=M_FLOOR, engine=nisa.engine.gpsimd)
        else:
            # m = sink / xmul (X units); the state holds exp(sink - m) = 1 in the sum, 0 in o
            nisa.tensor_scalar(dst=self.mp[:, 0:1], data=sink, op0=nl.multiply,
                               operand0=1.0 / self.xmul)
            w = d + 1 if sum_in_o else d
            self.o = nl.ndarray((rows, w), dtype=nl.float32, buffer=nl.sbuf)      # [rows, w]
            nisa.memset(dst=self.o[:, 0:d], value=0.0, engine=nisa.engine.gpsimd)
            if sum_in_o:
                nisa.memset(dst=self.o[:, d:d + 1], value=1.0, engine=nisa.engine.gpsimd)
            else:
                self.l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=self.l, value=1.0)
            self.started = True

    # -- running max --------------------------------------------------------------------------
    def max_slot(self):
        """The next free column of the partial-max tile (a ``[rows, 1]`` view) for a fused
        ``reduce_res``; call once per instruction that contributes a partial max."""
        if self.ncols >= MAX_PARTS:
            raise ValueError(f"softmax: more than {MAX_PARTS - 1} partial maxes in one block")
        c = self.ncols
        self.ncols += 1
        return self.mp[:, c:c + 1]

    def combine_max(self):
        """``m_new = max(m_old, partial maxes)`` written into column 0 of the next block's tile."""
        nxt = nl.ndarray((self.rows, MAX_PARTS), dtype=nl.float32, buffer=nl.sbuf)  # [rows, 8]
        nisa.tensor_reduce(dst=nxt[:, 0:1], op=nl.maximum, data=self.mp[:, 0:self.ncols], axis=1)
        self.m_old = self.mp[:, 0:1]
        self.m_new = nxt[:, 0:1]
        self._prev_mp = self.mp          # keeps m_old alive until the next combine
        self.mp = nxt
        self.ncols = 1
        return self.m_new

    def neg_max(self, engine="vector"):
        """``-xmul * m_new`` (the ScalarE exp bias), one small op on ``engine``."""
        nb = nl.ndarray((self.rows, 1), dtype=nl.float32, buffer=nl.sbuf)          # [rows, 1]
        if engine == "scalar":
            nisa.activation(dst=nb, op=nl.copy, data=self.m_new, scale=-self.xmul)
        else:
            nisa.tensor_scalar(dst=nb, data=self.m_new, op0=nl.multiply, operand0=-self.xmul)
        return nb

    # -- exponentials ---------------------------------------------------------------------------
    def exp_rows(self, pieces, engine, neg_max=None, with_sum=False):
        """``p = exp(xmul * (x - m_new))`` for each ``(p_dst, x_src)`` piece.

        engine ``vector``: Trn3 VectorE ``exponential`` (needs xmul == 1; 4x ScalarE throughput).
        engine ``scalar``: ScalarE ``activation(exp, scale=xmul, bias=-xmul*m_new)``.
        ``with_sum``: sum every row across the pieces in the engine's accumulator register and
        return the ``[rows, 1]`` sum (the pieces of one call then run back to back)."""
        rs = nl.ndarray((self.rows, 1), dtype=nl.float32, buffer=nl.sbuf) if with_sum else None
        n = len(pieces)
        for i, (dst, src) in enumerate(pieces):
            kw = {}
            if with_sum:
                kw = dict(reduce_cmd=nisa.reduce_cmd.reset_reduce if i == 0
                          else nisa.reduce_cmd.reduce, reduce_res=rs if i == n - 1 else None)
            if engine == "vector":
                if self.xmul != 1.0:
                    raise ValueError("softmax: VectorE exponential needs pre-scaled scores")
                nisa.exponential(dst=dst, src=src, max_value=self.m_new, **kw)
            else:
                if with_sum:
                    kw["reduce_op"] = nl.add
                nisa.activation(dst=dst, op=nl.exp, data=src, bias=neg_max, scale=self.xmul, **kw)
        return rs

    def rescale_factor(self, engine, neg_max=None):
        """``alpha = exp(xmul * (m_old - m_new))`` ([rows, 1]); None when nothing has been
        accumulated yet (first block without a sink)."""
        if not self.started:
            self.alpha = None
            return None
        a = nl.ndarray((self.rows, 1), dtype=nl.float32, buffer=nl.sbuf)           # [rows, 1]
        if engine == "vector":
            nisa.exponential(dst=a, src=self.m_old, max_value=self.m_new)
        else:
            nisa.activation(dst=a, op=nl.exp, data=self.m_old, bias=neg_max, scale=self.xmul)
        self.alpha = a
        return a

    def mark_started(self):
        """Call after a block's max/exp/alpha are issued: later blocks rescale."""
        self.started = True

    def update_sum(self, rowsum, alpha):
        """``l = l * alpha + rowsum`` (``sum_in_o=False`` only; VectorE, [rows, 1])."""
        if self.l is None:
            self.l = rowsum
            return rowsum
        l_new = nl.ndarray((self.rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=l_new, data=self.l, op0=nl.multiply, operand0=alpha,
                                  op1=nl.add, operand1=rowsum)
        self.l = l_new
        return l_new

    # -- output accumulator ---------------------------------------------------------------------
    def accumulate_o(self, o_psum, alpha, mode="stt", copy_engine="scalar"):
        """``o = o * alpha + o_psum`` (o_psum is ``P @ V_aug`` of the block, in PSUM).

        First block (nothing accumulated): ``o = o_psum`` with a copy on ``copy_engine``.
        mode ``stt``: one VectorE ``scalar_tensor_tensor`` (2N cycles);
        mode ``split``: ScalarE rescales ``o`` in SBUF (``activation(copy, scale=alpha)``) and
        VectorE adds ``o_psum`` (N cycles with a PSUM operand): halves the VectorE time."""
        if self.o is None:
            w = o_psum.shape[1]
            self.o = nl.ndarray((self.rows, w), dtype=nl.float32, buffer=nl.sbuf)      # [rows, w]
            nisa.tensor_copy(dst=self.o, src=o_psum, engine=_engine(copy_engine))
        elif mode == "split":
            nisa.activation(dst=self.o, op=nl.copy, data=self.o, scale=alpha)
            nisa.tensor_tensor(dst=self.o, data1=self.o, data2=o_psum, op=nl.add)
        else:
            nisa.scalar_tensor_tensor(dst=self.o, data=self.o, op0=nl.multiply, operand0=alpha,
                                      op1=nl.add, operand1=o_psum)

    # -- state across KV chunks (kept in HBM between visits) ----------------------------------
    def _load(self, o_hbm, m_hbm):
        """Resume from ``o_hbm [rows, d(+1)]`` and ``m_hbm [rows, 1]`` fp32 in HBM."""
        self.o = nl.ndarray(tuple(o_hbm.shape), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=self.o, src=o_hbm)
        nisa.dma_copy(dst=self.mp[:, 0:1], src=m_hbm)
        self.started = True

    def save(self, o_hbm, m_hbm):
        """Store ``o`` and ``m`` to HBM for the next KV chunk (``sum_in_o`` states)."""
        nisa.dma_copy(dst=m_hbm, src=self.mp[:, 0:1])
        nisa.dma_copy(dst=o_hbm, src=self.o)

    # -- end ------------------------------------------------------------------------------------
    def denominator(self):
        return self.o[:, self.d:self.d + 1] if self.sum_in_o else self.l

    def exp_block(self, p_dst, x_src, defer_sum=False, engine="scalar"):
        """One block of a state whose sum is kept apart (``sum_in_o=False``), its partial maxes
        already reduced into ``max_slot()`` columns: ``m_new``, ``p = exp(xmul (x - m_new))``
        (row sums fused), ``l = alpha l + sum p``. Returns ``alpha`` for the O update.
        ``defer_sum``: the ``l`` update waits for :meth:`flush_sum` (blocks in order), so an
        in-order VectorE queue does not stall on this block's exponential. ``engine``: "scalar"
        (the max's negation as the activation's bias), or "vector" (Trn3 ``exponential``, 4x
        ScalarE's rate; needs xmul == 1, the scores scaled already: no bias tile, and the max,
        the exponentials and alpha stay on one engine, no ScalarE hop on the softmax's chain)."""
        self.combine_max()
        neg = self.neg_max() if engine == "scalar" else None
        rowsum = self.exp_rows([(p_dst, x_src)], engine, neg_max=neg, with_sum=True)
        alpha = self.rescale_factor(engine, neg)
        self.mark_started()
        if defer_sum:
            self.pending_sums.append((rowsum, alpha))
        else:
            self.update_sum(rowsum, alpha)
        return alpha

    def flush_sum(self):
        """Apply the oldest deferred ``l`` update of :meth:`exp_block`."""
        self.update_sum(*self.pending_sums.pop(0))

    def prescale_o(self, alpha):
        """``o * alpha`` in SBUF on ScalarE, for :meth:`finalize_last`: issued before the last
        block's PV lands (it needs only the earlier blocks' ``o`` and this block's alpha), it
        leaves VectorE one add with the PSUM operand (N cycles; the update's
        ``scalar_tensor_tensor`` is 2N). ``None`` while nothing is accumulated."""
        if self.o is None:
            return None
        o_a = nl.ndarray((self.rows, self.o.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=o_a, op=nl.copy, data=self.o, scale=alpha)
        return o_a

    def finalize_last(self, o_psum, alpha, outs, out_scale=None, o_scaled=None):
        """The last block's :meth:`accumulate_o` and :meth:`finalize`'s division
        (``sum_in_o=False``): ``out = (o * alpha + o_psum) / l``, ``1 / l`` issued ahead of the
        update (``l`` is final before the block's PV lands; so is :meth:`lse`, which a caller
        issues first), the division by column parts, ``outs`` = ``[(out_sb, c0, c1, engine),
        ...]`` (``"vector"`` or ``"scalar"``), so that parts can run on two engines.
        ``o_scaled``: :meth:`prescale_o`'s ``o * alpha``, if taken; ``o_psum`` None: ``o`` is
        final already (the division only)."""
        den = self.denominator()
        recip = nl.ndarray((self.rows, 1), dtype=nl.float32, buffer=nl.sbuf)           # [rows, 1]
        nisa.reciprocal(dst=recip, data=den)
        if out_scale is not None:
            nisa.tensor_scalar(dst=recip, data=recip, op0=nl.multiply, operand0=float(out_scale))
        if o_scaled is not None:
            nisa.tensor_tensor(dst=o_scaled, data1=o_scaled, data2=o_psum, op=nl.add)
            self.o = o_scaled
        elif o_psum is not None:
            self.accumulate_o(o_psum, alpha, mode="stt", copy_engine="vector")
        for out_sb, c0, c1, engine in outs:
            if engine == "vector":
                nisa.tensor_scalar(dst=out_sb, data=self.o[:, c0:c1], op0=nl.multiply,
                                   operand0=recip)
            else:
                nisa.activation(dst=out_sb, op=nl.copy, data=self.o[:, c0:c1], scale=recip)

    def lse(self, lse_sb, den=None, add_engine="vector"):
        """``lse = xmul * m + ln l`` (ScalarE log, then the fused multiply-add on VectorE; or,
        ``add_engine`` "scalar", on ScalarE as the bias of a second activation: no VectorE
        pass waiting there for the log)."""
        den = self.denominator() if den is None else den
        lnl = nl.ndarray((self.rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=lnl, op=nl.log, data=den)
        if add_engine == "scalar":
            nisa.activation(dst=lse_sb, op=nl.copy, data=self.mp[:, 0:1], scale=self.xmul,
                            bias=lnl)
        else:
            nisa.scalar_tensor_tensor(dst=lse_sb, data=self.mp[:, 0:1], op0=nl.multiply,
                                      operand0=self.xmul, op1=nl.add, operand1=lnl)

    def finalize(self, out_sb, lse_sb=None, out_scale=None):
        """``out = o / l`` (VectorE, cast to ``out_sb``'s dtype; times ``out_scale``, a float,
        when given: an FP8 V's dequantization scale) and ``lse = xmul * m + ln l`` (ScalarE
        log). VectorE on purpose: the end of a unit waits for its last PV, and an in-order
        ScalarE queue would stall behind it."""
        den = self.denominator()
        recip = nl.ndarray((self.rows, 1), dtype=nl.float32, buffer=nl.sbuf)           # [rows, 1]
        nisa.reciprocal(dst=recip, data=den)
        extra = {} if out_scale is None else dict(op1=nl.multiply, operand1=float(out_scale))
        nisa.tensor_scalar(dst=out_sb, data=self.o[:, 0:self.d], op0=nl.multiply, operand0=recip,
                           **extra)
        if lse_sb is not None:
            self.lse(lse_sb, den)
