"""Runs a function on N local gloo ranks in spawned processes, with timeouts.

`run_ranks(worker, world_size, *args)` returns each rank's result, in rank
order, or raises with the failing ranks' tracebacks. The worker must be
importable by the spawned processes (defined at a module's top level); it is
called as worker(rank, world_size, *args) inside an initialized gloo group,
with the machine's cores split between the ranks, in the caller's
environment as it is at the call, with LOCAL_RANK set to the rank (all ranks
are on this machine), as torchrun sets it. Used by the demo and the
multi-process tests.

Ranks fork from a server that imported torch once (multiprocessing's
forkserver), so a rank starts in a fraction of a second, not the seconds an
import of torch takes. A run whose processes must end through the
interpreter's exit (Python coverage, gcov, a sanitizer's leak check) spawns
fresh interpreters instead: RLHFZ_RANK_START=spawn, or any process that
COVERAGE_PROCESS_START names a coverage configuration for.
"""
import datetime
import io
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
# what the fork server imports before it forks ranks; extend it before the
# first run_ranks (later changes reach no server already started)
PRELOAD = ["torch", "torch.distributed"]
# the most ranks the tests run on one machine
RANKS_PER_MACHINE = 4


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def torch_threads() -> int:
    """torch's threads in every rank: the cores' share of the largest world
    run on one machine (at least one). torch's matmuls sum in an order that
    depends on its thread count, so every world size gets the same count,
    and runs at 1, 2 or 4 ranks (or in the calling process, set alike)
    stay comparable bit for bit."""
    return max(1, _cores() // RANKS_PER_MACHINE)


def _share_cores(world_size: int) -> None:
    """Ranks on one machine split its cores (torch's and rlhfz's threads):
    more threads than cores only wait on each other. rlhfz's kernels give
    the same bits at any thread count."""
    import torch
    import rlhfz
    torch.set_num_threads(torch_threads())
    rlhfz.set_num_threads(max(1, _cores() // world_size))


_SERVER_STARTED_WITH = [None]      # (environment, preload) of the running fork server


def _context():
    method = os.environ.get("RLHFZ_RANK_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"RLHFZ_RANK_START must be 'forkserver' or 'spawn', not {method!r}")
    from multiprocessing import forkserver
    server = getattr(forkserver, "_forkserver", None)
    if method == "spawn" or os.environ.get("COVERAGE_PROCESS_START") \
            or not hasattr(server, "_stop"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # A rank has the environment its server started with, and reads some of
    # it as rlhfz loads, before any code of a worker runs: a server started
    # before the caller's environment changed is replaced.
    wanted = ({k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
              list(PRELOAD))
    if _SERVER_STARTED_WITH[0] != wanted:
        server._stop()
        ctx.set_forkserver_preload(PRELOAD)
        _SERVER_STARTED_WITH[0] = wanted
    return ctx


def _entry(worker, rank, world_size, store_path, results, args):
    import torch.distributed as dist
    os.environ.setdefault("RLHFZ_COLLECTIVE_TIMEOUT", str(COLLECTIVE_TIMEOUT_S))
    # every rank is on this machine: its local rank is its rank (a GPU
    # program picks its device by it; the simulated build, RLHFZ_SIM_DEVICE=local_rank)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        _share_cores(world_size)
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # Bytes, not tensors: a tensor sent through the queue is a shared-memory
        # handle that dies with this process.
        blob = io.BytesIO()
        import torch
        torch.save(worker(rank, world_size, *args), blob)
        results.put((rank, "ok", blob.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(worker, world_size, *args, timeout=180):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number of ranks >= 1, not {world_size!r}")
    ctx = _context()
    results = ctx.Queue()
    # A file store: no port to pick, so none another process can take first.
    store_dir = tempfile.mkdtemp(prefix="rlhfz-ranks-")
    store_path = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_entry, args=(worker, rank, world_size, store_path, results, args))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    outcomes = {}
    deadline = time.monotonic() + timeout
    ended_at = {}            # rank -> when its process was first seen ended without a result
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                outcomes[rank] = (status, value)
                continue
            except queue_module.Empty:
                pass
            # a rank whose process ended (killed, say) sends nothing: once the
            # queue had time to deliver what it sent, stop waiting for it
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank not in outcomes and p.exitcode is not None:
                    ended_at.setdefault(rank, now)
            if ended_at and all(r in outcomes or (r in ended_at and now - ended_at[r] > 2.0)
                                for r in range(world_size)):
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    missing = [r for r in range(world_size) if r not in outcomes]
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if missing or errors:
        # say what happened: a rank raised, its process ended without a
        # result, or it was still running at the timeout
        ended = [r for r in missing if r in ended_at]
        late = [r for r in missing if r not in ended_at]
        what = ([f"ranks {sorted(errors)} raised"] if errors else []) + (
            [f"ranks {ended} gave no result: their processes ended (exit codes "
             f"{[procs[r].exitcode for r in ended]})"] if ended else []) + (
            [f"ranks {late} gave no result within {timeout} s"] if late else [])
        details = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"world {world_size}: " + "; ".join(what) + details)
    import torch
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]
