"""Workloads timed by tools/perf/compare_revisions.py, through the public API
only, so that any revision of rlhfz runs them. Each prints one JSON line:
{"workload": name, "seconds": [per-iteration times]}.

    python3 revision_workloads.py WORKLOAD ITERATIONS

The tree whose rlhfz is timed comes first on PYTHONPATH.
"""
import datetime
import json
import os
import sys
import tempfile
import time

import torch

DIM = 512
LAYERS = 6


def _model(layers=LAYERS, dim=DIM):
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(dim, 4 * dim)
            self.down = torch.nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.head = torch.nn.Linear(dim, dim)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)
    return Model()


def _timed(body, iterations, warmup=3):
    times = []
    for i in range(warmup + iterations):
        start = time.perf_counter()
        body()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def cpu_step(iterations):
    """One process, stage 0: the step alone (grads set once)."""
    import rlhfz
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-4, stage=0)
    model(torch.randn(8, DIM)).pow(2).mean().backward()
    return _timed(opt.step, iterations)


def offload_reload(iterations):
    """One process: offload params, grads and state to host memory, reload."""
    import rlhfz
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-4, stage=0)
    model(torch.randn(8, DIM)).pow(2).mean().backward()
    opt.step()

    def cycle():
        with tempfile.TemporaryDirectory() as directory:
            rlhfz.offload(model, opt, to="disk", path=directory)
            rlhfz.reload(model, opt)
        rlhfz.offload(model, opt, to="cpu")
        rlhfz.reload(model, opt)
    return _timed(cycle, iterations)


def _rank(rank, world_size, store, stage, mode, iterations, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    import rlhfz
    model = _model()
    opt = rlhfz.ZeroAdamW(model, lr=1e-4, stage=stage)
    x = torch.randn(16, DIM, generator=torch.Generator().manual_seed(rank))

    def train():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    def generate():
        with rlhfz.gather_for_generation(model, enabled=False), torch.no_grad():
            for _ in range(4):
                model(x[:1])
    times = _timed(train if mode == "train" else generate, iterations)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    opt.close()
    dist.destroy_process_group()


def _ranks(stage, mode, iterations):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "times.json")
        mp.start_processes(_rank, args=(2, os.path.join(directory, "store"), stage, mode,
                                        iterations, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def stage1_iteration(iterations):
    """Stage 1, 2 ranks: the grads averaged when backward ends."""
    return _ranks(1, "train", iterations)


def stage2_iteration(iterations):
    return _ranks(2, "train", iterations)


def stage3_iteration(iterations):
    return _ranks(3, "train", iterations)


def generation(iterations):
    """Stage 3, 2 ranks: four forwards that gather unit by unit."""
    return _ranks(3, "generate", iterations)


WORKLOADS = {f.__name__: f for f in (cpu_step, stage1_iteration, stage2_iteration,
                                     stage3_iteration, generation, offload_reload)}

if __name__ == "__main__":
    name, iterations = sys.argv[1], int(sys.argv[2])
    os.environ.setdefault("RLHFZ_PROGRESS", "0")
    print(json.dumps({"workload": name, "seconds": WORKLOADS[name](iterations)}))
