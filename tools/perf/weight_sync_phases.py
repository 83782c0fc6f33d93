"""Where a weight sync's time goes, step by step, against a raw broadcast.

For each layout on the command line, TRAINERS:STAGE:BUCKET_MIB (default
1:2:32 2:2:32 2:3:32), the ranks of benchmarks/weight_sync_workers.py: the
trainers hold the benchmark's 118 MB GPT-2 under ZeroAdamW, as many
receivers hold plain copies, and rank 0 sends. Each of ROUNDS rounds times a
raw broadcast of the same bytes and one sync, each from a barrier to the
last rank's return. The sync's steps are timed by wrapping them: the
sender's plan, its manifest and its wait for the receivers' verdict (what
passes before the first byte), each receiver's time blocked on a bucket
and its unpacking, and each trainer's blocking gathers. Medians per sync, in
ms. Run it on a machine with a core for each rank:

    PYTHONPATH=. python3 tools/perf/weight_sync_phases.py 1:2:32 2:3:32
"""
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(HERE, "..", "..", "benchmarks")
ROUNDS = 12


def _timers(totals: dict):
    """Wraps the sync's steps; totals[label] gets each call's seconds."""
    import rlhfz.stage3
    import rlhfz.weight_sync
    from rlhfz.comm import channel

    def wrap(owner, name, label):
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals.setdefault(label, []).append(time.perf_counter() - start)
        setattr(owner, name, timed)

    wrap(rlhfz.weight_sync._Sender, "__init__", "plan")
    wrap(channel.BroadcastChannel, "object", "manifest")
    wrap(channel.BroadcastChannel, "verdict", "verdict")
    wrap(rlhfz.weight_sync, "_receive_buckets", "receiving")
    wrap(channel._Sent, "wait", "blocked")
    wrap(rlhfz.stage3.Stage3, "gather_many", "gathers")


def layout(rank, world_size, trainers, stage, bucket_mib):
    sys.path.insert(0, BENCHMARKS)
    import rlhfz
    import weight_sync_workers as workers
    totals = {}
    _timers(totals)
    trainer = rank < trainers
    model = workers._build("medium", 0 if trainer else rank)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    train = dist.new_group(list(range(trainers)))
    sync = dist.new_group([0] + list(range(trainers, world_size)))
    if trainer:
        rlhfz.ZeroAdamW(model, stage=stage, process_group=train)
    in_sync = rank == 0 or not trainer
    flat = torch.empty(nbytes, dtype=torch.uint8)
    walls = {"raw": [], "rlhfz": []}
    for _ in range(ROUNDS):
        for way in walls:
            dist.barrier()
            start = time.perf_counter()
            if way == "raw":
                if in_sync:
                    dist.broadcast(flat, src=0, group=sync)
            elif trainer:
                rlhfz.sync_weights(model, sync if rank == 0 else None, src=0,
                                   bucket_bytes=bucket_mib << 20)
            else:
                rlhfz.receive_weights(model, sync, src=0)
            everyone = [None] * world_size
            dist.all_gather_object(everyone, time.perf_counter() - start)
            walls[way].append(max(everyone))
    # the steps called once per sync: their median; those called per bucket
    # or per unit: their sum over a sync
    once = {"plan", "manifest", "verdict", "receiving"}
    steps = {label: (statistics.median(v) if label in once else sum(v) / ROUNDS) * 1e3
             for label, v in totals.items()}
    if "receiving" in steps:
        steps["unpacking"] = steps["receiving"] - steps.get("blocked", 0.0)
    return {"role": "sender" if rank == 0 else "trainer" if trainer else "receiver",
            "steps": steps, "raw": statistics.median(walls["raw"]) * 1e3,
            "rlhfz": statistics.median(walls["rlhfz"]) * 1e3}


def main(argv):
    from rlhfz.launch import run_ranks
    columns = ["plan", "manifest", "verdict", "blocked", "unpacking", "gathers"]
    print("| layout | rank | role | raw ms | rlhfz ms | fraction | "
          + " | ".join(columns) + " |")
    print("| --- " * (6 + len(columns)) + "|")
    for spec in argv or ["1:2:32", "2:2:32", "2:3:32"]:
        trainers, stage, bucket_mib = (int(part) for part in spec.split(":"))
        results = run_ranks(layout, 2 * trainers, trainers, stage, bucket_mib, timeout=600)
        for rank, result in enumerate(results):
            steps = result["steps"]
            cells = [f"{steps[c]:.2f}" if c in steps else "-" for c in columns]
            print(f"| {trainers} trainer(s), stage {stage}, {bucket_mib} MiB | {rank} | "
                  f"{result['role']} | {result['raw']:.1f} | {result['rlhfz']:.1f} | "
                  f"{result['raw'] / result['rlhfz']:.2f} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
