"""Offload and reload of a CUDA optimizer: device memory really goes back.

Device to pinned and to pageable host memory and back, bitwise; after
offload the driver's free memory rises by at least 99% of the bytes the
optimizer owned on the device, with no empty_cache; training through
offload/reload cycles is bitwise the training without. Skipped without a GPU.
"""
import pytest
import torch

import rlhfz
from rlhfz import _C
from state_snapshots import assert_same, snapshot

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")]


def make(dtype=torch.float32, width=1024, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 17)).to("cuda", dtype)
    return model, rlhfz.ZeroAdamW(model.parameters(), lr=1e-3, **options)


def train_step(model, opt, step):
    gen = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(32, model[0].in_features, device="cuda", generator=gen,
                    dtype=model[0].weight.dtype)
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


@pytest.mark.parametrize("pin_memory, tier", [(True, "pinned"), (False, "host")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_to_host_and_back_is_exact(pin_memory, tier, dtype):
    model, opt = make(dtype, pin_memory=pin_memory)
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    weight, state = model[0].weight, opt.state[model[0].weight]["exp_avg"]
    opt.offload()
    assert opt.placement()["exp_avg"] == tier and opt.placement()["params"] == tier
    assert weight.device.type == "cpu" and state.device.type == "cpu"
    assert_same(before, snapshot(model, opt))
    opt.reload()
    assert set(opt.placement().values()) == {"device"}
    assert weight is model[0].weight and state is opt.state[weight]["exp_avg"]
    assert weight.device.type == "cuda"
    assert_same(before, snapshot(model, opt))
    train_step(model, opt, 1)


def test_offload_gives_device_memory_back_to_the_driver():
    model, opt = make(width=4096)          # ~200 MB of optimizer-owned device memory
    train_step(model, opt, 0)
    torch.cuda.synchronize()
    owned = sum(per_tier["device"] for per_tier in opt.memory_report().values())
    free_before, _ = _C.cuda_mem_get_info(torch.cuda.current_device())
    opt.offload()
    free_after, _ = _C.cuda_mem_get_info(torch.cuda.current_device())
    assert free_after - free_before >= 0.99 * owned, (free_before, free_after, owned)
    opt.reload()
    train_step(model, opt, 1)


@pytest.mark.parametrize("stage", [0, 2])
def test_training_through_cycles_is_bitwise_the_same(stage):
    plain, plain_opt = make(torch.bfloat16, width=256, stage=stage)
    cycled, cycled_opt = make(torch.bfloat16, width=256, stage=stage)
    for step in range(10):
        train_step(plain, plain_opt, step)
        train_step(cycled, cycled_opt, step)
        with rlhfz.offloaded(cycled, cycled_opt):
            pass
    assert_same(snapshot(plain, plain_opt), snapshot(cycled, cycled_opt))


def test_a_failed_reload_leaves_the_state_on_the_host(monkeypatch):
    model, opt = make()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    opt.offload()
    calls = []
    real = opt.backend.buffer

    def out_of_memory(nbytes, **kwargs):
        calls.append(nbytes)
        if len(calls) == 3:
            raise MemoryError("simulated device OOM")
        return real(nbytes, **kwargs)
    monkeypatch.setattr(opt.backend, "buffer", out_of_memory)
    with pytest.raises(MemoryError, match="simulated device OOM"):
        opt.reload()
    assert opt.placement()["params"] in ("pinned", "host")
    assert_same(before, snapshot(model, opt))
    monkeypatch.undo()
    opt.reload()
    assert_same(before, snapshot(model, opt))


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_host_resident_state_matches_device_training(ratio, dtype):
    """offload="cpu": the last `ratio` of each shard steps on the CPU kernel,
    the rest on the GPU; within 1e-6 relative of training all on the GPU."""
    plain, plain_opt = make(dtype, width=256)
    hosted, hosted_opt = make(dtype, width=256, offload="cpu", offload_ratio=ratio)
    for step in range(20):
        train_step(plain, plain_opt, step)
        train_step(hosted, hosted_opt, step)
    placement = hosted_opt.memory_report()["exp_avg"]
    assert (placement["pinned"] + placement["host"] > 0) == (ratio > 0)
    assert (placement["device"] > 0) == (ratio < 1)
    a, b = snapshot(plain, plain_opt), snapshot(hosted, hosted_opt)
    for key in a:
        torch.testing.assert_close(b[key].cpu().float(), a[key].cpu().float(), rtol=1e-6,
                                   atol=1e-6 * a[key].abs().max().item(), msg=key)
