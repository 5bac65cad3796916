"""Run a function on N forked processes joined in one process group (CPU tests).

    from _launch import run_distributed

    def check(rank, world_size, factor):
        t = torch.tensor([rank * factor]); dist.all_reduce(t); return t.item()

    assert run_distributed(check, 4, 2.0) == [12.0] * 4

Each child gets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / NODE_RANK / MASTER_ADDR /
MASTER_PORT in its environment and an initialised default process group (gloo unless told
otherwise), so code that reads the usual launcher variables (Lightning's environments, for
instance) sees a normal distributed job. The TCP store is served by the parent on a port
the OS picks, created after the fork, so there is no free-port race and the children do
not inherit a store server thread. The first failing rank's traceback (and those of any
rank that fails within a short grace period) is raised in the parent; on a failure or a
timeout, the remaining children are killed, since they may be blocked in a collective.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from time import monotonic
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"


class DistributedTestError(RuntimeError):
    """A child rank raised, died or timed out; the message holds the children's tracebacks."""


def _child(
    rank: int,
    world_size: int,
    conn: Any,
    fn: Callable,
    args: tuple,
    backend: str,
    timeout: float,
    num_threads: int,
) -> None:
    status, payload = "error", None
    try:
        # One thread per rank: ranks do not oversubscribe the CPU, and a forked OpenMP runtime
        # whose parent already ran a thread pool can hang when it starts more threads.
        torch.set_num_threads(num_threads)
        if not conn.poll(timeout):
            raise TimeoutError(f"no store port from the parent within {timeout} s")
        port = conn.recv()
        os.environ.update(
            MASTER_ADDR=_HOST,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            NODE_RANK="0",
            GROUP_RANK="0",
        )
        store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears its groups down while another still talks to it
        status, payload = "ok", result
    except BaseException:  # noqa: BLE001 - everything a rank raises goes to the parent
        payload = f"rank {rank}:\n{traceback.format_exc()}"
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - reported to the parent as a failure
                if status == "ok":
                    status, payload = "error", f"rank {rank} (destroy_process_group):\n{traceback.format_exc()}"
    try:
        conn.send((status, payload))
    except Exception:  # noqa: BLE001 - e.g. an unpicklable return value
        conn.send(("error", f"rank {rank} could not send its result:\n{traceback.format_exc()}"))
    conn.close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    num_threads: int = 1,
    preload: tuple[str, ...] = ("torch._dynamo",),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; return results by rank.

    ``fn`` and ``args`` are inherited through fork (no pickling); return values travel back
    through a pipe and must be picklable. ``timeout`` bounds the whole run (and every
    collective inside it). Raises :class:`DistributedTestError` with the children's
    tracebacks when any rank fails, dies without a result, or the run times out.
    ``preload`` modules are imported in the parent before forking so that every child
    inherits them: DTensor and FSDP2 import ``torch._dynamo`` on first use (3-5 s), which
    would otherwise be paid again by every rank of every test.
    """
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("run_distributed must be called from a process without a default process group.")
    for module in preload:
        importlib.import_module(module)
    ctx = mp.get_context("fork")
    procs, conns = [], []
    store = None
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_child,
                args=(rank, world_size, child_conn, fn, args, backend, timeout, num_threads),
                name=f"rank{rank}",
                daemon=False,  # a rank may start its own workers (DataLoader)
            )
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        # Created after the fork so that no child inherits the store's server thread.
        store = dist.TCPStore(
            _HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )
        for conn in conns:
            conn.send(store.port)
        return _collect(procs, conns, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        for conn in conns:
            conn.close()
        del store


def _collect(procs: list, conns: list, timeout: float, grace: float = 2.0) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = monotonic() + timeout
    pending = set(range(len(procs)))

    def read(rank: int) -> None:
        try:
            status, payload = conns[rank].recv()
        except (EOFError, OSError):
            procs[rank].join(timeout=1)
            status, payload = "error", f"rank {rank} exited with code {procs[rank].exitcode} without a result"
        (results if status == "ok" else errors)[rank] = payload
        pending.discard(rank)

    while pending:
        remaining = deadline - monotonic()
        if remaining <= 0:
            break
        waitables = {conns[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for ready in wait(list(waitables), timeout=remaining):
            rank = waitables[ready]
            if rank not in pending:
                continue
            # A process that ended may still have its message in the pipe.
            if ready is conns[rank] or conns[rank].poll(0.5):
                read(rank)
            else:
                errors[rank] = f"rank {rank} exited with code {procs[rank].exitcode} without a result"
                pending.discard(rank)
        if errors:
            # Give the other ranks a moment to report their own failures, then stop.
            deadline = min(deadline, monotonic() + grace)
    if errors or pending:
        parts = [errors[r] for r in sorted(errors)]
        if pending:
            parts.append(
                f"ranks {sorted(pending)} did not finish within {timeout} s (killed)"
                if not errors
                else f"ranks {sorted(pending)} were killed after the failure above"
            )
        raise DistributedTestError("\n".join(parts))
    return [results[rank] for rank in range(len(procs))]


_LAUNCHER_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
    "OUT",  # the benchmark scripts copy their JSON there: not a test's files
)


def subprocess_env(root: str) -> dict[str, str]:
    """The environment for a script that launches its own processes (Lightning re-runs
    ``sys.argv``): this process's, without any launcher variables (a test may run inside a
    distributed job) or ``$OUT``, one OpenMP thread per process, and ``root`` on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    return env
