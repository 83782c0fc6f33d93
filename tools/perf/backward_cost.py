"""A stage-2 backward's time with many small params, over gloo ranks on the CPU.

Each rank runs a chain of 64 Linear(32, 32) layers (128 params) at stage 2,
so the per-param work rlhfz adds to backward (its grad hooks) is a large
share of it. Prints each rank's median backward time in ms over 60 steps.
Run it on two revisions, interleaved, to compare them:

    PYTHONPATH=. python3 tools/perf/backward_cost.py [world_size]
"""
import sys
import time

import torch

import rlhfz
from rlhfz.launch import run_ranks

STEPS = 60


def median_backward_ms(rank, world_size):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(64)])
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=2, lr=1e-3)
    x = torch.randn(4, 32)
    times = []
    for _ in range(STEPS):
        opt.zero_grad()
        start = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - start)
        opt.step()
    opt.close()
    return sorted(times)[len(times) // 2] * 1e3


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print(" ".join(f"{ms:.3f}" for ms in run_ranks(median_backward_ms, world)))
