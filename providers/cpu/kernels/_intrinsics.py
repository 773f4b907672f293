"""LLVM operations Numba's CPU target lacks, as ``numba.extending.intrinsic`` functions.

Numba offers atomics only on CUDA (numba issue 2988); a thread pool whose threads meet in
nopython code needs them on the CPU. These emit LLVM's own instructions:

- ``atomic_add``, ``atomic_cas``, ``atomic_xchg``, ``atomic_max`` (``atomicrmw``/``cmpxchg``,
  sequentially consistent) and ``load_relaxed``, ``load_acquire``, ``load_seq_cst``,
  ``store_relaxed``, ``store_release``, ``store_seq_cst`` on element ``i`` of a 1-D int64
  array;
- ``cpu_pause``: the spin-wait hint (x86 ``pause``, arm64 ``yield``, nothing elsewhere);
- ``address_as_pointer(addr, dtype)``: an integer address as a typed pointer, for
  ``numba.carray``;
- ``call_address(addr, a, b, c)``: a call of the C function ``int64 f(int64, int64, int64)``
  at ``addr`` (a ``numba.cfunc``'s ``address``); ``call_c_int(addr, a)``: a call of ``int
  f(void *)`` (such as libc's ``sem_post``), ``call_c_void_int(addr)`` of ``int
  f(void)``. Addresses come in at run time, so functions using them stay cacheable (a
  ctypes function as a global is not);
- ``copy_bytes(dst, src, count)``: ``memcpy`` between integer addresses (LLVM's own
  ``llvm.memcpy``: a byte loop over ``numba.carray`` views is not vectorized);
- ``float32_from_bits`` (a bit pattern as a float32, for a vectorizable ``2**n``),
  ``cycle_counter`` (for bounded spin waits) and ``stack_float32`` (a fixed-size array on
  the stack, which LLVM can keep in registers: the skinny kernels' accumulators);
- ``compiles_for(*features)``: whether Numba compiles for the named CPU features (kernels
  that pick a vector width or an instruction set at import).
"""

from __future__ import annotations

import platform

from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, config, types
from numba.extending import intrinsic

_I64 = ir.IntType(64)


def compiles_for(*features: str) -> bool:
    """Whether Numba compiles for every one of ``features`` (LLVM's names, such as
    ``"avx512f"``): the host CPU's, or ``NUMBA_CPU_FEATURES``'s where it is set."""
    if config.CPU_FEATURES is not None:
        given = {f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")}
        return all(f in given for f in features)
    try:
        host = llvm.get_host_cpu_features()
    except RuntimeError:  # no feature list on this platform
        return False
    return all(host.get(f, False) for f in features)


_INT64_ARRAY = types.Array(types.int64, 1, "C")
# The spin-wait hint as an LLVM intrinsic and its arguments (Numba's JIT has no inline asm
# parser): x86's ``pause``, arm64's ``hint #1`` (``yield``).
_PAUSE = {
    "x86_64": ("llvm.x86.sse2.pause", ()),
    "AMD64": ("llvm.x86.sse2.pause", ()),
    "aarch64": ("llvm.aarch64.hint", (1,)),
    "arm64": ("llvm.aarch64.hint", (1,)),
}.get(platform.machine())


def _element_pointer(context, builder, arr_type, arr, index):
    """Pointer to ``arr[index]`` (no bounds check, no wraparound)."""
    ary = context.make_array(arr_type)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arr_type, ary, [index], wraparound=False)


def _check_array(arr) -> None:
    if arr != _INT64_ARRAY:
        raise TypeError(f"atomic operations take a 1-D C-contiguous int64 array, got {arr}")


@intrinsic
def atomic_add(typingctx, arr, i, value):
    """``arr[i] += value`` atomically; returns the old value."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(arr, i, value), codegen


@intrinsic
def atomic_max(typingctx, arr, i, value):
    """``arr[i] = max(arr[i], value)`` atomically (signed); returns the old value."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("max", ptr, val, "seq_cst")

    return types.int64(arr, i, value), codegen


@intrinsic
def atomic_xchg(typingctx, arr, i, value):
    """``arr[i] = value`` atomically; returns the old value."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("xchg", ptr, val, "seq_cst")

    return types.int64(arr, i, value), codegen


@intrinsic
def atomic_cas(typingctx, arr, i, expected, new):
    """If ``arr[i] == expected`` set it to ``new``, atomically; returns the old value
    (equal to ``expected`` exactly when the swap happened)."""
    _check_array(arr)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
        exp = context.cast(builder, args[2], sig.args[2], types.int64)
        new_val = context.cast(builder, args[3], sig.args[3], types.int64)
        pair = builder.cmpxchg(ptr, exp, new_val, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return types.int64(arr, i, expected, new), codegen


def _load(ordering: str):
    def load(typingctx, arr, i):
        _check_array(arr)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
            return builder.load_atomic(ptr, ordering, 8)

        return types.int64(arr, i), codegen

    return load


def _store(ordering: str):
    def store(typingctx, arr, i, value):
        _check_array(arr)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
            val = context.cast(builder, args[2], sig.args[2], types.int64)
            builder.store_atomic(val, ptr, ordering, 8)
            return context.get_dummy_value()

        return types.none(arr, i, value), codegen

    return store


load_relaxed = intrinsic(_load("monotonic"))
load_relaxed.__doc__ = "``arr[i]``, read atomically with no ordering (LLVM monotonic)."
load_acquire = intrinsic(_load("acquire"))
load_acquire.__doc__ = "``arr[i]``, read with acquire ordering."
load_seq_cst = intrinsic(_load("seq_cst"))
load_seq_cst.__doc__ = "``arr[i]``, read with sequentially consistent ordering."
store_relaxed = intrinsic(_store("monotonic"))
store_relaxed.__doc__ = "``arr[i] = value`` atomically with no ordering (LLVM monotonic)."
store_release = intrinsic(_store("release"))
store_release.__doc__ = "``arr[i] = value`` with release ordering."
store_seq_cst = intrinsic(_store("seq_cst"))
store_seq_cst.__doc__ = "``arr[i] = value`` with sequentially consistent ordering."


@intrinsic
def cpu_pause(typingctx):
    """The processor's spin-wait hint (a no-op where there is none)."""

    def codegen(context, builder, sig, args):
        if _PAUSE is not None:
            name, hint_args = _PAUSE
            i32 = ir.IntType(32)
            fn_type = ir.FunctionType(ir.VoidType(), [i32] * len(hint_args))
            fn = cgutils.get_or_insert_function(builder.module, fn_type, name)
            builder.call(fn, [ir.Constant(i32, v) for v in hint_args])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def address_as_pointer(typingctx, addr, dtype):
    """The integer ``addr`` as a pointer to ``dtype`` (a NumPy scalar type)."""
    if not isinstance(addr, types.Integer) or not isinstance(dtype, types.NumberClass):
        raise TypeError(f"address_as_pointer takes (integer, dtype), got ({addr}, {dtype})")
    ptr_type = types.CPointer(dtype.instance_type)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_type))

    return ptr_type(addr, dtype), codegen


@intrinsic
def call_address(typingctx, addr, a, b, c):
    """``((int64 (*)(int64, int64, int64)) addr)(a, b, c)``."""
    for arg in (addr, a, b, c):
        if not isinstance(arg, types.Integer):
            raise TypeError(f"call_address takes four integers, got {arg}")

    def codegen(context, builder, sig, args):
        fn_type = ir.FunctionType(_I64, [_I64, _I64, _I64])
        fn = builder.inttoptr(args[0], fn_type.as_pointer())
        values = [
            context.cast(builder, v, t, types.int64)
            for v, t in zip(args[1:], sig.args[1:], strict=True)
        ]
        return builder.call(fn, values)

    return types.int64(addr, a, b, c), codegen


@intrinsic
def call_c_int(typingctx, addr, arg):
    """``((int (*)(void *)) addr)((void *) arg)``, widened to int64."""
    for a in (addr, arg):
        if not isinstance(a, types.Integer):
            raise TypeError(f"call_c_int takes two integers, got {a}")

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        ptr = ir.IntType(8).as_pointer()
        fn_type = ir.FunctionType(i32, [ptr])
        fn = builder.inttoptr(args[0], fn_type.as_pointer())
        result = builder.call(fn, [builder.inttoptr(args[1], ptr)])
        return builder.sext(result, _I64)

    return types.int64(addr, arg), codegen


@intrinsic
def call_c_void_int(typingctx, addr):
    """``((int (*)(void)) addr)()``, widened to int64 (such as libc's ``sched_yield``)."""
    if not isinstance(addr, types.Integer):
        raise TypeError(f"call_c_void_int takes an integer, got {addr}")

    def codegen(context, builder, sig, args):
        fn_type = ir.FunctionType(ir.IntType(32), [])
        fn = builder.inttoptr(args[0], fn_type.as_pointer())
        return builder.sext(builder.call(fn, []), _I64)

    return types.int64(addr), codegen


@intrinsic
def copy_bytes(typingctx, dst, src, count):
    """Copy ``count`` bytes from address ``src`` to address ``dst`` (the ranges must not
    overlap)."""
    if not all(isinstance(t, types.Integer) for t in (dst, src, count)):
        return None

    def codegen(context, builder, sig, args):
        byte_ptr = ir.IntType(8).as_pointer()
        to, frm = (builder.inttoptr(a, byte_ptr) for a in args[:2])
        cgutils.raw_memcpy(builder, to, frm, args[2], 1)
        return context.get_dummy_value()

    return types.none(dst, src, count), codegen


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose IEEE-754 bit pattern is the low 32 bits of the integer ``bits``
    (LLVM ``trunc`` and ``bitcast``; Numba widens int32 arithmetic to int64)."""
    if not isinstance(bits, types.Integer):
        raise TypeError(f"float32_from_bits takes an integer, got {bits}")

    def codegen(context, builder, sig, args):
        low = args[0]
        if bits.bitwidth > 32:
            low = builder.trunc(low, ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def cycle_counter(typingctx):
    """The CPU's cycle counter (LLVM ``readcyclecounter``: x86 ``rdtsc``, arm64 ``cntvct``;
    0 where the target has none), for bounding spin waits, not for timing."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I64, []), "llvm.readcyclecounter"
        )
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def stack_float32(typingctx, size):
    """A 1-D float32 array of compile-time ``size`` on the calling function's stack
    (``alloca`` in its entry block, uninitialized). LLVM keeps such an array in vector
    registers when every index is known after unrolling, which a Numba ``np.empty`` (a heap
    block whose loads and stores must stay) never is. It must not outlive the function."""
    if not isinstance(size, types.IntegerLiteral):
        return None  # Numba then types the call again with the literal, where it has one
    n = size.literal_value
    array_type = types.Array(types.float32, 1, "C")

    def codegen(context, builder, sig, args):
        element = context.get_value_type(types.float32)
        block = cgutils.alloca_once(builder, ir.ArrayType(element, n))
        intp = context.get_value_type(types.intp)
        array = context.make_array(array_type)(context, builder)
        context.populate_array(
            array,
            data=builder.bitcast(block, element.as_pointer()),
            shape=[ir.Constant(intp, n)],
            strides=[ir.Constant(intp, 4)],
            itemsize=ir.Constant(intp, 4),
            meminfo=None,
        )
        return array._getvalue()

    return array_type(size), codegen
