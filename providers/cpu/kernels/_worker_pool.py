"""One process-wide pool of spinning worker threads for the skinny kernels (M <= 16 rows).

A decode step is a chain of matmuls of 3-500 us each. Numba's parallel regions (OpenMP or
workqueue) hand each thread its share when the region starts and make the caller wait for
every share at the end: when another process holds a core, the caller waits for a worker
that is not even running, at every node (docs/performance.md: two threads fell to 35 tok/s
from 2900). Here the caller waits for a worker only a bounded time:

- A job is a kernel's chunk runner (a ``numba.cfunc`` ``int64 run(args, chunk, mode)``),
  its arguments (addresses and sizes, ``ARGS`` int64 words) and a number of chunks (runs of
  output columns). The caller publishes it in one job word, ``seq << 32 | chunks << 16 |
  next``, and both the caller and the workers take chunks by incrementing ``next``
  atomically (the workers with a compare-and-swap that also checks ``seq``, so a late worker
  never takes a chunk of another job). The atomics are LLVM's, emitted by ``_intrinsics``.
- A worker writes its chunks into its own scratch region laid out like the output, then
  marks the chunk done (the job's ``seq``, the worker and whether the runner failed, in one
  word). Once every chunk is taken, the caller copies the finished ones from scratch; a
  chunk a worker took but has not finished gets up to ``WAIT_CHUNKS`` times the caller's
  own time per chunk (all such chunks together, measured with the cycle counter), since a
  running worker finishes about when the caller does; then the caller computes it again,
  into the output (the worker was descheduled). A late worker costs at most that wait and
  the chunk it holds, and it never writes the output after the call returns.
  Every chunk is computed by the same code in any thread, so results are identical to the
  serial kernel's.
- A worker that went without work spins on the job word with the CPU's pause hint for
  ``IDLE_PAUSE_US`` (the gaps between the matmuls of a step), then calls ``sched_yield``
  ``IDLE_YIELDS`` times (a thread of this process waiting for its core runs first), then
  sleeps on a POSIX semaphore, which the caller posts when it publishes the next job. A
  sleeping worker costs no waiting either: the caller takes all the chunks itself.
- When the workers took no chunk of ``MISS_LIMIT`` jobs in a row (their cores are busy with
  other work), they nap, asleep, for ``NAP_JOBS`` jobs: spinning there would only take time
  from the caller where they share its core.
- The arrays a job points to must outlive every worker's use of them: a call whose chunks
  all came back needs nothing; otherwise (a late worker) the caller's wrapper hands its
  arrays to :meth:`WorkerPool.settle`, which keeps them until no worker is inside that job.
  Operands a kernel prepares for its chunks go into the pool's operand buffer
  (:meth:`WorkerPool.reserve`, ``carve``), kept the same way.

One pool per process (:func:`worker_pool`), started on first use with ``threads - 1``
workers, started again when :func:`set_pool_threads` changes the count, stopped at exit,
forgotten in a forked child. A second Python thread calling a pooled kernel while the pool
runs a job computes its own call alone (the pool takes one job at a time).

Numba caches a function with the callees it inlines but checks only its own file: after
changing this module, delete the Numba cache of the kernels that call it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
from collections.abc import Callable

import numba
import numpy as np
from numba import types

from onnx_genrt.core.errors import KernelError

from ._intrinsics import (
    address_as_pointer,
    atomic_add,
    atomic_cas,
    atomic_max,
    atomic_xchg,
    call_address,
    call_c_int,
    call_c_void_int,
    cpu_pause,
    cycle_counter,
    load_acquire,
    load_relaxed,
    load_seq_cst,
    store_relaxed,
    store_release,
    store_seq_cst,
)

#: Signature of a chunk runner: ``run(args address, chunk, mode) -> 0 or an error code``.
RUNNER_SIGNATURE = types.int64(types.int64, types.int64, types.int64)
#: Runner modes: compute the chunk into the output, into the scratch buffer, or copy it
#: from the scratch buffer into the output.
OUT, SCRATCH, COPY = 0, 1, 2
#: int64 words of a job's arguments: word 0 is the scratch address the runner writes (set
#: by the pool: each worker has its own region), word 1 the number of chunks; a kernel's
#: own arguments start at ``FIRST_ARG``.
ARGS = 21
FIRST_ARG = 2
#: Most chunks a job may have (the job word holds the count in 16 bits).
MAX_CHUNKS = 256
#: Most workers (a done flag holds the worker in 8 bits).
MAX_WORKERS = 255
#: An idle worker spins with the pause hint for ``IDLE_PAUSE_US`` (the gaps between the
#: matmuls of a step), then calls ``sched_yield`` ``IDLE_YIELDS`` times (a thread waiting for
#: its core runs), then sleeps until the caller posts it.
IDLE_PAUSE_US = 20.0
IDLE_YIELDS = 1000
#: Jobs of at least ``MISS_MIN_CHUNKS`` chunks in a row that no worker took a chunk of
#: (their cores are busy with other work) after which the workers nap for ``NAP_JOBS`` jobs:
#: a spinning worker that shares a core with the caller only takes the caller's time.
MISS_LIMIT = 16
MISS_MIN_CHUNKS = 4
NAP_JOBS = 256
#: Further jobs a worker may miss after the caller woke it (it takes a while to run).
WAKE_GRACE = 48
#: The caller waits for workers' unfinished chunks at most this many times its own average
#: chunk time (cycle counter), all chunks together, before computing them itself.
WAIT_CHUNKS = 2

# ctrl layout (int64 words); each line of 8 words is 64 bytes, one cache line.
_LINE = 8
_JOB = 0  # seq << 32 | chunks << 16 | next: read by every spinning worker
_STOP = 1  # set once, on the job word's line, which the workers read anyway
_SEQ = 8  # the caller's side (written once per job)
_FN = 9
_BUSY = 10  # 1 while a caller holds the pool
_IDLE_SPINS = 11  # pause hints, then sched_yield calls, an idle worker makes before sleeping
_WORKERS = 12
_SEM_POST = 13  # address of libc's sem_post, sem_wait and of the first semaphore
_SEM_WAIT = 14
_SEMS = 15
_IDLE_YIELDS = 39  # in the last argument line's spare word
_SCHED_YIELD = 38
_ARGS = 16  # three lines but the last three words
_SCRATCH = 40  # address of the scratch buffer and float32 values per worker's region
_SCRATCH_LEN = 41
_OPERANDS = 42  # address and bytes of the buffer for a job's prepared operands
_OPERANDS_LEN = 43
_DONE_AT = 44
_MINE_AT = 45
_NAP_UNTIL = 46  # workers sleep through the jobs before this one (the caller runs alone)
_MISSES = 47  # the caller's count of jobs in a row no worker helped with
_WORKER0 = 48  # one line per worker
_SLEEPING = 0  # per-worker words
_INSIDE = 1
_CHUNKS_RUN = 2
_SLEEPS = 3
_SEM_BYTES = 64  # room per semaphore (glibc's sem_t is 32 bytes)
_COUNT = 0xFFFF
_NAPS = 37  # naps so far (statistics)


@numba.njit(cache=True, nogil=True)
def _spin(n):
    """``n`` pause hints, for calibrating the idle spin."""
    for _ in range(n):
        cpu_pause()


@numba.njit(cache=True, nogil=True)
def _worker_loop(ctrl, w):
    """Worker ``w``: take chunks of published jobs until the pool stops."""
    line = _WORKER0 + _LINE * w
    done_at = ctrl[_DONE_AT]
    sem = ctrl[_SEMS] + _SEM_BYTES * w
    local = np.empty(ARGS, np.int64)
    local_addr = local.ctypes.data
    idle = 0
    while True:
        word = load_acquire(ctrl, _JOB)
        if load_relaxed(ctrl, _STOP):
            return
        total = (word >> 16) & _COUNT
        nxt = word & _COUNT
        if (word >> 32) < load_relaxed(ctrl, _NAP_UNTIL):
            idle = load_relaxed(ctrl, _IDLE_SPINS) + load_relaxed(ctrl, _IDLE_YIELDS)  # nap
        elif nxt < total:
            # copy the job before taking a chunk: a successful swap proves the copy is of
            # this job (the caller writes the next job only after every chunk is taken)
            fn = load_relaxed(ctrl, _FN)
            for a in range(ARGS):
                local[a] = load_relaxed(ctrl, _ARGS + a)
            local[0] = load_relaxed(ctrl, _SCRATCH) + 4 * w * load_relaxed(ctrl, _SCRATCH_LEN)
            seq = word >> 32
            store_seq_cst(ctrl, line + _INSIDE, seq)
            if atomic_cas(ctrl, _JOB, word, word + 1) == word:
                failed = call_address(fn, local_addr, nxt, SCRATCH) != 0
                atomic_max(ctrl, done_at + nxt, _done_flag(seq, w, failed))
                ctrl[line + _CHUNKS_RUN] += 1
            store_release(ctrl, line + _INSIDE, 0)
            idle = 0
            continue
        idle += 1
        spins = load_relaxed(ctrl, _IDLE_SPINS)
        if idle < spins:
            cpu_pause()
            continue
        if idle < spins + load_relaxed(ctrl, _IDLE_YIELDS):
            # let a thread waiting for this core (the caller, say) have it
            call_c_void_int(ctrl[_SCHED_YIELD])
            continue
        # sleep unless a job came (or the nap ended) meanwhile; the caller posts a sleeping
        # worker when it publishes a job past the nap
        atomic_xchg(ctrl, line + _SLEEPING, 1)
        latest = load_seq_cst(ctrl, _JOB)
        napping = (latest >> 32) < load_relaxed(ctrl, _NAP_UNTIL)
        if (latest != word and not napping) or load_seq_cst(ctrl, _STOP):
            atomic_xchg(ctrl, line + _SLEEPING, 0)
        else:
            call_c_int(ctrl[_SEM_WAIT], sem)
            ctrl[line + _SLEEPS] += 1
        idle = 0


@numba.njit(cache=True, nogil=True, inline="always")
def _done_flag(seq, w, failed):
    """A chunk's done word: later jobs compare greater (``atomic_max`` keeps the latest)."""
    return (((seq << 8) | w) << 1) | failed


@numba.njit(cache=True, nogil=True, inline="always")
def _count_miss(ctrl, seq, total, mine, woke):
    """Count jobs in a row the workers took no chunk of; at ``MISS_LIMIT`` send them to
    nap for ``NAP_JOBS`` jobs. A job that woke a worker does not count (waking takes time)."""
    if woke:
        ctrl[_MISSES] = -WAKE_GRACE
    elif mine < total:
        ctrl[_MISSES] = 0
    elif total >= MISS_MIN_CHUNKS and seq >= ctrl[_NAP_UNTIL]:
        ctrl[_MISSES] += 1
        if ctrl[_MISSES] >= MISS_LIMIT:
            ctrl[_MISSES] = 0
            store_relaxed(ctrl, _NAP_UNTIL, seq + NAP_JOBS)
            ctrl[_NAPS] += 1


@numba.njit(cache=True, nogil=True)
def enter(ctrl):
    """Take the pool for one job; False when another thread holds it."""
    return atomic_cas(ctrl, _BUSY, 0, 1) == 0


@numba.njit(cache=True, nogil=True)
def _leave(ctrl):
    """Release the pool taken with ``enter`` without running a job."""
    store_release(ctrl, _BUSY, 0)


@numba.njit(cache=True, nogil=True, inline="always")
def set_arg(ctrl, i, value):
    """Argument word ``FIRST_ARG + i`` of the job being prepared (the pool must be held)."""
    store_relaxed(ctrl, _ARGS + FIRST_ARG + i, value)


@numba.njit(cache=True, nogil=True)
def operand_address(ctrl):
    """Address of the pool's operand buffer (``WorkerPool.reserve``), 64-byte aligned: a
    held pool's job may prepare operands there that its chunks read."""
    return ctrl[_OPERANDS]


@numba.njit(cache=True, nogil=True, inline="always")
def carve(addr, shape, dtype):
    """An array of ``shape`` and ``dtype`` at ``addr`` (in the operand buffer), and the
    next 64-byte aligned address after it."""
    arr = numba.carray(address_as_pointer(addr, dtype), shape)
    return arr, addr + (arr.nbytes + 63) // 64 * 64


@numba.njit(cache=True, nogil=True)
def run_job(ctrl, fn, total):
    """Run ``total`` chunks of ``fn`` on the job arguments set with ``set_arg``, with the
    workers, and release the pool. Returns ``seq * 4 + code``: code 0 when every worker
    has left the job, 1 when a late worker may still be in it (keep its arrays alive:
    ``WorkerPool.settle``), 2 when a worker's chunk failed, 3 when the caller's did."""
    seq = ctrl[_SEQ] + 1
    ctrl[_SEQ] = seq
    store_relaxed(ctrl, _FN, fn)
    store_relaxed(ctrl, _ARGS + 1, total)
    store_seq_cst(ctrl, _JOB, (seq << 32) | (total << 16))
    woke = False
    if seq >= ctrl[_NAP_UNTIL]:
        for w in range(ctrl[_WORKERS]):
            line = _WORKER0 + _LINE * w
            if load_seq_cst(ctrl, line + _SLEEPING) and atomic_xchg(ctrl, line + _SLEEPING, 0):
                call_c_int(ctrl[_SEM_POST], ctrl[_SEMS] + _SEM_BYTES * w)
                woke = True
    args = ctrl.ctypes.data + 8 * _ARGS
    mine_at = ctrl[_MINE_AT]
    done_at = ctrl[_DONE_AT]
    code = 0
    mine = 0
    began = cycle_counter()
    while True:
        c = atomic_add(ctrl, _JOB, 1) & _COUNT
        if c >= total:
            break
        ctrl[mine_at + c] = seq
        mine += 1
        if call_address(fn, args, c, OUT) != 0:
            code = 3
    _count_miss(ctrl, seq, total, mine, woke)
    # A worker's chunk still running gets up to WAIT_CHUNKS times the caller's own time per
    # chunk to finish (a running worker ends about when the caller does), then is computed
    # here: a worker that is not running costs that wait plus one chunk, never more.
    budget = (cycle_counter() - began) * WAIT_CHUNKS // max(mine, 1)
    # every chunk is taken: no worker reads the arguments any more
    region = 4 * ctrl[_SCRATCH_LEN]
    for c in range(total):
        if ctrl[mine_at + c] == seq:
            continue
        flag = load_acquire(ctrl, done_at + c)
        if flag >> 9 != seq and budget > 0:
            waited = cycle_counter()
            while flag >> 9 != seq and cycle_counter() - waited < budget:
                cpu_pause()
                flag = load_acquire(ctrl, done_at + c)
            budget -= cycle_counter() - waited
        if flag >> 9 == seq and not flag & 1:
            store_relaxed(ctrl, _ARGS, ctrl[_SCRATCH] + region * ((flag >> 1) & 0xFF))
            if call_address(fn, args, c, COPY) != 0:
                code = 3
        elif flag >> 9 == seq:
            code = max(code, 2)
        else:  # taken by a worker that has not finished it: compute it here
            code = max(code, 1)
            if call_address(fn, args, c, OUT) != 0:
                code = 3
    store_release(ctrl, _BUSY, 0)
    return seq * 4 + code


class WorkerPool:
    """``workers`` threads spinning in ``_worker_loop`` on the shared ``ctrl`` words."""

    def __init__(self, workers: int) -> None:
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"a worker pool has 1 to {MAX_WORKERS} workers, got {workers}")
        self.workers = workers
        self.threads = workers + 1
        done_at = _WORKER0 + _LINE * workers
        self.ctrl = np.zeros(done_at + 2 * MAX_CHUNKS, np.int64)
        self.ctrl[_WORKERS] = workers
        self.ctrl[_DONE_AT] = done_at
        self.ctrl[_MINE_AT] = done_at + MAX_CHUNKS
        self._scratch = np.empty(0, np.float32)
        self._operands = np.empty(0, np.uint8)
        self._room = (0, 0)  # scratch values per worker, operand bytes (as Python ints)
        self._pending: list[tuple[int, tuple]] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._sems = np.zeros(workers * _SEM_BYTES, np.uint8)
        for w in range(workers):
            if self._libc.sem_init(ctypes.c_void_p(self._sem(w)), 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "sem_init failed for the CPU worker pool")
        self.ctrl[_SEMS] = self._sems.ctypes.data
        self.ctrl[_SEM_POST] = ctypes.cast(self._libc.sem_post, ctypes.c_void_p).value
        self.ctrl[_SEM_WAIT] = ctypes.cast(self._libc.sem_wait, ctypes.c_void_p).value
        self.ctrl[_SCHED_YIELD] = ctypes.cast(self._libc.sched_yield, ctypes.c_void_p).value
        self.ctrl[_IDLE_SPINS] = max(1, int(IDLE_PAUSE_US * _pauses_per_us()))
        self.ctrl[_IDLE_YIELDS] = IDLE_YIELDS
        self._threads = [
            threading.Thread(target=self._work, args=(w,), name=f"onnx-genrt-cpu-{w}", daemon=True)
            for w in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _sem(self, w: int) -> int:
        return self._sems.ctypes.data + _SEM_BYTES * w

    def _work(self, w: int) -> None:
        try:
            _worker_loop(self.ctrl, w)
        except BaseException as exc:  # noqa: BLE001 - reported to the next caller
            self._error = exc
            self._room = (-1, -1)  # the next reserve raises it

    def reserve(self, out_values: int, operand_bytes: int = 0) -> None:
        """Make each worker's scratch region hold ``out_values`` float32 values and the
        operand buffer ``operand_bytes`` bytes. Raises ``KernelError`` if a worker died."""
        if out_values <= self._room[0] and operand_bytes <= self._room[1]:
            return
        if self._error is not None:
            raise KernelError(f"a CPU worker thread stopped: {self._error!r}") from self._error
        ctrl = self.ctrl
        with self._lock:
            while not enter(ctrl):  # another thread's job (it never waits for a worker)
                time.sleep(0)
            # a late worker of a job so far may still use the old buffers: keep them
            self._pending.append((int(ctrl[_SEQ]), (self._scratch, self._operands)))
            if out_values > ctrl[_SCRATCH_LEN]:
                per = max(out_values, 2 * int(ctrl[_SCRATCH_LEN]))
                self._scratch = aligned_buffer(per * self.workers * 4).view(np.float32)
                ctrl[_SCRATCH] = self._scratch.ctypes.data
                ctrl[_SCRATCH_LEN] = per
            if operand_bytes > ctrl[_OPERANDS_LEN]:
                size = max(operand_bytes, 2 * int(ctrl[_OPERANDS_LEN]))
                self._operands = aligned_buffer(size)
                ctrl[_OPERANDS] = self._operands.ctypes.data
                ctrl[_OPERANDS_LEN] = size
            self._room = (int(ctrl[_SCRATCH_LEN]), int(ctrl[_OPERANDS_LEN]))
            _leave(ctrl)

    def settle(self, status: int, arrays: tuple, what: str) -> None:
        """After ``run_job`` returned ``status`` (nonzero code): keep ``arrays`` while a late
        worker may read them, and raise ``KernelError`` for a failed chunk."""
        seq, code = divmod(status, 4)
        with self._lock:
            self._pending.append((seq, arrays))
            self._release()
        if code == 2:
            raise KernelError(f"{what}: a CPU worker thread failed on its share of the columns")
        if code == 3:
            raise KernelError(f"{what}: the chunk kernel failed on the calling thread")

    def _release(self) -> None:
        """Drop the arrays of jobs no worker is inside (a worker inside job s is inside no
        job before or after it: keep every entry of seq >= the oldest job a worker is in)."""
        inside = [int(self.ctrl[_WORKER0 + _LINE * w + _INSIDE]) for w in range(self.workers)]
        oldest = min((s for s in inside if s), default=None)
        if oldest is None:
            self._pending.clear()
        else:
            self._pending = [(seq, refs) for seq, refs in self._pending if seq >= oldest]

    def pending(self) -> int:
        """Jobs whose arrays are still kept for a late worker."""
        with self._lock:
            self._release()
            return len(self._pending)

    def stats(self) -> dict[str, int | list[int]]:
        """Jobs run, naps the workers were sent on, and per worker the chunks it computed
        and the times it went to sleep."""
        lines = [_WORKER0 + _LINE * w for w in range(self.workers)]
        return {
            "jobs": int(self.ctrl[_SEQ]),
            "naps": int(self.ctrl[_NAPS]),
            "chunks": [int(self.ctrl[i + _CHUNKS_RUN]) for i in lines],
            "sleeps": [int(self.ctrl[i + _SLEEPS]) for i in lines],
        }

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the workers (each finishes the chunk it holds)."""
        self.ctrl[_STOP] = 1
        for w in range(self.workers):
            self._libc.sem_post(ctypes.c_void_p(self._sem(w)))
        for t in self._threads:
            t.join(timeout)
        if not any(t.is_alive() for t in self._threads):
            self._pending.clear()
            for w in range(self.workers):
                self._libc.sem_destroy(ctypes.c_void_p(self._sem(w)))


#: The ctrl words' stand-in for a kernel call that runs on the calling thread alone (never
#: entered as a pool).
NO_POOL = np.zeros(1, np.int64)
_THREADS = 1
_EPOCH = 0
_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def set_pool_threads(threads: int) -> None:
    """Threads (caller included) the pooled kernels use from now on; the pool is started
    again with ``threads - 1`` workers at its next use."""
    global _THREADS, _EPOCH
    threads = max(1, int(threads))
    if threads != _THREADS:
        _EPOCH += 1
    _THREADS = threads


def pool_epoch() -> int:
    """A number that changes whenever the thread count or the pool object does: what a
    kernel worked out from them (chunks, the pool's ``ctrl`` address) holds while it stays."""
    return _EPOCH


def pool_threads() -> int:
    """Threads the pooled kernels split their work over (1: no pool)."""
    return _THREADS


def worker_pool() -> WorkerPool:
    """The process's pool, started (or restarted for a new thread count) on first use."""
    pool = _POOL
    if pool is not None and pool.threads == _THREADS:
        return pool
    return _start_pool()


def _start_pool() -> WorkerPool:
    global _POOL, _EPOCH
    with _POOL_LOCK:
        if _POOL is not None and _POOL.threads == _THREADS:
            return _POOL
        if _POOL is not None:
            _POOL.stop()
            _POOL = None
        if _THREADS < 2:
            raise ValueError("the worker pool is for two threads or more")
        _POOL = WorkerPool(_THREADS - 1)
        _EPOCH += 1
        return _POOL


def stop_pool() -> None:
    """Stop the process's pool (started again on next use)."""
    global _POOL, _EPOCH
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.stop()
            _POOL = None
            _EPOCH += 1


def aligned_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes starting on a 64-byte boundary."""
    raw = np.empty(nbytes + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset : offset + nbytes]


def operand_bytes(*arrays: tuple[tuple[int, ...], np.dtype]) -> int:
    """Bytes of the operand buffer that arrays of these (shape, dtype) take, each starting
    on a 64-byte boundary (as ``carve`` lays them out)."""
    total = 0
    for shape, dtype in arrays:
        total += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // 64) * 64
    return total


def chunk_count(units: int, work: int, min_work: int) -> int:
    """Chunks for ``units`` splittable units (column groups, tiles) of ``work`` multiply-adds
    in all: about ``min_work`` each, at least two per thread, at most one per unit."""
    wanted = max(2 * _THREADS, work // min_work)
    return max(1, min(units, MAX_CHUNKS, wanted))


def chunk_runner(fn: Callable) -> Callable[[], int]:
    """``fn`` compiled as a chunk runner on first use (cached on disk); returns a function
    giving its address."""
    compiled: list[int] = []

    def address() -> int:
        if not compiled:
            compiled.append(numba.cfunc(RUNNER_SIGNATURE, cache=True)(fn).address)
        return compiled[0]

    return address


_PAUSES_PER_US: list[float] = []


def _pauses_per_us() -> float:
    """How many pause hints take a microsecond on this CPU (measured once: the fastest of
    three runs of at least 0.2 ms, so that a preemption does not count)."""
    if not _PAUSES_PER_US:
        _spin(10)
        n = 1 << 10
        while True:
            start = time.perf_counter()
            _spin(n)
            if time.perf_counter() - start > 2e-4 or n > 1 << 24:
                break
            n *= 2
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            _spin(n)
            best = min(best, time.perf_counter() - start)
        _PAUSES_PER_US.append(n / max(best * 1e6, 1e-3))
    return _PAUSES_PER_US[0]


def _forget_in_child() -> None:
    global _POOL, _POOL_LOCK, _EPOCH
    _POOL = None  # its threads were not copied into this process
    _EPOCH += 1
    _POOL_LOCK = threading.Lock()


atexit.register(stop_pool)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
