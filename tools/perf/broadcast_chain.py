"""gloo's broadcast against chains in pieces, over the same bytes.

gloo broadcasts a binomial tree of whole buffers: the root sends all of a
buffer to each of its children, so with two receivers every byte leaves
the root twice. A chain (root -> receiver 1 -> receiver 2 ...) in pieces
sends each byte out of every rank once, each receiver passing a piece on
as the next arrives. This times both, in interleaved rounds, for the
sizes weight sync moves; each receiver's bytes are checked in the first.
"turns" are chains that take turns, as weight sync sends: each piece led
by the next receiver, so each receiver sends on only (R - 1)/R of it.
Each rank's CPU time (its process's, gloo's threads included) shows what
bounds each way where every rank has a core of its own: the busiest rank.

    python3 tools/perf/broadcast_chain.py [--mib 118] [--receivers 2]
        [--pieces-mib 1,4,16] [--rounds 8]
"""
import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _chain(buf: torch.Tensor, piece: int, rank: int, world: int) -> None:
    pieces = list(buf.split(piece))
    sends = []
    if rank == 0:
        sends = [dist.isend(p, 1) for p in pieces]
    else:
        recvs = [dist.irecv(p, rank - 1) for p in pieces]
        for p, work in zip(pieces, recvs):
            work.wait()
            if rank + 1 < world:
                sends.append(dist.isend(p, rank + 1))
    for work in sends:
        work.wait()


def _turns(buf: torch.Tensor, piece: int, rank: int, world: int) -> None:
    """Chains that take turns: piece j goes to receiver 1 + j mod R first,
    then through the others, wrapping around (a scatter and an all-gather,
    pipelined): src sends each byte once, each receiver (R - 1)/R of them."""
    receivers = list(range(1, world))
    routes = []
    for j, p in enumerate(buf.split(piece)):
        lead = j % len(receivers)
        order = [0] + receivers[lead:] + receivers[:lead]
        at = order.index(rank)
        routes.append((p, order[at - 1] if at else None,
                       order[at + 1] if at + 1 < len(order) else None))
    if rank == 0:
        sends = [dist.isend(p, to) for p, _, to in routes]
    else:
        recvs = [dist.irecv(p, came) for p, came, _ in routes]
        sends = []
        for (p, _, to), work in zip(routes, recvs):
            work.wait()
            if to is not None:
                sends.append(dist.isend(p, to))
    for work in sends:
        work.wait()


def _rank(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    nbytes = args.mib << 20
    # random bytes: a piece delivered in another's place shows
    expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
    buf = expected.clone() if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    ways = (["broadcast"] + [f"chain {p} MiB" for p in args.pieces_mib]
            + [f"turns {p} MiB" for p in args.pieces_mib])
    times = {way: [] for way in ways}
    cpus = {}
    for round_ in range(args.rounds):
        for way in ways:
            if rank:
                buf.zero_()
            dist.barrier()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            cpu0 = ru.ru_utime + ru.ru_stime
            start = time.perf_counter()
            if way == "broadcast":
                dist.broadcast(buf, 0)
            else:
                send = _chain if way.startswith("chain") else _turns
                send(buf, int(way.split()[1]) << 20, rank, world)
            ru = resource.getrusage(resource.RUSAGE_SELF)
            mine = torch.tensor([ru.ru_utime + ru.ru_stime - cpu0])
            dist.barrier()
            times[way].append(time.perf_counter() - start)
            allc = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(allc, mine)
            cpus.setdefault(way, []).append([float(c) for c in allc])
            if rank and round_ == 0 and not torch.equal(buf, expected):
                raise RuntimeError(f"rank {rank}: {way} delivered other bytes")
    if rank == 0:
        raw = statistics.median(times["broadcast"])
        print(f"| way ({args.mib} MiB to {world - 1} receivers) | median ms | vs broadcast | "
              f"CPU ms of each rank (src first) |")
        print("| --- | --- | --- | --- |")
        for way in ways:
            ms = statistics.median(times[way]) * 1e3
            cpu = ", ".join(f"{statistics.median(c[r] for c in cpus[way]) * 1e3:.1f}"
                            for r in range(world))
            print(f"| {way} | {ms:.1f} | {raw * 1e3 / ms:.2f}x | {cpu} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=118)
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--pieces-mib", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--port", type=int, default=29791)
    args = parser.parse_args()
    world = args.receivers + 1
    mp.spawn(_rank, args=(world, args.port, args), nprocs=world)


if __name__ == "__main__":
    main()
