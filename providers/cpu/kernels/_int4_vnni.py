"""MatMulNBits at accuracy_level 4 on AVX-512 VNNI: ``vpdpbusd`` on 4-bit weight tiles.

``vpdpbusd`` multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an
int32 lane, 16 lanes per register. LLVM does not emit it from Numba's loops, so
:func:`dot_vnni_panel` writes the inner loops in LLVM IR. The weight is held in the VNNI
tile layout (``_int4_matmul.tile_weight(..., vnni=True)``): per tile of ``rows`` output
rows and step ``s`` of 8 columns, 4 bytes per row, byte ``j``'s low nibble the weight of
column ``8s + j`` and its high nibble that of ``8s + 4 + j``. One 64-byte load gives 16
rows' 8 weights; ``& 0x0F`` per byte gives the unsigned weights of columns ``8s..8s+3`` and
``>> 4`` those of ``8s+4..8s+7``, which meet the int8 activations of those columns as they
are (a broadcast int32 of 4 bytes of q).

The contract is ``_int8_activations``': weights 0..15 times int8 activations summed exactly
in int32 per block, the zero point taken off as ``z * sum(q of the block)``, then
``y += scale_a * scale_w * dot`` per block in float32 with the same operations and order
as ``_q8_tiles``, so both kernels give the same bits.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._int4_matmul import (
    Int4Tiles,
    pool_refuses,
    run_pooled,
    set_tile_args,
    tile_chunk,
    tile_parts,
)
from ._int8_activations import _quantize_blocks, _quantize_blocks_into
from ._intrinsics import address_as_pointer, compiles_for
from ._native_calls import NativeCall, native_runner, word_view, words
from ._worker_pool import (
    COPY,
    FIRST_ARG,
    MAX_CHUNKS,
    NO_POOL,
    carve,
    chunk_runner,
    operand_address,
    pool_threads,
    run_job,
    set_arg,
    worker_pool,
)

_F32 = np.float32
_INT8 = np.int8
#: Output rows one call of the panel intrinsic covers for one row of activations (four
#: groups of 16); tiles hold a multiple of it.
PANEL = 64
#: Environment variable that turns the VNNI kernel off (``0``) where the host has it.
ENV = "ONNX_GENRT_INT4_VNNI"
_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512vnni")


#: Whether Numba compiles for AVX-512 VNNI (with the F, BW and VL subsets LLVM uses).
HOST_VNNI = compiles_for(*_FEATURES)


def vnni_enabled(option: bool | None = None) -> bool:
    """Whether accuracy-level-4 weights take the VNNI layout and kernel: the host has VNNI
    and ``option`` (the CPU provider's ``int4_vnni``) is on; without one, unless the
    environment variable ``ONNX_GENRT_INT4_VNNI`` is ``0``/``false``/``off``."""
    if option is None:
        option = os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off")
    return bool(option) and HOST_VNNI


# ----------------------------------------------------------------------------- the intrinsic

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_FLOAT = ir.FloatType()
_V16I32 = ir.VectorType(_I32, 16)
_V16F32 = ir.VectorType(_FLOAT, 16)
# LLVM 22 types vpdpbusd's byte operands as <64 x i8> (llvm-project pull 155194), earlier
# versions as <16 x i32>.
_DPBUSD_BYTES = ir.VectorType(_I8, 64) if llvm.llvm_version_info >= (22,) else _V16I32
#: Per number of activation rows (1-4): groups of 16 output rows per loop, and whether the
#: low and high nibbles keep separate accumulators; about 8 ``vpdpbusd`` chains each (the
#: instruction's latency is several cycles) and at most 16 accumulator registers.
_SHAPES = {1: (4, True), 2: (4, False), 3: (2, False), 4: (2, False)}


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _splat(builder: ir.IRBuilder, value: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    """``value`` in every lane of a 16-lane ``vector_type``."""
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_V16I32, [0] * 16))


class _Panel:
    """Emits a panel's IR: the operands' pointers and sizes, read once from the arrays, and
    one loop nest per number of activation rows."""

    def __init__(self, context, builder: ir.IRBuilder, sig, args) -> None:
        self.b = builder
        arrays = {}
        for name, index in (("w", 0), ("q", 2), ("qs", 5), ("qsum", 6), ("s", 7), ("z", 8)):
            arrays[name] = context.make_array(sig.args[index])(context, builder, args[index])
        arrays["out"] = context.make_array(sig.args[10])(context, builder, args[10])
        ints = {
            name: context.cast(builder, args[i], sig.args[i], types.int64)
            for name, i in (("w_off", 1), ("i0", 3), ("mc", 4), ("c0", 9), ("o_col", 11))
        }
        shape = cgutils.unpack_tuple
        w_shape = shape(builder, arrays["w"].shape, 4)
        s_shape = shape(builder, arrays["s"].shape, 3)
        self.blocks, self.s_row = s_shape[1], s_shape[2]
        self.steps = builder.sdiv(w_shape[1], self.blocks)  # per block
        self.w_step = builder.mul(w_shape[2], _const(4))
        self.q_row = shape(builder, arrays["q"].shape, 2)[1]
        self.out_row = shape(builder, arrays["out"].shape, 2)[1]
        z_tiles = shape(builder, arrays["z"].shape, 3)[0]
        self.has_zeros = builder.icmp_signed("!=", z_tiles, _const(0))
        self.mc = ints["mc"]
        i0 = ints["i0"]

        def base(name: str, element: ir.Type, offset: ir.Value) -> ir.Value:
            data = builder.bitcast(arrays[name].data, element.as_pointer())
            return builder.gep(data, [offset])

        self.w = base("w", _I8, ints["w_off"])
        self.q = base("q", _I8, builder.mul(i0, self.q_row))
        self.qs = base("qs", _FLOAT, builder.mul(i0, self.blocks))
        self.qsum = base("qsum", _I32, builder.mul(i0, self.blocks))
        self.s = base("s", _FLOAT, ints["c0"])
        self.z = base("z", _FLOAT, ints["c0"])
        out_at = builder.add(builder.mul(i0, self.out_row), ints["o_col"])
        self.out = base("out", _FLOAT, out_at)
        module = builder.module
        self.dpbusd = cgutils.get_or_insert_function(
            module,
            ir.FunctionType(_V16I32, [_V16I32, _DPBUSD_BYTES, _DPBUSD_BYTES]),
            "llvm.x86.avx512.vpdpbusd.512",
        )
        self.fma = cgutils.get_or_insert_function(
            module, ir.FunctionType(_V16F32, [_V16F32] * 3), "llvm.fma.v16f32"
        )

    def vector(self, base: ir.Value, offset: ir.Value, vector_type: ir.VectorType) -> ir.Value:
        """The vector at element ``offset`` of ``base``."""
        ptr = self.b.bitcast(self.b.gep(base, [offset]), vector_type.as_pointer())
        return self.b.load(ptr, align=1)

    def emit(self, m: int, g: int, split: bool, zeros: bool, col: int) -> None:
        """The loop nest for ``m`` activation rows and output columns ``col .. col + 16 g``
        of the panel, ending in a new block the builder is left at."""
        b = self.b
        halves = 2 if split else 1
        nibble = ir.Constant(_V16I32, [0x0F0F0F0F] * 16)
        four = ir.Constant(_V16I32, [4] * 16)
        eight = ir.Constant(_V16F32, [8.0] * 16)
        w = b.gep(self.w, [_const(4 * col)])

        # for each block: tot[i][gi] float32 accumulators
        entry = b.block
        block_head = b.append_basic_block("vnni.block")
        b.branch(block_head)
        b.position_at_end(block_head)
        blk = b.phi(_I64)
        blk.add_incoming(_const(0), entry)
        tot = [[b.phi(_V16F32) for _ in range(g)] for _ in range(m)]
        for p in (p for row in tot for p in row):
            p.add_incoming(ir.Constant(_V16F32, [0.0] * 16), entry)
        first = b.mul(blk, self.steps)
        w_blk = b.gep(w, [b.mul(first, self.w_step)])
        q_blk = b.gep(self.q, [b.mul(first, _const(8))])
        # the default zero point comes off in the integers: the first accumulator of each
        # row starts at -8 * qsum (exact, as the float32 subtraction is)
        start = []
        for i in range(m):
            if zeros:
                start.append(ir.Constant(_V16I32, [0] * 16))
                continue
            qsum = b.load(b.gep(self.qsum, [b.add(b.mul(_const(i), self.blocks), blk)]))
            start.append(_splat(b, b.mul(qsum, ir.Constant(_I32, -8)), _V16I32))

        # for each step of 8 columns: acc[i][gi * halves + h] int32 accumulators
        step_entry = b.block
        step_head = b.append_basic_block("vnni.step")
        b.branch(step_head)
        b.position_at_end(step_head)
        step = b.phi(_I64)
        step.add_incoming(_const(0), step_entry)
        acc = [[b.phi(_V16I32) for _ in range(g * halves)] for _ in range(m)]
        for i in range(m):
            for j, p in enumerate(acc[i]):
                p.add_incoming(
                    start[i] if j % halves == 0 else ir.Constant(_V16I32, [0] * 16), step_entry
                )
        w_step = b.gep(w_blk, [b.mul(step, self.w_step)])
        q_step = b.gep(q_blk, [b.mul(step, _const(8))])
        nibbles = []
        for gi in range(g):
            v = self.vector(w_step, _const(64 * gi), _V16I32)
            lo = b.and_(v, nibble)
            hi = b.and_(b.lshr(v, four), nibble)
            nibbles.append((b.bitcast(lo, _DPBUSD_BYTES), b.bitcast(hi, _DPBUSD_BYTES)))
        summed = []
        for i in range(m):
            q_i = b.gep(q_step, [b.mul(_const(i), self.q_row)])
            acts = []
            for h in range(2):
                word = b.load(b.bitcast(b.gep(q_i, [_const(4 * h)]), _I32.as_pointer()), align=1)
                acts.append(b.bitcast(_splat(b, word, _V16I32), _DPBUSD_BYTES))
            row = []
            for gi in range(g):
                if split:
                    for h in range(2):
                        row.append(
                            b.call(self.dpbusd, [acc[i][2 * gi + h], nibbles[gi][h], acts[h]])
                        )
                else:
                    lo = b.call(self.dpbusd, [acc[i][gi], nibbles[gi][0], acts[0]])
                    row.append(b.call(self.dpbusd, [lo, nibbles[gi][1], acts[1]]))
            summed.append(row)
        step_next = b.add(step, _const(1))
        step.add_incoming(step_next, b.block)
        for i in range(m):
            for j in range(g * halves):
                acc[i][j].add_incoming(summed[i][j], b.block)
        block_end = b.append_basic_block("vnni.block_end")
        b.cbranch(b.icmp_signed("<", step_next, self.steps), step_head, block_end)

        # tot += (scale_a * scale_w) * (acc - (zero - 8 + 8) * qsum), as _q8_tiles has it
        b.position_at_end(block_end)
        at = b.add(b.mul(blk, self.s_row), _const(col))
        new_tot = []
        for i in range(m):
            pi = b.add(b.mul(_const(i), self.blocks), blk)
            sa = _splat(b, b.load(b.gep(self.qs, [pi])), _V16F32)
            if zeros:
                qsum = b.sitofp(b.load(b.gep(self.qsum, [pi])), _FLOAT)
                neg_qsum = _splat(b, b.fneg(qsum), _V16F32)
            row = []
            for gi in range(g):
                total = b.add(summed[i][2 * gi], summed[i][2 * gi + 1]) if split else summed[i][gi]
                col_at = b.add(at, _const(16 * gi))
                scale = b.fmul(sa, self.vector(self.s, col_at, _V16F32))
                centred = b.sitofp(total, _V16F32)
                if zeros:
                    zero = b.fadd(self.vector(self.z, col_at, _V16F32), eight)
                    centred = b.call(self.fma, [zero, neg_qsum, centred])
                row.append(b.call(self.fma, [scale, centred, tot[i][gi]]))
            new_tot.append(row)
        blk_next = b.add(blk, _const(1))
        blk.add_incoming(blk_next, b.block)
        for i in range(m):
            for gi in range(g):
                tot[i][gi].add_incoming(new_tot[i][gi], b.block)
        done = b.append_basic_block("vnni.stored")
        b.cbranch(b.icmp_signed("<", blk_next, self.blocks), block_head, done)
        b.position_at_end(done)
        for i in range(m):
            out_i = b.gep(self.out, [b.add(b.mul(_const(i), self.out_row), _const(col))])
            for gi in range(g):
                ptr = b.bitcast(b.gep(out_i, [_const(16 * gi)]), _V16F32.as_pointer())
                b.store(new_tot[i][gi], ptr, align=1)


@intrinsic
def dot_vnni_panel(typingctx, w, w_off, q, i0, mc, q_scales, q_sums, scales, zeros, c0, out, o_col):
    """``out[i0 + i, o_col + c]`` for ``mc`` (1 to 4) rows ``i`` of int8 activations and
    ``PANEL`` (64) output columns ``c``: the accuracy-level-4 product of the whole K.

    - ``w`` (uint8, VNNI tiles (n_tiles, K/8, rows, 4)): the panel's 64 rows start at byte
      ``w_off`` (step 0); step ``s`` is ``4 * rows`` bytes further per step;
    - ``q`` (int8, (M, K padded)), ``q_scales`` (float32, (M, blocks)), ``q_sums`` (int32, the
      block sums of q): rows ``i0 ..``;
    - ``scales`` and ``zeros`` (float32 (n_tiles, blocks, rows), zero points minus 8; zeros
      of size 0 for the default 8): block ``b`` of the panel's rows at element ``c0 + b *
      rows`` (``c0`` is the first row's at block 0).

    The loops keep their int32 and float32 accumulators in registers (``_SHAPES``); the
    IR holds one loop nest per row count and zero-point kind, chosen at run time.
    """
    f32 = types.float32
    arrays = (
        (w, types.uint8, 4),
        (q, types.int8, 2),
        (q_scales, f32, 2),
        (q_sums, types.int32, 2),
        (scales, f32, 3),
        (zeros, f32, 3),
        (out, f32, 2),
    )
    for arr, dtype, ndim in arrays:
        if not isinstance(arr, types.Array) or arr.dtype != dtype or arr.ndim != ndim:
            raise TypeError(f"dot_vnni_panel takes a {ndim}-D {dtype} array, got {arr}")

    def codegen(context, builder, sig, args):
        panel = _Panel(context, builder, sig, args)
        after = builder.append_basic_block("vnni.after")
        cases = []
        for zeros_given in (False, True):
            for m, (g, split) in _SHAPES.items():
                case = builder.append_basic_block(f"vnni.rows{m}.z{int(zeros_given)}")
                cases.append((m, zeros_given, case))
                with builder.goto_block(case):
                    for col in range(0, PANEL, 16 * g):
                        panel.emit(m, g, split, zeros_given, col)
                    builder.branch(after)
        with_zeros = builder.append_basic_block("vnni.with_zeros")
        without = builder.append_basic_block("vnni.without_zeros")
        builder.cbranch(panel.has_zeros, with_zeros, without)
        for block, zeros_given in ((without, False), (with_zeros, True)):
            builder.position_at_end(block)
            switch = builder.switch(panel.mc, after)
            for m, z, case in cases:
                if z == zeros_given:
                    switch.add_case(_const(m), case)
        builder.position_at_end(after)
        return context.get_dummy_value()

    sig = types.none(w, w_off, q, i0, mc, q_scales, q_sums, scales, zeros, c0, out, o_col)
    return sig, codegen


# ----------------------------------------------------------------------------- the kernel


@numba.njit(cache=True)
def _vnni_tiles(tiles, t0, t1, q, q_scales, q_sums, scales, zeros, out):
    """out[:, rows of tiles t0..t1) for int8 rows q (block scales q_scales, sums q_sums):
    per ``PANEL`` rows of a tile, up to 4 rows of q at a time (the panel's weights stay in
    the L1 cache between them)."""
    _, steps, rows, _ = tiles.shape
    m = q.shape[0]
    n = out.shape[1]
    nb = scales.shape[1]
    tail = np.empty((m, rows if t1 * rows > n else 0), _F32)
    for ti in range(t0, t1):
        r0 = ti * rows
        whole = r0 + rows <= n
        dst = out if whole else tail
        d0 = r0 if whole else 0
        for p in range(0, rows, PANEL):
            w_off = (ti * steps * rows + p) * 4
            for i0 in range(0, m, 4):
                mc = min(4, m - i0)
                c0 = ti * nb * rows + p
                dot_vnni_panel(
                    tiles, w_off, q, i0, mc, q_scales, q_sums, scales, zeros, c0, dst, d0 + p
                )
        if not whole:
            for i in range(m):
                for r in range(n - r0):
                    out[i, r0 + r] = tail[i, r]


@numba.njit(cache=True)
def _vnni_serial(x, block, tiles, scales, zeros, out):
    """out (M, N) = x (M, K) quantized to int8 @ dequant(W)^T on the calling thread."""
    q, q_scales, q_sums = _quantize_blocks(x, block, scales.shape[1])
    # np.int64(0), not Literal[0]: the pool's runner reuses this compilation
    _vnni_tiles(tiles, np.int64(0), tiles.shape[0], q, q_scales, q_sums, scales, zeros, out)


def _vnni_chunk(args, chunk, mode):
    """Chunk runner (``_worker_pool``): the output columns of tiles ``[t0, t1)`` of chunk
    ``chunk`` into the output, into the scratch buffer, or copied across."""
    try:
        a, m, half, nb, t0, t1, tiles, scales, zeros, dst = tile_chunk(args, chunk, mode)
        if mode == COPY:
            return 0
        # the VNNI views of the job's tiles, scales and zero points (tile_chunk's are the
        # row tiles' shapes over the same memory)
        nt, rows = tiles.shape[0], tiles.shape[2]
        w = tiles.reshape((nt, half // 4, rows, 4))
        scales = scales.reshape((nt, nb, rows))
        zeros = numba.carray(
            address_as_pointer(zeros.ctypes.data, _F32), (zeros.shape[0], nb, rows)
        )
        q = numba.carray(address_as_pointer(a[FIRST_ARG], _INT8), (m, 2 * half))
        q_scales = numba.carray(address_as_pointer(a[FIRST_ARG + 1], _F32), (m, nb))
        q_sums = numba.carray(address_as_pointer(a[FIRST_ARG + 2], np.int32), (m, nb))
        _vnni_tiles(w, t0, t1, q, q_scales, q_sums, scales, zeros, dst)
        return 0
    except Exception:  # noqa: BLE001 - a runner reports failure by its return value
        return 1


_vnni_runner = chunk_runner(_vnni_chunk)


@numba.njit(cache=True, nogil=True)
def _vnni_pooled(x, tiles, scales, zeros, block, out, ctrl, runner, chunks):
    """``_vnni_serial`` with the pool's workers taking chunks of the tiles (the calling
    thread alone when another thread holds the pool). Returns ``run_job``'s status."""
    if pool_refuses(ctrl, x, tiles, scales, zeros, out):
        _vnni_serial(x, block, tiles, scales, zeros, out)
        return 0
    m = x.shape[0]
    nb = scales.shape[1]
    addr = operand_address(ctrl)
    q, addr = carve(addr, (m, nb * block), _INT8)
    q_scales, addr = carve(addr, (m, nb), _F32)
    q_sums, addr = carve(addr, (m, nb), np.int32)
    _quantize_blocks_into(x, block, q, q_scales, q_sums)
    set_arg(ctrl, 0, q.ctypes.data)
    set_arg(ctrl, 1, q_scales.ctypes.data)
    set_arg(ctrl, 2, q_sums.ctypes.data)
    set_tile_args(ctrl, m, nb, tiles, scales, zeros, out)
    return run_job(ctrl, runner, chunks)


def int4_vnni_matmul(
    x: np.ndarray, w: Int4Tiles, out: np.ndarray, chunks: int | None = None
) -> np.ndarray:
    """``out`` (M, N) float32 = ``x`` (M, K) float32 @ dequant(W)^T with x quantized to int8
    per block (accuracy_level 4), for ``w`` in the VNNI layout (rows per tile a multiple of
    ``PANEL``), split into ``chunks`` (default ``tile_parts``) over the worker pool."""
    if not w.vnni or w.rows % PANEL:
        raise ValueError(f"the VNNI kernel needs VNNI tiles of a multiple of {PANEL} rows")
    if chunks is None:
        chunks = tile_parts(*x.shape, w)
    chunks = min(chunks, w.tiles.shape[0], MAX_CHUNKS)
    if chunks == 1 or pool_threads() < 2:
        _vnni_serial(x, w.block, w.tiles, w.scales, w.zeros, out)
        return out
    m = x.shape[0]
    nb = w.scales.shape[1]
    operands = m * nb * (w.block + 8) + 3 * 64
    run_pooled(_vnni_pooled, _vnni_runner, x, w, out, chunks, operands, "MatMulNBits (int4, VNNI)")
    return out


# -- native form (``_native_calls``) ------------------------------------------------------------

_N_WORDS = 19
_N_STATUS = 18


def _vnni_native(args, _a, _b):
    """``int4_vnni_matmul`` as a native call. Words: x, m, k, tiles, tile count, K/8, rows,
    scales, blocks, zeros, zero tiles (0: none), block, out, n, the pool's ctrl and its
    length, the chunk runner, chunks, and the status word. Returns 1 (status left in the
    words) when a late worker may still read the arrays, 2 when the call failed."""
    try:
        w = word_view(args, _N_WORDS)
        m, k, nt, k8, rows, nb, zt, block, n = (
            w[1],
            w[2],
            w[4],
            w[5],
            w[6],
            w[8],
            w[10],
            w[11],
            w[13],
        )
        x = numba.carray(address_as_pointer(w[0], _F32), (m, k))
        tiles = numba.carray(address_as_pointer(w[3], np.uint8), (nt, k8, rows, 4))
        scales = numba.carray(address_as_pointer(w[7], _F32), (nt, nb, rows))
        zeros = numba.carray(
            address_as_pointer(w[9], _F32), (zt, nb if zt else 0, rows if zt else 0)
        )
        out = numba.carray(address_as_pointer(w[12], _F32), (m, n))
        if w[17] <= 1:
            _vnni_serial(x, block, tiles, scales, zeros, out)
            return 0
        ctrl = numba.carray(address_as_pointer(w[14], np.int64), (w[15],))
        status = _vnni_pooled(x, tiles, scales, zeros, block, out, ctrl, w[16], w[17])
        if status & 3:
            w[_N_STATUS] = status
            return 1
        return 0
    except Exception:  # noqa: BLE001 - a native call reports failure by its code
        return 2


_vnni_native_runner = native_runner(_vnni_native)


def vnni_native(x: np.ndarray, w: Int4Tiles, out: np.ndarray, call: Callable[[], object]):
    """The native form of ``int4_vnni_matmul(x, w, out)`` (``call``, its Python form, runs
    when the native call fails); None for weights it does not take."""
    if not w.vnni or w.rows % PANEL or not (x.flags.c_contiguous and out.flags.c_contiguous):
        return None
    m, k = x.shape
    nt, k8, rows, _ = w.tiles.shape
    nb = w.scales.shape[1]
    zt = w.zeros.shape[0] if w.zeros.size else 0
    arrays = (x, w.tiles, w.scales, w.zeros, out)

    def make() -> NativeCall:
        chunks = min(tile_parts(m, k, w), nt, MAX_CHUNKS)
        ctrl, runner = NO_POOL, 0
        if chunks > 1 and pool_threads() >= 2:
            pool = worker_pool()
            pool.reserve(m * out.shape[1], m * nb * (w.block + 8) + 3 * 64)
            ctrl, runner = pool.ctrl, _vnni_runner()
        else:
            chunks = 1
        words_ = words(
            x.ctypes.data, m, k, w.tiles.ctypes.data, nt, k8, rows, w.scales.ctypes.data, nb,
            w.zeros.ctypes.data, zt, w.block, out.ctypes.data, out.shape[1], ctrl.ctypes.data,
            ctrl.size, runner, chunks, 0,
        )  # fmt: skip

        def on_code(code: int) -> None:
            if code == 1:
                worker_pool().settle(int(words_[_N_STATUS]), arrays, "MatMulNBits (int4, VNNI)")
            else:
                call()

        return NativeCall(_vnni_native_runner(), words_, on_code, (*arrays, ctrl), _N_STATUS)

    return make
