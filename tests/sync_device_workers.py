"""Per-rank bodies of the weight-sync tests from GPU memory (importable by
spawned ranks). One GPU, so two ranks on it over gloo: rank 0 trains on the
GPU in a group of its own and sends, its bytes staged through host memory
on the way; rank 1 receives into a model on the GPU, then into one on the
CPU. NCCL would need a GPU for each rank."""
import torch
import torch.distributed as dist

import rlhfz
from stage3_workers import batches, lm_loss, tiny_lm
from sync_workers import laid_back_to_front

SRC, RECEIVER = 0, 1


def _host_copy(named):
    return {name: t.detach().to("cpu", copy=True) for name, t in named}


def _sender(case, train):
    """(the model to send, its optimizer or None) for a case, on the GPU."""
    if case == "plain":
        return tiny_lm("gpt2").cuda(), None
    if case == "one-tensor":         # every param in one device tensor: sent as it lies
        return laid_back_to_front(tiny_lm("gpt2")).cuda(), None
    stage = {"stage2": 2, "stage3": 3}[case]
    model = tiny_lm("gpt2").cuda()
    extra = {"param_persistence_threshold": 64} if stage == 3 else {}
    opt = rlhfz.ZeroAdamW(model, stage=stage, lr=1e-2, process_group=train, **extra)
    for ids in batches(2):
        opt.zero_grad()
        lm_loss(model, ids.cuda()).backward()
        opt.step()
    return model, opt


def sync_from_the_device(rank, world_size, case):
    torch.cuda.set_device(0)
    sync = dist.new_group([SRC, RECEIVER])
    train = dist.new_group([SRC])            # every rank makes every group, as torch asks
    if rank == RECEIVER:
        got = []
        for dtype in (torch.float32, torch.bfloat16):
            for device in ("cuda", "cpu"):
                receiver = tiny_lm("gpt2", seed=5).to(device=device, dtype=dtype)
                rlhfz.receive_weights(receiver, sync, src=SRC)
                got.append(_host_copy(receiver.named_parameters()))
        return {"got": got}
    model, opt = _sender(case, train)
    if opt is not None and opt.stage3 is not None:
        whole = _host_copy(rlhfz.iter_full_params(model, 1 << 14))
    else:
        whole = _host_copy(model.named_parameters())
    reports = []
    for dtype in (None, torch.bfloat16):
        for _ in ("cuda", "cpu"):
            reports.append(rlhfz.sync_weights(model, sync, src=SRC, bucket_bytes=1 << 13,
                                              dtype=dtype, checksum=True))
    on_device = {t.device.type for t in model.parameters()}
    return {"whole": whole, "reports": reports, "on_device": on_device}
