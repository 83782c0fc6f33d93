"""Timing helpers shared by the CPU optimizer benchmarks."""
import time

import torch


def fresh_grads(opt):
    """Mark the grads as written since the last step, as a backward would
    (bumping their version counters, without touching memory), so that no
    step can reuse an earlier finiteness check."""
    for group in opt.param_groups:
        for p in group["params"]:
            torch.autograd.graph.increment_version(p.grad)


def interleaved_best(fns: dict, rounds: int) -> dict:
    """The best time of each function over `rounds` rounds, one call of each
    per round in a rotating order, so that drift on a shared machine falls on
    every one alike."""
    names = list(fns)
    best = {name: float("inf") for name in names}
    for fn in fns.values():
        fn()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
