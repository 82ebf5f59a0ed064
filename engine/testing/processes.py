"""Run a function in N gloo processes on the CPU and collect each rank's return value.

Workers are forked (about twice as fast to start as spawn or torchrun, measured on torch 2.13), get the
torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one intra-op thread
each, and a finite collective timeout through the caller's config. A failing rank's traceback is
re-raised in the parent; a rank that neither returns nor fails within ``timeout`` seconds fails the
test with the ranks that were still running, instead of stalling CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue, torchrun_env) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if torchrun_env:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    else:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        if dist.is_initialized():
            # Rank 0 hosts the TCP store: it must not tear it down while others still create groups.
            dist.barrier()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _set_environ(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set (None: remove) the variables of ``values`` in ``os.environ``; returns their old values
    in the same form, so that a second call restores them."""
    old = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return old


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args, timeout: float | None = None, torchrun_env: bool = True,
    env: dict[str, str | None] | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` in ``world_size`` forked processes; return results ordered by rank.

    ``torchrun_env=False`` (one process only) starts the worker as a plain ``python`` run would:
    without RANK/WORLD_SIZE, so no process group is created.

    ``fn`` must be picklable-free (fork start) and its return value picklable. With ``env`` the
    workers are spawned instead, with these variables set before their Python starts (what a
    library reads once at load, e.g. the CPU kernel choice of engine/parity/noise.py's
    ``kernel_twin_env()``, cannot be changed in a fork of this process; None removes a variable):
    ``fn`` and ``args`` must then be picklable (a module-level function).

    Raises:
        RuntimeError: with every failed rank's traceback, or the ranks that timed out.
    """
    if timeout is None:
        # Ranks share 2 cores in CI: start-up and each step slow down with the process count.
        timeout = 120.0 + 30.0 * world_size
    ctx = mp.get_context("spawn" if env else "fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, queue, torchrun_env), daemon=True)
        for rank in range(world_size)
    ]
    saved = _set_environ(env or {})  # a spawned child starts with this process's environment
    try:
        for proc in procs:
            proc.start()
    finally:
        _set_environ(saved)
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except Exception:  # queue.Empty
                missing = sorted(set(range(world_size)) - set(results))
                failures.append(f"timed out after {timeout:.0f} s waiting for ranks {missing}")
                break
            if ok:
                results[rank] = payload
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks will hang on collectives; stop them below
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise RuntimeError("distributed test failed:\n" + "\n".join(failures))
    return [results[rank] for rank in range(world_size)]
