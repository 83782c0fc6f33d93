"""Per-rank bodies of the weight-sync benchmark (importable by spawned ranks).

Ranks 0 and 1 train a GPT-2 at stage 3 (or 2); ranks 2 and 3 hold plain copies
(or, with one trainer, rank 0 trains and rank 1 receives: a core for each
on a 2-core machine). The sync group holds rank 0 (src) and the receivers. Three ways to move the
same weights, in interleaved rounds:
- raw: one broadcast of a flat buffer of the same bytes (the floor);
- rlhfz: sync_weights / receive_weights (gathers, manifest, buckets);
- per_param: OpenRLHF's way, unit by unit gathered and one broadcast per param;
- gather_then_raw (stage 3): the trainers' raw all-gather of the model's
  bytes, then the raw broadcast;
- gather_onto_src_then_raw (stage 3): the other trainer's half sent to src
  (point to point, in 4 MiB pieces), then the raw broadcast: what rlhfz's
  stage-3 sync moves on gloo, with no overlap.
At stage 2 the trainers hold whole params: no gathers, rlhfz's own cost.
Each round starts at a barrier of all four ranks and ends when the last
rank is done; the sender's peak resident memory above its start is read
from /proc (VmHWM, reset before each round).
"""
import statistics
import time

import torch
import torch.distributed as dist

SRC = 0


def roles(world_size: int, trainers: int) -> tuple[list[int], list[int]]:
    """(the trainers' ranks, the receivers')."""
    return list(range(trainers)), list(range(trainers, world_size))


def model_config(size: str):
    import transformers
    transformers.logging.set_verbosity_error()
    dims = {"small": (256, 4, 4096), "medium": (512, 8, 8192)}[size]
    return transformers.GPT2Config(n_embd=dims[0], n_layer=dims[1], n_head=8,
                                   vocab_size=dims[2], n_positions=128)


def _build(size: str, seed: int):
    import transformers
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(model_config(size))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run(rank, world_size, size, rounds, bucket_bytes, stage=3, trainers=2):
    import rlhfz
    trainer_ranks, receiver_ranks = roles(world_size, trainers)
    train = dist.new_group(trainer_ranks)
    sync = dist.new_group([SRC] + receiver_ranks)
    trainer = rank in trainer_ranks
    model = _build(size, 0 if trainer else rank)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if trainer:
        rlhfz.ZeroAdamW(model, stage=stage, process_group=train)
        model.eval()
    group = sync if rank == SRC or not trainer else None
    # the per-param order: the sender's names, once, outside the timing
    names = [n for n, _ in rlhfz.iter_full_params(model, 1)] if trainer else None
    box = [names]
    if rank == SRC or not trainer:
        dist.broadcast_object_list(box, src=SRC, group=sync)
    names = box[0]
    flat = torch.empty(total, dtype=torch.uint8)
    params = dict(model.named_parameters()) if not trainer else {}

    def raw():
        if group is not None:
            dist.broadcast(flat, src=SRC, group=sync)

    def rlhfz_sync():
        if trainer:
            rlhfz.sync_weights(model, group, src=SRC, bucket_bytes=bucket_bytes)
        else:
            rlhfz.receive_weights(model, sync, src=SRC)

    def per_param():
        if trainer:
            for _, t in rlhfz.iter_full_params(model, 1):
                if rank == SRC:
                    dist.broadcast(t, src=SRC, group=sync)
        else:
            with torch.no_grad():
                for name in names:
                    dist.broadcast(params[name].data, src=SRC, group=sync)

    half = torch.empty(total // len(trainer_ranks), dtype=torch.uint8) if trainer else None

    def gather_then_raw():
        """What a stage-3 sync moves, raw and one after the other: the
        trainers' all-gather of the model's bytes, then the broadcast."""
        if trainer:
            dist.all_gather_into_tensor(flat[:half.numel() * len(trainer_ranks)], half, group=train)
        raw()

    def gather_onto_src_then_raw():
        if trainer:
            step, other = 4 << 20, [r for r in trainer_ranks if r != SRC][0]
            pieces = range(0, half.numel(), step)
            if rank == SRC:
                into = flat[half.numel():]
                works = [dist.irecv(into[i:i + step], src=other, group=train) for i in pieces]
            else:
                works = [dist.isend(half[i:i + step], dst=SRC, group=train) for i in pieces]
            for work in works:
                work.wait()
        raw()

    ways = {"raw": raw, "rlhfz": rlhfz_sync, "per_param": per_param}
    if stage == 3:
        ways["gather_then_raw"] = gather_then_raw
        ways["gather_onto_src_then_raw"] = gather_onto_src_then_raw
    times = {name: [] for name in ways}
    peaks = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            dist.barrier()
            base = _status("VmRSS")
            _reset_peak()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            peaks[name].append(max(0, _status("VmHWM") - base))
            everyone = [None] * world_size
            dist.all_gather_object(everyone, elapsed)
            times[name].append(max(everyone))
    # the weights as the receivers hold them after a sync, to check bit for bit
    rlhfz_sync()
    weights = ({n: t.clone() for n, t in rlhfz.iter_full_params(model)} if trainer else
               {n: p.detach().clone() for n, p in model.named_parameters()})
    return {"bytes": total, "times": times, "median_s": {n: statistics.median(v)
                                                         for n, v in times.items()},
            "peak_extra": {n: max(v) for n, v in peaks.items()},
            "params": len(names), "weights": weights if rank in (SRC, *receiver_ranks) else None}
