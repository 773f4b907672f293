"""Rows of X against 32 columns of a 4-bit weight tile in explicit 16-lane vectors (LLVM IR).

The float counterpart of ``_fma_rows`` for MatMulNBits at accuracy levels 0-3: byte ``t``
of 32 output columns (``_int4_matmul``'s tiles, ``tile[t, c]``) holds their values ``2t``
(low nibble) and ``2t + 1`` (high nibble). Each byte is loaded once for up to ``GROUP`` rows
of X, its nibbles turned into ``<16 x float>`` values centred on 8, and every row adds
``lo * x[2t]`` then ``hi * x[2t + 1]`` by fused multiply-adds; at each block's end a column
adds ``scale * (acc - (zero - 8) * sum of the block's x)`` (no zero term when the weight has
none). One loop per row count, the same arithmetic in each: a row's outputs are the same
bits alone or among others.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._fma_rows import _FLOAT, _I32, _I64, _V16F32, GROUP, _splat, store_rows

_I8 = ir.IntType(8)
_V32I8 = ir.VectorType(_I8, 32)


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def _at(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, kind: ir.Type) -> ir.Value:
    """A ``kind`` pointer ``offset`` bytes past ``base`` (an i8 pointer)."""
    return builder.bitcast(builder.gep(base, [offset]), kind.as_pointer())


def _floats(builder: ir.IRBuilder, nibbles: ir.Value) -> list[ir.Value]:
    """32 nibbles (``<32 x i8>``, each below 16) as two ``<16 x float>`` minus 8."""
    eight = ir.Constant(_V16F32, [8.0] * 16)
    undef = ir.Constant(_V32I8, ir.Undefined)
    out = []
    for h in range(2):
        lanes = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * h, 16 * h + 16)))
        half = builder.shuffle_vector(nibbles, undef, lanes)
        out.append(builder.fsub(builder.uitofp(half, _V16F32), eight))
    return out


def _emit_rows(builder, fma, p, rows: int) -> None:
    """The block loop for ``rows`` rows (``p``: the operands' pointers, strides and sizes),
    the sums stored at ``p["sums"]``."""
    b = builder
    zero = ir.Constant(_V16F32, [0.0] * 16)
    entry = b.block
    outer = b.append_basic_block(f"nib.rows{rows}.block")
    inner = b.append_basic_block(f"nib.rows{rows}.byte")
    ends = b.append_basic_block(f"nib.rows{rows}.end")
    with_z = b.append_basic_block(f"nib.rows{rows}.zeros")
    no_z = b.append_basic_block(f"nib.rows{rows}.nozeros")
    merge = b.append_basic_block(f"nib.rows{rows}.merge")
    done = b.append_basic_block(f"nib.rows{rows}.done")
    b.cbranch(b.icmp_signed(">", p["nb"], _const(0)), outer, done)

    b.position_at_end(outer)  # block blk: tot phis
    blk = b.phi(_I64)
    blk.add_incoming(_const(0), entry)
    tot = [[b.phi(_V16F32) for _ in range(2)] for _ in range(rows)]
    for phi in (phi for row in tot for phi in row):
        phi.add_incoming(zero, entry)
    t_start = b.mul(blk, p["blob"])
    t_end = b.add(t_start, p["blob"])
    b.branch(inner)

    b.position_at_end(inner)  # byte t of the block: acc phis
    t = b.phi(_I64)
    t.add_incoming(t_start, outer)
    acc = [[b.phi(_V16F32) for _ in range(2)] for _ in range(rows)]
    for phi in (phi for row in acc for phi in row):
        phi.add_incoming(zero, outer)
    q = b.load(_at(b, p["tile"], b.mul(t, p["tile_stride"]), _V32I8), align=1)
    lo = _floats(b, b.and_(q, ir.Constant(_V32I8, [15] * 32)))
    hi = _floats(b, b.lshr(q, ir.Constant(_V32I8, [4] * 32)))
    t_bytes = b.mul(t, p["x_step"])
    summed = []
    for r in range(rows):
        row_at = b.add(b.mul(_const(r), p["x_stride"]), t_bytes)
        e = _splat(b, b.load(_at(b, p["xe"], row_at, _FLOAT)))
        o = _splat(b, b.load(_at(b, p["xo"], row_at, _FLOAT)))
        summed.append(
            [b.call(fma, [hi[h], o, b.call(fma, [lo[h], e, acc[r][h]])]) for h in range(2)]
        )
    t_next = b.add(t, _const(1))
    t.add_incoming(t_next, inner)
    for r in range(rows):
        for h in range(2):
            acc[r][h].add_incoming(summed[r][h], inner)
    b.cbranch(b.icmp_signed("<", t_next, t_end), inner, ends)

    b.position_at_end(ends)  # the block's scales (and zero points) over the sums
    s_row = b.mul(blk, p["scale_stride"])
    sc = [
        b.load(_at(b, p["scales"], b.add(s_row, _const(64 * h)), _V16F32), align=4)
        for h in range(2)
    ]
    b.cbranch(p["has_zeros"], with_z, no_z)

    b.position_at_end(with_z)
    z_row = b.mul(blk, p["zero_stride"])
    zc = [
        b.load(_at(b, p["zeros"], b.add(z_row, _const(64 * h)), _V16F32), align=4) for h in range(2)
    ]
    tot_z = []
    for r in range(rows):
        xs_at = b.add(b.mul(_const(r), p["xs_stride"]), b.mul(blk, p["xs_step"]))
        block_sum = _splat(b, b.load(_at(b, p["xs"], xs_at, _FLOAT)))
        tot_z.append(
            [b.call(fma, [sc[h], b.fsub(summed[r][h], b.fmul(zc[h], block_sum)), tot[r][h]])
             for h in range(2)]
        )  # fmt: skip
    b.branch(merge)

    b.position_at_end(no_z)
    tot_n = [[b.call(fma, [sc[h], summed[r][h], tot[r][h]]) for h in range(2)] for r in range(rows)]
    b.branch(merge)

    b.position_at_end(merge)
    tot_next = []
    for r in range(rows):
        pair = []
        for h in range(2):
            phi = b.phi(_V16F32)
            phi.add_incoming(tot_z[r][h], with_z)
            phi.add_incoming(tot_n[r][h], no_z)
            pair.append(phi)
        tot_next.append(pair)
    blk_next = b.add(blk, _const(1))
    blk.add_incoming(blk_next, merge)
    for r in range(rows):
        for h in range(2):
            tot[r][h].add_incoming(tot_next[r][h], merge)
    b.cbranch(b.icmp_signed("<", blk_next, p["nb"]), outer, done)

    b.position_at_end(done)
    store_rows(b, p["sums"], entry, tot_next, merge)


def _check(arr, ndim: int, dtype, name: str) -> None:
    if not isinstance(arr, types.Array) or arr.dtype != dtype or arr.ndim != ndim:
        raise TypeError(f"nibble_rows: {name} must be a {ndim}-D {dtype} array, got {arr}")
    if arr.layout != "C":
        raise TypeError(f"nibble_rows: {name} must be C-contiguous, got {arr}")


@intrinsic
def nibble_rows(typingctx, xe, xo, xs, i0, rows, tile, c0, scales, zeros, col, sums):
    """``sums[TILE * r + c]`` = output column ``col + c`` of row ``i0 + r`` for ``rows`` (1 to
    ``GROUP``, checked by the caller) rows and 32 columns: the bytes ``tile[t, c0 + c]``
    against ``xe``/``xo`` (M, K/2: x's even and odd columns) per block of ``K/2 / nb``
    bytes, ``nb`` = ``xs.shape[1]`` (xs: x's block sums), scaled by ``scales[b, col + c]``
    less ``zeros[b, col + c]`` (zero point minus 8) times the block sum where ``zeros`` has
    rows. All C-contiguous; float32 but for the uint8 ``tile``."""
    f32, u8 = types.float32, types.uint8
    for arr, dims, dtype, name in (
        (xe, 2, f32, "xe"), (xo, 2, f32, "xo"), (xs, 2, f32, "xs"), (tile, 2, u8, "tile"),
        (scales, 2, f32, "scales"), (zeros, 2, f32, "zeros"), (sums, 1, f32, "sums"),
    ):  # fmt: skip
        _check(arr, dims, dtype, name)
    for value, name in ((i0, "i0"), (rows, "rows"), (c0, "c0"), (col, "col")):
        if not isinstance(value, types.Integer):
            raise TypeError(f"nibble_rows: {name} must be an integer, got {value}")

    def codegen(context, builder, sig, args):
        b = builder
        arrays = {
            name: context.make_array(sig.args[i])(context, b, args[i])
            for i, name in ((0, "xe"), (1, "xo"), (2, "xs"), (5, "tile"), (7, "scales"),
                            (8, "zeros"), (10, "sums"))
        }  # fmt: skip
        ints = {
            name: context.cast(b, args[i], sig.args[i], types.int64)
            for i, name in ((3, "i0"), (4, "rows"), (6, "c0"), (9, "col"))
        }

        def shape(name):
            return cgutils.unpack_tuple(b, arrays[name].shape, 2)

        def stride(name):
            return cgutils.unpack_tuple(b, arrays[name].strides, 2)[0]

        def data(name):
            return b.bitcast(arrays[name].data, _I8.as_pointer())

        half, nb = shape("xe")[1], shape("xs")[1]
        x_stride = stride("xe")
        p = {
            "nb": nb,
            "blob": b.sdiv(half, b.select(b.icmp_signed(">", nb, _const(0)), nb, _const(1))),
            "tile": b.gep(data("tile"), [ints["c0"]]),
            "tile_stride": stride("tile"),
            "xe": b.gep(data("xe"), [b.mul(ints["i0"], x_stride)]),
            "xo": b.gep(data("xo"), [b.mul(ints["i0"], x_stride)]),
            "x_stride": x_stride,
            "x_step": _const(4),
            "xs": b.gep(data("xs"), [b.mul(ints["i0"], stride("xs"))]),
            "xs_stride": stride("xs"),
            "xs_step": _const(4),
            "scales": b.gep(data("scales"), [b.mul(ints["col"], _const(4))]),
            "scale_stride": stride("scales"),
            "zeros": b.gep(data("zeros"), [b.mul(ints["col"], _const(4))]),
            "zero_stride": stride("zeros"),
            "has_zeros": b.icmp_signed(">", shape("zeros")[0], _const(0)),
            "sums": arrays["sums"].data,
        }
        fma = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(_V16F32, [_V16F32] * 3), "llvm.fma.v16f32"
        )
        after = b.append_basic_block("nib.after")
        switch = b.switch(ints["rows"], after)
        for rows_n in range(1, GROUP + 1):
            case = b.append_basic_block(f"nib.case{rows_n}")
            switch.add_case(_const(rows_n), case)
            with b.goto_block(case):
                _emit_rows(b, fma, p, rows_n)
                b.branch(after)
        b.position_at_end(after)
        return context.get_dummy_value()

    sig = types.none(xe, xo, xs, i0, rows, tile, c0, scales, zeros, col, sums)
    return sig, codegen
