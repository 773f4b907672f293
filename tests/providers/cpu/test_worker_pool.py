"""The CPU worker pool (``providers/cpu/kernels/_worker_pool.py``) with real threads.

A test job's chunk runner writes ``chunk + 1`` into element ``chunk`` of a float32 output
(or the worker's scratch region, copied across by the caller), and can be told, through a
gate array, to hold the worker inside its chunk (a descheduled worker) or to fail on either
thread. The kernels on the pool are checked against the serial kernels and float64 in their
own test files (test_skinny_matmul.py, test_contrib_internals.py,
test_nbits_int8_activations.py); here: a late worker, failures, one pool per process, exit,
fork, concurrent callers, a busy core, and the default thread count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numba
import numpy as np
import pytest

from onnx_genrt.core.errors import KernelError
from onnx_genrt.providers.cpu import cores
from onnx_genrt.providers.cpu.kernels import _skinny_matmul as sk
from onnx_genrt.providers.cpu.kernels import _worker_pool as wp
from onnx_genrt.providers.cpu.kernels._intrinsics import (
    address_as_pointer,
    atomic_add,
    cpu_pause,
    load_acquire,
)

F32 = np.float32
# gate words: release the held worker, the worker has entered a chunk, fail on the worker,
# fail on the caller
RELEASE, ENTERED, FAIL_WORKER, FAIL_CALLER = 0, 1, 2, 3
#: Pause hints the caller's chunk 0 waits (about seconds) for the worker to take a chunk.
WAIT_PAUSES = 400_000_000


def _gate_runner(args, chunk, mode):
    a = numba.carray(address_as_pointer(args, np.int64), (wp.ARGS,))
    chunks = a[1]
    out = numba.carray(address_as_pointer(a[wp.FIRST_ARG], np.float32), (chunks,))
    gate = numba.carray(address_as_pointer(a[wp.FIRST_ARG + 1], np.int64), (4,))
    if mode == wp.COPY:
        scratch = numba.carray(address_as_pointer(a[0], np.float32), (chunks,))
        out[chunk] = scratch[chunk]
        return 0
    if mode == wp.SCRATCH:
        scratch = numba.carray(address_as_pointer(a[0], np.float32), (chunks,))
        atomic_add(gate, ENTERED, 1)
        if load_acquire(gate, FAIL_WORKER):
            return 1
        while not load_acquire(gate, RELEASE):
            cpu_pause()
        scratch[chunk] = chunk + 1
        return 0
    if load_acquire(gate, FAIL_CALLER):
        return 1
    if chunk == 0:  # give the worker time to take a chunk
        for _ in range(WAIT_PAUSES):
            if load_acquire(gate, ENTERED):
                break
            cpu_pause()
    out[chunk] = chunk + 1
    return 0


_gate_address = wp.chunk_runner(_gate_runner)


@numba.njit(nogil=True)
def _gate_job(ctrl, runner, out, gate, chunks):
    if not wp.enter(ctrl):
        return -1
    wp.set_arg(ctrl, 0, out.ctypes.data)
    wp.set_arg(ctrl, 1, gate.ctypes.data)
    return wp.run_job(ctrl, runner, chunks)


def _run_gate_job(pool: wp.WorkerPool, gate: np.ndarray, chunks: int = 4):
    out = np.zeros(chunks, F32)
    pool.reserve(chunks)
    status = _gate_job(pool.ctrl, _gate_address(), out, gate, chunks)
    assert status > 0
    return status, out


def _wait_for(condition, timeout: float = 30.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.001)


def _pool_threads_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("onnx-genrt-cpu-")]


def test_a_late_worker_costs_its_chunk_and_never_writes_the_output(two_threads):
    """The worker is held inside its chunk (as if descheduled): the caller computes that
    chunk itself and returns; the arrays stay referenced until the worker leaves, and the
    worker's late result goes to its scratch region, never to the returned output."""
    pool = two_threads
    gate = np.zeros(4, np.int64)
    status, out = _run_gate_job(pool, gate)
    assert gate[ENTERED] == 1, "the worker never took a chunk"
    assert status & 3 == 1  # a chunk was taken and not finished: computed by the caller
    np.testing.assert_array_equal(out, [1, 2, 3, 4])
    pool.settle(status, (out, gate), "test job")
    assert pool.pending() == 1
    out[:] = -1
    gate[RELEASE] = 1
    _wait_for(lambda: pool.pending() == 0)
    np.testing.assert_array_equal(out, [-1, -1, -1, -1])


def test_finished_worker_chunks_are_copied_from_its_scratch(two_threads):
    """Released at once, the worker finishes its chunk and the caller copies it."""
    pool = two_threads
    gate = np.zeros(4, np.int64)
    gate[RELEASE] = 1
    for _ in range(200):
        before = sum(pool.stats()["chunks"])
        status, out = _run_gate_job(pool, gate, chunks=8)
        np.testing.assert_array_equal(out, np.arange(1, 9))
        if status & 3 == 0 and sum(pool.stats()["chunks"]) > before:
            return
        if status & 3:
            pool.settle(status, (out, gate), "test job")
    pytest.fail("the worker never finished a chunk in time to be copied")


def test_a_chunk_that_fails_on_the_worker_raises_in_the_caller(two_threads):
    pool = two_threads
    gate = np.zeros(4, np.int64)
    gate[FAIL_WORKER] = 1
    for _ in range(200):
        status, out = _run_gate_job(pool, gate)
        if status & 3 == 2:
            with pytest.raises(KernelError, match="test job: a CPU worker thread failed"):
                pool.settle(status, (out, gate), "test job")
            return
        assert status & 3 in (0, 1), status  # the worker failed after the caller finished
        if status & 3:
            pool.settle(status, (out, gate), "test job")
    pytest.fail("the worker's failure was never reported")


def test_a_chunk_that_fails_on_the_caller_raises(two_threads):
    pool = two_threads
    gate = np.zeros(4, np.int64)
    gate[FAIL_CALLER] = gate[RELEASE] = 1
    for _ in range(200):
        status, out = _run_gate_job(pool, gate)
        if status & 3 == 3:
            with pytest.raises(
                KernelError, match="test job: the chunk kernel failed on the calling"
            ):
                pool.settle(status, (out, gate), "test job")
            return
        # the worker took every chunk before the caller ran one (a busy machine): again
        assert status & 3 in (0, 1), status
        if status & 3:
            pool.settle(status, (out, gate), "test job")
    pytest.fail("the caller never ran a chunk")


def test_one_pool_per_process_started_on_first_use():
    before = wp.pool_threads()
    try:
        wp.stop_pool()
        assert not _pool_threads_alive()
        wp.set_pool_threads(3)
        assert not _pool_threads_alive()  # started on first use only
        pool = wp.worker_pool()
        assert wp.worker_pool() is pool
        assert len(_pool_threads_alive()) == 2 and pool.alive()
        wp.set_pool_threads(2)
        smaller = wp.worker_pool()
        assert smaller is not pool and not pool.alive()
        assert [t.name for t in _pool_threads_alive()] == ["onnx-genrt-cpu-0"]
    finally:
        wp.set_pool_threads(before)


def test_the_pool_stops_at_exit():
    """A process that used the pool exits at once, its worker joined by the exit handler
    (registered before the pool's, this check runs after it)."""
    script = textwrap.dedent(
        """
        import atexit, threading
        import numpy as np

        def check():
            alive = [t.name for t in threading.enumerate() if t.name.startswith("onnx-genrt")]
            print("alive at exit:", alive)

        atexit.register(check)
        from onnx_genrt.providers.cpu.kernels import _skinny_matmul as sk, _worker_pool as wp
        wp.set_pool_threads(2)
        w = sk.pack_weight(np.ones((256, 64), np.float32))
        y = np.empty((1, 64), np.float32)
        sk.skinny_matmul(np.ones((1, 256), np.float32), w, y, chunks=4)
        assert (y == 256).all() and wp.worker_pool().alive()
        print("ran")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["ran", "alive at exit: []"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_a_forked_child_starts_its_own_pool(two_threads):
    rng = np.random.default_rng(3)
    w = sk.pack_weight(rng.standard_normal((512, 256), dtype=F32))
    x = rng.standard_normal((2, 512), dtype=F32)
    want = np.empty((2, 256), F32)
    sk._skinny_serial(x, w.tiles, sk._NO_BIAS, want)
    parent_pool = two_threads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: no worker thread was copied, a new pool starts
        code = 1
        try:
            y = np.empty_like(want)
            sk.skinny_matmul(x, w, y, chunks=8)
            fresh = wp.worker_pool() is not parent_pool and wp.worker_pool().alive()
            code = 0 if fresh and np.array_equal(y, want) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_concurrent_callers_each_get_their_own_result(two_threads):
    """Two Python threads call pooled kernels at once: one holds the pool, the other
    computes its call alone; every result is the serial kernel's."""
    rng = np.random.default_rng(4)
    cases = []
    for _ in range(2):
        w = sk.pack_weight(rng.standard_normal((1024, 260), dtype=F32))
        x = rng.standard_normal((3, 1024), dtype=F32)
        want = np.empty((3, 260), F32)
        sk._skinny_serial(x, w.tiles, sk._NO_BIAS, want)
        cases.append((w, x, want))
    errors: list[BaseException] = []

    def hammer(w, x, want) -> None:
        try:
            for _ in range(300):
                y = np.full_like(want, np.nan)
                sk.skinny_matmul(x, w, y, chunks=6)
                np.testing.assert_array_equal(y, want)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_decode_with_a_busy_core_gives_the_same_tokens(two_threads):
    """Another process spins on one core while the embedded model decodes at two threads:
    the tokens are those of one thread. (Speed with a busy core is measured in
    docs/performance.md, not asserted here.)"""
    from onnx_genrt.engine import Model, generate
    from onnx_genrt.models import default_model_path

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        prompt = "    def __init__(self"
        runs = {}
        jobs_before = two_threads.stats()["jobs"]
        for threads in (1, 2):
            model = Model(default_model_path(), [("cpu", {"threads": threads})])
            runs[threads] = generate(model, prompt, 48).tokens
        pool = wp.worker_pool()
        jobs = pool.stats()["jobs"] - (jobs_before if pool is two_threads else 0)
    finally:
        busy.kill()
        busy.wait()
    assert runs[2] == runs[1]
    assert jobs >= 48  # the decode steps' matmuls ran on the pool (whoever took the chunks)


def test_physical_cores_count_hyperthreads_once(tmp_path):
    for cpu, siblings in enumerate(["0,2", "1,3", "0,2", "1,3"]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings + "\n")
    assert cores.physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert cores.physical_cores({0, 2}, tmp_path) == 1
    assert cores.physical_cores({0, 1, 7}, tmp_path) == 3  # cpu7 unknown: count every CPU


def _blas_threads() -> set[int]:
    from threadpoolctl import threadpool_info

    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def test_the_cpu_provider_defaults_to_the_physical_cores_and_one_blas_thread():
    from onnx_genrt.providers.cpu.provider import CPUProvider

    before = wp.pool_threads()
    try:
        provider = CPUProvider()
        assert provider.threads == cores.physical_cores() <= len(cores.usable_cpus())
        assert wp.pool_threads() == provider.threads
        assert _blas_threads() == {1}
        assert CPUProvider(threads=None, blas_threads=2).threads is None
        assert wp.pool_threads() == provider.threads  # None leaves the threads as they are
        assert _blas_threads() == {1}
        CPUProvider(threads=1, blas_threads=2)
        assert wp.pool_threads() == 1 and _blas_threads() == {2}
    finally:
        CPUProvider(threads=before)
