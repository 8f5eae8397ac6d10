"""Run a function on N gloo ranks forked from a clean forkserver, with a hard timeout.

    results = run_ranks(4, fn, arg1, arg2, timeout=60)   # fn(rank, world_size, *args) -> value

`fn` must be a module-level function (it is pickled by reference). Each child initializes a gloo
process group over a FileStore, runs `fn`, and sends back its return value (keep it small: floats,
lists, CPU tensors). If any rank raises, the first error (with its traceback) is raised here, once
the other ranks have ended too (or `settle` seconds passed, then they are killed); if
the ranks don't finish within `timeout` seconds they are killed and the test fails with the
ranks that were still running, so a hang fails fast instead of stalling CI; a rank that dies
without a result (a crash: segfault, os._exit) fails the test within a second. A process group
that fails to form (gloo's TCP mesh refused, seen once in hundreds of runs with the launch tests
beside) is started again once, on a new store, before `fn` ran anywhere.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback

_CTX = None
# imported once in the fork server instead of in every rank (~0.7 s each on 2 cores); nothing
# in them reads the environment at import time except triton's TRITON_INTERPRET, which the
# root conftest sets before the server starts. torch._dynamo is what the first torch.optim
# optimizer (and a meta-device arange) imports: ~1 s per rank otherwise
_PRELOAD = ["megatron_lite.train", "megatron_lite.training.trainer", "torch._dynamo"]


def _context():
    # forkserver: children fork from a small clean process, never from the pytest parent whose
    # torch thread pools may already be running (forking those can deadlock).
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", *_PRELOAD])
    return _CTX


def _child(rank, world_size, store_path, fn, args, queue, timeout):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MEGATRON_LITE_QUIET", "1")
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        dist.barrier()  # every rank's group formed before any runs `fn`
    except BaseException as e:
        queue.put((rank, "no group", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    try:
        out = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # plain pickle copies tensor storage; the mp queue's shared-memory tensors would die
        # with this process before the parent reads them
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException as e:  # report everything, including KeyboardInterrupt/SystemExit
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _settle(procs, queue, reported: int, world_size: int, settle: float) -> None:
    """After one rank's error, let the others end for up to `settle` seconds (an agreed error
    reaches every rank: they release what they hold, e.g. the run directory lock, so the test
    sees the files a real run leaves behind), then kill whatever is left (a hang)."""
    deadline = time.monotonic() + settle
    while reported < world_size:
        try:
            queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            reported += 1
        except queue_module.Empty:
            break
    for p in procs:
        p.kill()


class _NoGroup(RuntimeError):
    """The ranks' process group did not form; nothing of `fn` ran."""


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0, settle: float = 3.0) -> list:
    try:
        return _run_ranks(world_size, fn, args, timeout, settle)
    except _NoGroup:
        return _run_ranks(world_size, fn, args, timeout, settle)


def _run_ranks(world_size: int, fn, args, timeout: float, settle: float) -> list:
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, store_path, fn, args, queue, timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, deadline = {}, time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            try:  # in short waits, to notice a rank that died without a word (a crash)
                rank, status, value = queue.get(timeout=min(max(remaining, 0.01), 1.0))
            except queue_module.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                dead = [(r, procs[r].exitcode) for r in missing if procs[r].exitcode is not None]
                if dead and queue.empty():  # its result, if any, was queued before it exited
                    for p in procs:
                        p.kill()
                    raise RuntimeError(
                        f"ranks died without a result (rank, exit code): {dead}"
                    ) from None
                if remaining > 0:
                    continue
                for p in procs:
                    p.kill()
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s (hang?)"
                ) from None
            if status == "no group":
                for p in procs:
                    p.kill()
                raise _NoGroup(f"rank {rank}: the process group did not form: {value}")
            if status == "error":
                _settle(procs, queue, len(results) + 1, world_size, settle)
                raise RuntimeError(f"rank {rank} failed: {value}")
            results[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=10)
    return [results[r] for r in range(world_size)]


def _alone_child(fn, args, queue):
    try:
        queue.put(("ok", pickle.dumps(fn(*args))))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def run_alone(fn, *args, timeout: float = 120.0):
    """`fn(*args)` in one child forked from the clean forkserver, with no process group: for
    code that sets up process-global state of its own (a dry run's fake process group)."""
    ctx = _context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_alone_child, args=(fn, args, queue), daemon=True)
    proc.start()
    try:
        status, value = queue.get(timeout=timeout)
    except queue_module.Empty:
        proc.kill()
        raise TimeoutError(f"{fn.__name__} did not finish within {timeout:.0f}s") from None
    proc.join(timeout=10)
    if status == "error":
        raise RuntimeError(f"{fn.__name__} failed: {value}")
    return pickle.loads(value)
