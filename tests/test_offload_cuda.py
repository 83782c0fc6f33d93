"""Offload and reload of a CUDA optimizer: device memory really goes back.

Device to pinned and to pageable host memory and back, bitwise; after
offload the driver's free memory rises by at least 99% of the bytes the
optimizer owned on the device, with no empty_cache; training through
offload/reload cycles is bitwise the training without. Runs on a GPU and on
the simulated CUDA runtime (tests/device_support.py), whose count of free
device memory is exact, and where injected runtime failures check that a
failed move leaves everything where it was.
"""
import gc
import os
import threading

import pytest
import torch

import rlhfz
from device_support import (DEVICE, SIMULATED, mem_get_info, needs_device, needs_real_gpu,
                            needs_simulator, on_device, params_on_device, synchronize)
from rlhfz import _C
from state_snapshots import assert_same, snapshot

pytestmark = [pytest.mark.gpu, needs_device]


@pytest.fixture(autouse=True)
def _params_on_device(monkeypatch):
    with params_on_device(monkeypatch):
        yield


def make(dtype=torch.float32, width=1024, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 17)).to(DEVICE, dtype)
    return model, rlhfz.ZeroAdamW(model.parameters(), lr=1e-3, **options)


def train_step(model, opt, step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, model[0].in_features, generator=gen).to(DEVICE, model[0].weight.dtype)
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
    assert on_device(weight)
    assert_same(before, snapshot(model, opt))
    train_step(model, opt, 1)


def test_offload_gives_device_memory_back_to_the_driver():
    model, opt = make(width=4096)          # ~200 MB of optimizer-owned device memory
    train_step(model, opt, 0)
    synchronize()
    owned = sum(per_tier["device"] for per_tier in opt.memory_report().values())
    free_before, _ = mem_get_info()
    torch_free_before = torch.cuda.mem_get_info()[0] if not SIMULATED else None
    opt.offload()
    free_after, _ = mem_get_info()
    assert free_after - free_before >= 0.99 * owned, (free_before, free_after, owned)
    if not SIMULATED:       # torch asks the same driver: it sees the bytes back too
        gained = torch.cuda.mem_get_info()[0] - torch_free_before
        assert gained >= 0.99 * owned, (gained, owned)
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
        if len(calls) >= 3:       # also when reload tries again after emptying torch's cache
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


@needs_simulator
@pytest.mark.parametrize("calls, raises", [
    ("cudaMalloc:3,cudaMalloc:5", MemoryError),    # and again when reload tries once more
    ("cudaMalloc:3", None),                        # the second try goes through
    ("cudaMemcpyAsync:2", RuntimeError),
])
def test_a_runtime_failure_mid_reload_loses_nothing(calls, raises):
    """The simulated runtime fails calls of a reload (allocations, a copy):
    the reload raises, everything stays on the host as it was, and a second
    reload brings it all back. An allocation that fails once is tried again."""
    model, opt = make(torch.bfloat16)
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    opt.offload()
    _C.cuda_sim_inject(calls)
    try:
        if raises is None:
            opt.reload()
        else:
            with pytest.raises(raises):
                opt.reload()
            assert opt.placement()["params"] in ("pinned", "host")
        assert_same(before, snapshot(model, opt))
    finally:
        _C.cuda_sim_inject("")
    opt.reload()
    assert set(opt.placement().values()) == {"device"}
    assert_same(before, snapshot(model, opt))
    train_step(model, opt, 1)


@needs_simulator
def test_a_failed_step_kernel_changes_nothing():
    """An injected launch failure of the step's kernel raises, and the
    params and state are those of the last good step."""
    model, opt = make(torch.bfloat16)
    launched = _C.cuda_sim_calls("kernel launch")
    train_step(model, opt, 0)
    per_step = _C.cuda_sim_calls("kernel launch") - launched    # the step's kernel is the last
    before = snapshot(model, opt)
    _C.cuda_sim_inject(f"kernel launch:{per_step}")
    try:
        with pytest.raises(RuntimeError, match="cuda_adamw_step"):
            train_step(model, opt, 1)
    finally:
        _C.cuda_sim_inject("")
    after = snapshot(model, opt)
    for key in before:
        if "grad" not in key:
            assert torch.equal(before[key], after[key]), key


@needs_simulator
def test_offload_cycles_reuse_the_pinned_memory():
    """A sleep/wake loop pins once: reload keeps the pinned buffers for the
    next offload (pinning and unpinning every cycle costs seconds per 10 GB,
    and unpinning synchronizes the device); release_pinned gives them back."""
    model, opt = make(torch.bfloat16, pin_memory=True)
    train_step(model, opt, 0)
    rlhfz.release_pinned()
    counts = None
    for cycle in range(4):
        opt.offload()
        assert opt.placement()["exp_avg"] == "pinned"
        opt.reload()
        train_step(model, opt, cycle + 1)
        if counts is None:       # the first cycle pins
            counts = (_C.cuda_sim_calls("cudaHostAlloc"), _C.cuda_sim_calls("cudaFreeHost"))
    assert (_C.cuda_sim_calls("cudaHostAlloc"), _C.cuda_sim_calls("cudaFreeHost")) == counts
    rlhfz.release_pinned()
    assert _C.cuda_sim_calls("cudaFreeHost") > counts[1]


@needs_simulator
def test_a_non_blocking_offload_returns_with_its_copies_in_flight():
    """The copies run on rlhfz's copy stream (held here, so they stay in
    flight): offload(non_blocking=True) returns without waiting for them,
    which it could not if it freed the device memory they read (cudaFree
    synchronizes the device): that memory is freed behind their event. What
    comes next waits for them: the reload's copies queue behind, and a step
    or state dict first settles them. Nothing is lost."""
    model, opt = make(torch.bfloat16)
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    owned = sum(per_tier["device"] for per_tier in opt.memory_report().values())
    free_before, _ = mem_get_info()
    # While the stream is held, any cudaFree (which synchronizes the device)
    # would wait for it forever: garbage of earlier tests holding device
    # memory must not be collected in that window.
    gc.collect()
    gc.disable()
    token = _C.cuda_sim_hold(opt.backend.copy_stream())
    returned = threading.Event()
    mover = threading.Thread(target=lambda: (opt.offload(non_blocking=True), returned.set()))
    mover.start()
    try:
        assert returned.wait(20), "offload(non_blocking=True) waited for its copies"
        assert opt.placement()["params"] == "pinned"
        assert mem_get_info()[0] < free_before + owned     # still held: the copies read it
    finally:
        _C.cuda_sim_release(token)
        gc.enable()
        mover.join()
    opt.synchronize()
    assert mem_get_info()[0] >= free_before + owned
    assert_same(before, snapshot(model, opt))
    opt.reload(non_blocking=True)
    assert_same(before, snapshot(model, opt))          # the reads wait for the copies
    train_step(model, opt, 1)


def test_a_forward_right_after_a_non_blocking_round_trip_reads_the_reloaded_params():
    """Nothing waits on the host between reload(non_blocking=True) and the
    next forward: torch's stream waits for the copies instead, so the
    forward reads what they wrote, however late they run (the simulator's
    RLHFZ_SIM_CHAOS delays them at random)."""
    model, opt = make()
    train_step(model, opt, 0)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        expected = model(x).clone()
    for _ in range(10):
        opt.offload(non_blocking=True)
        opt.reload(non_blocking=True)
        with torch.no_grad():
            assert torch.equal(model(x), expected)


@needs_real_gpu
def test_offload_and_reload_give_back_what_torchs_cache_holds():
    """Device memory torch's caching allocator keeps (freed activations,
    gathers) is free to the driver only after empty_cache: offload hands it
    back too, and a reload that finds the device full of it empties the
    cache and tries once more instead of failing. (The simulator has no
    caching allocator, so this runs on a GPU only.)"""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        pytest.skip("torch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1)")
    model, opt = make(width=2048)
    train_step(model, opt, 0)
    owned = sum(per_tier["device"] for per_tier in opt.memory_report().values())
    cached = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del cached
    reserved = torch.cuda.memory_reserved()
    opt.offload()
    assert torch.cuda.memory_reserved() < reserved
    free, _ = mem_get_info()
    hog = torch.empty(free - owned // 2, dtype=torch.uint8, device="cuda")
    del hog            # back in torch's cache, not the driver's: less than `owned` is free
    assert mem_get_info()[0] < owned
    opt.reload()
    assert set(opt.placement().values()) == {"device"}
    train_step(model, opt, 1)


@needs_real_gpu
def test_the_host_parts_staging_is_fenced_by_an_event_not_its_stream():
    """offload="cpu": the host part's new params go to the device by an
    asynchronous copy from a pinned staging buffer. A step on another stream
    must not rewrite that buffer before the copy has read it: the copy's
    stream (held up here by a sleep queued just before it) says nothing to a
    step that syncs only its own."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch")
    n = 1 << 16

    def make_one():
        p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
        return p, rlhfz.ZeroAdamW([p], lr=0.1, weight_decay=0.0, offload="cpu",
                                  offload_ratio=1.0)

    p, opt = make_one()
    ref, ref_opt = make_one()
    ref.grad = torch.ones(n, device="cuda")
    ref_opt.step()
    expected_first = ref.detach().clone()

    host = opt.engine._host
    real_step = host.adamw_step

    def sleep_first(*args, **kwargs):
        torch.cuda._sleep(200_000_000)      # on the step's stream: the copy after waits
        real_step(*args, **kwargs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        p.grad = torch.ones(n, device="cuda")
        host.adamw_step = sleep_first
        opt.step()
        host.adamw_step = real_step
        first = p.detach().clone()          # queued behind the copy
    p.grad = -torch.ones(n, device="cuda")  # on the default stream, at once
    opt.step()
    torch.cuda.synchronize()
    assert torch.equal(first, expected_first)


STICKY_RELOAD = """
import json, torch, rlhfz
from rlhfz import _C
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 7))
opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 256)).square().mean().backward()
opt.step()
opt.offload()
host = {k: v.detach().clone() for k, v in opt.state[model[0].weight].items()}
weight = model[0].weight.detach().clone()
_C.cuda_sim_inject("cudaMemcpyAsync:2:cudaErrorLaunchFailure")
out = {}
for attempt in ("first", "again"):
    try:
        opt.reload()
        out[attempt] = "reloaded"
    except RuntimeError as error:
        out[attempt] = str(error)
out["placement"] = opt.placement()["exp_avg"]
out["state_kept"] = all(torch.equal(host[k], v) for k, v in opt.state[model[0].weight].items())
out["weight_kept"] = torch.equal(model[0].weight, weight)
print(json.dumps(out))
"""


@needs_simulator
def test_a_failure_that_loses_the_device_mid_reload_keeps_the_state_on_the_host():
    """A GPU cannot recover from a launch failure or an illegal address (the
    simulator makes them sticky, as a GPU does): the reload raises, every
    later one too, and the state stays on the host, bit for bit, for a
    checkpoint from there or a new process."""
    import json
    import subprocess
    import sys
    env = dict(os.environ, RLHFZ_SIM_DEVICE="0")
    child = subprocess.run([sys.executable, "-c", STICKY_RELOAD], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert "unspecified launch failure" in out["first"], out
    assert "unspecified launch failure" in out["again"], out
    assert out["placement"] in ("pinned", "host") and out["state_kept"] and out["weight_kept"]
