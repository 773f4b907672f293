"""Rows of X against one 32-column weight tile in explicit 16-lane vectors (LLVM IR).

LLVM's loop vectorizer prefers 256-bit vectors on the x86 server cores that have AVX-512
(a tuning of those targets), so the Numba loops of ``_skinny_matmul`` multiply a tile with
8-lane registers and sixteen of them hold four rows' sums at most. Written as ``<16 x
float>`` operations, the same loop runs on 512-bit registers where the host has AVX-512 (LLVM
splits each into two 8-lane halves elsewhere): eight rows' sums in sixteen registers, each
tile row loaded once for all eight, twice the multiply-adds per instruction.

Every output column adds its products in the order of k, one fused multiply-add each
(``llvm.fma``), whatever the row count of the call: a row's sums are the same bits alone or
among others.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._intrinsics import compiles_for

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_FLOAT = ir.FloatType()
_V16F32 = ir.VectorType(_FLOAT, 16)
#: Output columns of a weight tile (two 16-lane vectors).
TILE = 32
#: Rows one call multiplies together: eight rows' sums take 16 of AVX-512's 32 vector
#: registers; without AVX-512 (16 registers of 8 lanes) four rows' take the same bytes.
GROUP = 8 if compiles_for("avx512f") else 4


def _splat(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    undef = ir.Constant(_V16F32, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _emit_rows(builder, fma, x, strides, k_len, tile, sums, rows: int) -> None:
    """The loop over k for ``rows`` rows of ``x`` (bytes at the first row; ``strides`` in
    bytes between rows and between elements) against ``tile`` (k_len rows of 32), its sums
    stored at ``sums``."""
    b = builder
    zero = ir.Constant(_V16F32, [0.0] * 16)
    entry = b.block
    head = b.append_basic_block(f"fma.rows{rows}")
    done = b.append_basic_block(f"fma.rows{rows}.done")
    b.cbranch(b.icmp_signed(">", k_len, ir.Constant(_I64, 0)), head, done)

    b.position_at_end(head)
    k = b.phi(_I64)
    k.add_incoming(ir.Constant(_I64, 0), entry)
    acc = [[b.phi(_V16F32) for _ in range(2)] for _ in range(rows)]
    for p in (p for row in acc for p in row):
        p.add_incoming(zero, entry)
    w_at = b.gep(tile, [b.mul(k, ir.Constant(_I64, TILE))])
    w = [
        b.load(b.bitcast(b.gep(w_at, [ir.Constant(_I64, 16 * h)]), _V16F32.as_pointer()), align=4)
        for h in range(2)
    ]
    summed = []
    for r in range(rows):
        at = b.add(b.mul(ir.Constant(_I64, r), strides[0]), b.mul(k, strides[1]))
        x_rk = b.load(b.bitcast(b.gep(x, [at]), _FLOAT.as_pointer()))
        xv = _splat(b, x_rk)
        summed.append([b.call(fma, [xv, w[h], acc[r][h]]) for h in range(2)])
    k_next = b.add(k, ir.Constant(_I64, 1))
    k.add_incoming(k_next, b.block)
    for r in range(rows):
        for h in range(2):
            acc[r][h].add_incoming(summed[r][h], b.block)
    b.cbranch(b.icmp_signed("<", k_next, k_len), head, done)

    b.position_at_end(done)
    store_rows(b, sums, entry, summed, head)


def store_rows(builder: ir.IRBuilder, sums, skipped, last, loop) -> None:
    """At a loop's exit: ``sums[TILE * r + 16 * h]`` = the row sums ``last[r][h]`` (two
    16-lane vectors a row) from block ``loop``, or zeros when the loop was skipped (from
    block ``skipped``)."""
    b = builder
    zero = ir.Constant(_V16F32, [0.0] * 16)
    totals = [[b.phi(_V16F32) for _ in range(2)] for _ in last]
    for r, row in enumerate(totals):
        for h, phi in enumerate(row):
            phi.add_incoming(zero, skipped)
            phi.add_incoming(last[r][h], loop)
    for r, row in enumerate(totals):
        for h, phi in enumerate(row):
            at = b.gep(sums, [ir.Constant(_I64, TILE * r + 16 * h)])
            b.store(phi, b.bitcast(at, _V16F32.as_pointer()), align=4)


def _check_array(arr, ndim: int, name: str, contiguous: bool = True) -> None:
    if (
        not isinstance(arr, types.Array)
        or arr.dtype != types.float32
        or arr.ndim != ndim
        or (contiguous and arr.layout != "C")
    ):
        kind = "C-contiguous " if contiguous else ""
        raise TypeError(f"fma_rows: {name} must be a {kind}{ndim}-D float32 array, got {arr}")


@intrinsic
def fma_rows(typingctx, x, i0, rows, tile, sums):
    """``sums[TILE * r + c] = sum over k of x[i0 + r, k] * tile[k, c]`` for ``rows`` (1 to
    ``GROUP``, checked by the caller) rows ``r`` and the tile's 32 columns ``c``; the
    products of a column added in the order of k by fused multiply-adds.

    ``x`` (M, K) is float32 of any strides, ``tile`` (K, 32) C-contiguous float32 and
    ``sums`` a C-contiguous float32 array of at least ``TILE * rows`` elements. The IR
    holds one loop per row count, chosen at run time.
    """
    _check_array(x, 2, "x", contiguous=False)
    _check_array(tile, 2, "tile")
    _check_array(sums, 1, "sums")
    if not isinstance(i0, types.Integer) or not isinstance(rows, types.Integer):
        raise TypeError(f"fma_rows: i0 and rows must be integers, got {i0}, {rows}")

    def codegen(context, builder, sig, args):
        x_arr = context.make_array(sig.args[0])(context, builder, args[0])
        tile_arr = context.make_array(sig.args[3])(context, builder, args[3])
        sums_arr = context.make_array(sig.args[4])(context, builder, args[4])
        i0_v = context.cast(builder, args[1], sig.args[1], types.int64)
        rows_v = context.cast(builder, args[2], sig.args[2], types.int64)
        k_len = cgutils.unpack_tuple(builder, x_arr.shape, 2)[1]
        strides = cgutils.unpack_tuple(builder, x_arr.strides, 2)
        x_bytes = builder.bitcast(x_arr.data, ir.IntType(8).as_pointer())
        x_ptr = builder.gep(x_bytes, [builder.mul(i0_v, strides[0])])
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16F32, [_V16F32] * 3), "llvm.fma.v16f32"
        )
        after = builder.append_basic_block("fma.after")
        switch = builder.switch(rows_v, after)
        for rows_n in range(1, GROUP + 1):
            case = builder.append_basic_block(f"fma.case{rows_n}")
            switch.add_case(ir.Constant(_I64, rows_n), case)
            with builder.goto_block(case):
                _emit_rows(
                    builder, fma, x_ptr, strides, k_len, tile_arr.data, sums_arr.data, rows_n
                )
                builder.branch(after)
        builder.position_at_end(after)
        return context.get_dummy_value()

    return types.none(x, i0, rows, tile, sums), codegen
