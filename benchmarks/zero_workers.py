"""Per-rank bodies of the gloo benchmark (importable by spawned ranks)."""
import statistics
import time

import torch

BATCH = 32
DIM = 512
LAYERS = 6


def make_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM)]
    return torch.nn.Sequential(*layers)


def _state_bytes(optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def run(rank, world_size, impl, steps, warmup):
    import rlhfz
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.set_num_threads(1)
    baseline = _rss_bytes()
    model = make_model()
    if impl.startswith("torch_zero"):
        # DDP's default copies grads into its own buckets; with
        # gradient_as_bucket_view the grads are views of them (one copy).
        bucket_view = impl == "torch_zero_bucket_view"
        trained = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=bucket_view)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-4)
    else:
        trained = model
        opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-4, stage=1 if impl == "rlhfz_stage1" else 2)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, DIM, generator=gen)
    iters, steps_s = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        trained(x).pow(2).mean().backward()
        mid = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        if i >= warmup:
            iters.append(end - start)
            steps_s.append(end - mid)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if impl.startswith("torch_zero"):
        # ZeRO shards the states; DDP's buckets hold every grad, and p.grad
        # is a second copy unless it is a view of them.
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                    if p.grad is not None)
        if not bucket_view:
            grads *= 2
        memory = {"params": params, "grads": grads, "optimizer_state": _state_bytes(opt.optim)}
    else:
        report = opt.memory_report()
        memory = {"params": report["params"]["host"], "grads": report["grads"]["host"],
                  "optimizer_state": sum(report[k]["host"] for k in
                                         ("master", "exp_avg", "exp_avg_sq"))}
    return {"iter_median_s": statistics.median(iters), "step_median_s": statistics.median(steps_s),
            "memory": memory, "numel": sum(p.numel() for p in model.parameters()),
            # everything the run added to the process, DDP's grad buckets included
            "rss_growth": _rss_bytes() - baseline}
