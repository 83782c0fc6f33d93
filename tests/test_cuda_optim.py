"""ZeroAdamW with params on a CUDA device: buckets and state live there,
and training matches torch.optim.AdamW(fused=True) step for step.

fused AdamW contracts its arithmetic into FMAs and orders it differently,
so params agree to fp32 rounding (rtol 1e-5), not bit for bit. Runs on a GPU
and on the simulated CUDA runtime (tests/device_support.py), where the
reference is torch's fused AdamW on the CPU.
"""
import copy
import io

import pytest
import torch

import rlhfz
from rlhfz import _C
from rlhfz.engine import backends
from device_support import DEVICE, SIMULATED, needs_device, needs_real_gpu, on_device, params_on_device

pytestmark = [pytest.mark.gpu, needs_device]

KINDS = ("params", "grads", "master", "exp_avg", "exp_avg_sq")
STEPS = 200
CHECK_EVERY = 20


@pytest.fixture(autouse=True)
def _params_on_device(monkeypatch):
    with params_on_device(monkeypatch):
        yield


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    """TF32 matmuls would round inputs to 10 mantissa bits: two models a
    rounding apart would drift by far more than the optimizers differ."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


class Net(torch.nn.Module):
    """An MLP, plus small params of odd sizes (7 and 15 elements), so bucket
    slots end in odd tails and the kernel's tail paths run."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                        torch.nn.Linear(128, 32))
        self.shift = torch.nn.Parameter(0.1 * torch.randn(7))
        self.gain = torch.nn.Parameter(1 + 0.1 * torch.randn(3, 5))

    def forward(self, x):
        y = self.body(x)
        head = y[:, :7] + self.shift.to(y.dtype)
        mid = y[:, 7:22] * self.gain.reshape(15).to(y.dtype)
        return torch.cat([head, mid, y[:, 22:]], dim=1)


def _nets(seed=0, dtype=torch.float32):
    """Two identical nets on the device."""
    torch.manual_seed(seed)
    net = Net().to(device=DEVICE, dtype=dtype)
    return net, copy.deepcopy(net)


def _groups(net):
    """Two groups with their own lr and weight decay."""
    return [{"params": list(net.body.parameters()), "weight_decay": 0.05},
            {"params": [net.shift, net.gain], "lr": 3e-3, "weight_decay": 0.0}]


def _batch(gen, dtype=torch.float32):
    x = torch.randn(16, 64, generator=gen).to(DEVICE, dtype)
    y = torch.randn(16, 32, generator=gen).to(DEVICE, dtype)
    return x, y


def _train_step(net, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(net(x).float(), y.float())
    loss.backward()
    opt.step()
    return loss


def _assert_params_close(ours, ref, what, rtol=1e-5, atol=1e-6):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}, {name}: {m}")


def test_buckets_and_state_live_on_the_device():
    net = Net().to(DEVICE)
    half = torch.nn.Parameter(torch.randn(33, dtype=torch.bfloat16).to(DEVICE))
    params = list(net.parameters()) + [half]
    opt = rlhfz.ZeroAdamW(params, lr=1e-3)
    assert opt.placement() == {kind: "device" for kind in KINDS}
    report = opt.memory_report()
    for kind in KINDS:
        assert report[kind]["device"] > 0, kind
        assert report[kind]["host"] == report[kind]["pinned"] == 0, kind
    # fp32 params are their own master; only the bf16 bucket has a copy
    assert report["master"]["device"] < report["exp_avg"]["device"]
    assert all(on_device(p) for p in params)

    pointers = [p.data_ptr() for p in params]
    gen = torch.Generator().manual_seed(0)
    grad_pointers = None
    for _ in range(2):
        x, y = _batch(gen)
        opt.zero_grad(set_to_none=True)
        (torch.nn.functional.mse_loss(net(x), y) + half.float().square().sum()).backward()
        opt.step()
        # params are stepped in place, and grads land in the bucket every backward
        assert [p.data_ptr() for p in params] == pointers
        current = [p.grad.data_ptr() for p in params]
        assert grad_pointers in (None, current)
        grad_pointers = current
    for p in params:
        state = opt.state[p]
        assert on_device(state["exp_avg"]) and on_device(state["exp_avg_sq"])
    assert on_device(opt.state[half]["master_param"])
    assert opt.state[half]["master_param"].dtype == torch.float32


class _ScalarLowPrecisionStep:
    """rlhfz._C, but the CPU's low-precision step at the scalar level."""

    def __getattr__(self, name):
        return getattr(_C, name)

    def adamw_step_lowp(self, *args, **kwargs):
        return _C.adamw_step_lowp(*args, simd="scalar", **kwargs)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_low_precision_moments_step_on_the_device_as_on_the_cpu(state_dtype, monkeypatch):
    """The same grads, stepped by the CUDA kernels and by the CPU's scalar
    level (the reference's bits; the SIMD levels take estimates of roots and
    quotients): the same params and the same stored moments, bit for bit."""
    monkeypatch.setattr(backends, "_C", _ScalarLowPrecisionStep())
    net, _ = _nets()
    ref = copy.deepcopy(net).cpu()
    opt = rlhfz.ZeroAdamW(_groups(net), lr=1e-2, state_dtype=state_dtype, min_8bit_size=1000)
    if SIMULATED:
        monkeypatch.delenv("RLHFZ_SIM_DEVICE")
    ref_opt = rlhfz.ZeroAdamW(_groups(ref), lr=1e-2, state_dtype=state_dtype,
                              min_8bit_size=1000)
    assert all(b.backend.tier == "host" for b in ref_opt.engine.buckets)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        for p, q in zip(net.parameters(), ref.parameters()):
            grad = torch.randn(p.shape, generator=gen) * 1e-2
            p.grad, q.grad = grad.to(DEVICE), grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach())
        ours, theirs = opt.state[p], ref_opt.state[q]
        assert set(ours) == set(theirs)
        for name, value in ours.items():
            if name != "step":
                assert on_device(value), name
            assert torch.equal(value.cpu().view(torch.uint8) if value.dtype == torch.bfloat16
                               else value.cpu(), theirs[name].view(torch.uint8)
                               if value.dtype == torch.bfloat16 else theirs[name]), name
    assert opt.state[net.body[0].weight]["exp_avg"].dtype == (
        torch.int8 if state_dtype == "int8" else torch.bfloat16)


@needs_real_gpu
def test_params_on_two_devices_are_refused():
    with pytest.raises(ValueError, match="one device"):
        rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(4, device="cuda")),
                         torch.nn.Parameter(torch.ones(4))])


@pytest.mark.parametrize("maximize", [False, True])
def test_fp32_training_matches_torch_fused_adamw(maximize):
    ours, ref = _nets()
    opt = rlhfz.ZeroAdamW(_groups(ours), lr=1e-3, maximize=maximize)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3, maximize=maximize, fused=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        x, y = _batch(gen)
        loss = _train_step(ours, opt, x, y)
        ref_loss = _train_step(ref, ref_opt, x, y)
        if step % CHECK_EVERY == 0:
            _assert_params_close(ours, ref, f"step {step}")
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    for p, q in zip(ours.parameters(), ref.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            # the first moment can cancel to near zero: an absolute tolerance
            # on the tensor's scale, as the grads that feed it differ a little
            ref_state = ref_opt.state[q][name]
            torch.testing.assert_close(opt.state[p][name], ref_state, rtol=1e-5,
                                       atol=1e-5 * ref_state.abs().max().item())
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == STEPS


def test_bf16_params_follow_an_fp32_master_adamw():
    """The reference keeps fp32 masters and steps them with fused AdamW on
    the bf16 grads made fp32. Both optimizers get the grads of one backward
    (the rlhfz model's): a second bf16 model would compute grads that differ
    at bf16 resolution wherever one param rounded the other way, and that
    would compound, hiding what is compared here: the optimizer."""
    net, _ = _nets(dtype=torch.bfloat16)
    params = list(net.parameters())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = rlhfz.ZeroAdamW(params, lr=1e-3, weight_decay=0.05)
    ref_opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.05, fused=True)
    eps16 = torch.finfo(torch.bfloat16).eps
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        x, y = _batch(gen, torch.bfloat16)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x).float(), y.float()).backward()
        for p, master in zip(params, masters):
            master.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        if step % CHECK_EVERY and step != STEPS:
            continue
        for i, (p, master) in enumerate(zip(params, masters)):
            what = f"step {step}, param {i}"
            ours = opt.state[p]["master_param"]
            torch.testing.assert_close(ours, master.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: {m}")
            # the bf16 param is its master rounded to nearest even ...
            assert torch.equal(p.detach(), ours.to(torch.bfloat16)), what
            # ... so it is the reference master's rounding, or one bf16 ulp
            # away where the masters straddle a rounding boundary (near zero,
            # the masters' own difference can exceed a bf16 ulp there)
            mine = p.detach().float()
            ref16 = master.detach().to(torch.bfloat16).float()
            ulp = eps16 * torch.maximum(ref16.abs(), mine.abs())
            allowed = ulp + (ours - master.detach()).abs()
            assert bool(((mine - ref16).abs() <= allowed).all()), what


def test_clip_grad_norm_matches_torch():
    ours, ref = _nets()
    opt = rlhfz.ZeroAdamW(ours.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    x, y = _batch(torch.Generator().manual_seed(2))
    for net in (ours, ref):
        (100 * torch.nn.functional.mse_loss(net(x), y)).backward()
    norm = opt.clip_grad_norm_(1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    assert norm.device.type == DEVICE.type and ref_norm.item() > 1.0        # it did clip
    # rlhfz sums squares in float64, torch in float32
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-9,
                                   msg=lambda m: f"{name}: {m}")
    opt.step()
    ref_opt.step()
    _assert_params_close(ours, ref, "after clip and step")

    # under the max norm: the grads are left exactly as they are
    grads = [p.grad.clone() for p in ours.parameters()]
    opt.clip_grad_norm_(1e9)
    assert all(torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads))


def test_bf16_clip_reads_every_params_sum_from_the_device_at_once(monkeypatch):
    """torch rounds each bf16 grad's norm before the total: rlhfz sums each
    param on the device, and a host read per param would wait on the
    stream once per param, so the sums come back in one read."""
    ours, ref = _nets(dtype=torch.bfloat16)
    opt = rlhfz.ZeroAdamW(ours.parameters(), lr=1e-3)
    x, y = _batch(torch.Generator().manual_seed(4), torch.bfloat16)
    for net in (ours, ref):
        (100 * torch.nn.functional.mse_loss(net(x), y)).backward()
    reads = []
    fetch = _C.cuda_fetch
    monkeypatch.setattr(_C, "cuda_fetch", lambda *a, **k: reads.append(a[2]) or fetch(*a, **k))
    norm = opt.clip_grad_norm_(1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    monkeypatch.undo()
    assert ref_norm.item() > 1.0
    assert norm.item() == ref_norm.item()
    assert reads == [8 * len(list(ours.parameters()))], reads
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def _snapshot(opt, params):
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    return [p.detach().clone() for p in params], state


def _assert_unchanged(opt, params, snap):
    values, state = snap
    for p, before in zip(params, values):
        assert torch.equal(p.detach(), before)
    for p in params:
        for k, v in state[id(p)].items():
            assert torch.equal(opt.state[p][k], v), k


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_grad_changes_nothing(policy, dtype, bad):
    gen = torch.Generator().manual_seed(4)
    shapes = [(37, 19), (7,), (1000,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE, dtype)) for s in shapes]
    opt = rlhfz.ZeroAdamW(params, lr=1e-2, weight_decay=0.1, nonfinite=policy)

    def set_grads():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE, dtype)

    for _ in range(3):
        set_grads()
        opt.step()
    set_grads()
    params[1].grad[2] = bad
    snap = _snapshot(opt, params)
    if policy == "raise":
        with pytest.raises(rlhfz.NonFiniteGradError, match=r"\['params'\]\[1\]"):
            opt.step()
    else:
        opt.step()
        assert opt.skipped_steps == 1
    _assert_unchanged(opt, params, snap)
    # the next good step goes ahead from where the state was
    set_grads()
    opt.step()
    assert opt.state[params[0]]["step"].item() == 4


def _make(cls, net, lr):
    if cls is torch.optim.AdamW:
        return cls(net.parameters(), lr=lr, weight_decay=0.03, fused=True)
    return cls(net.parameters(), lr=lr, weight_decay=0.03)


@pytest.mark.parametrize("direction", ["rlhfz_to_torch", "torch_to_rlhfz"])
def test_state_dict_interchanges_with_torch_fused_adamw(direction):
    src_cls, dst_cls = ((rlhfz.ZeroAdamW, torch.optim.AdamW) if direction == "rlhfz_to_torch"
                        else (torch.optim.AdamW, rlhfz.ZeroAdamW))
    src_net, _ = _nets()
    src = _make(src_cls, src_net, 2e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(15):
        _train_step(src_net, src, *_batch(gen))
    # through bytes, as a checkpoint would go
    blob = io.BytesIO()
    torch.save({"model": src_net.state_dict(), "optim": src.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    dst_net, _ = _nets(seed=99)
    dst_net.load_state_dict(saved["model"])
    dst = _make(dst_cls, dst_net, 1.0)
    dst.load_state_dict(saved["optim"])
    assert dst.param_groups[0]["lr"] == 2e-3
    for p, q in zip(src_net.parameters(), dst_net.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            # (torch's optimizer on the simulator keeps its state on the host)
            assert on_device(dst.state[q][name]) or (SIMULATED and dst_cls is torch.optim.AdamW)
            assert torch.equal(dst.state[q][name], src.state[p][name]), name
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(15):
        _train_step(src_net, src, *_batch(gen_a))
        _train_step(dst_net, dst, *_batch(gen_b))
    _assert_params_close(src_net, dst_net, direction)
    for p, q in zip(src_net.parameters(), dst_net.parameters()):
        assert src.state[p]["step"].item() == dst.state[q]["step"].item() == 30


def test_bf16_state_dict_round_trips_master_weights():
    gen = torch.Generator().manual_seed(6)
    p = torch.nn.Parameter(torch.randn(4097, generator=gen).to(DEVICE, torch.bfloat16))
    opt = rlhfz.ZeroAdamW([p], lr=1e-3)
    p.grad = torch.randn(4097, generator=gen).to(DEVICE, torch.bfloat16)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    master = sd["state"][0]["master_param"]
    assert master.dtype == torch.float32 and master.device.type == DEVICE.type
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = rlhfz.ZeroAdamW([q], lr=1e-3)
    opt2.load_state_dict(sd)
    grad = torch.randn(4097, generator=gen).to(DEVICE, torch.bfloat16)
    for param, o in ((p, opt), (q, opt2)):
        param.grad = grad.clone()
        o.step()
    # one kernel, the same inputs: the same bits
    assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])
    assert torch.equal(p, q)


@needs_real_gpu
def test_step_runs_on_torchs_current_stream():
    """On a side stream, a step queued after a slow grad write sees the new
    grads: the finiteness check and the kernel run in that stream's order."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch")
    n = 1 << 20

    def make():
        p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
        opt = rlhfz.ZeroAdamW([p], lr=0.1, weight_decay=0.0)
        p.grad = torch.zeros(n, device="cuda")
        opt.step()                     # adopts the grad into the bucket
        return p, opt

    p, opt = make()
    expected, ref_opt = make()
    expected.grad.fill_(1.0)
    ref_opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)              # ~50 ms of queued work
        p.grad.fill_(1.0)
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(p.detach(), expected.detach())
    assert bool((p.detach() < 0).all())


@needs_real_gpu
@pytest.mark.parametrize("stage, options", [(0, {}), (2, {}), (1, {"offload": "cpu",
                                                                  "offload_ratio": 0.5})],
                         ids=["stage0", "stage2", "stage1-half-on-host"])
@pytest.mark.parametrize("move", ["to_cuda", "cuda", "cpu"])
@pytest.mark.parametrize("moved_at", [0, 2], ids=["before-the-first-step", "after-two-steps"])
def test_a_model_moved_after_the_optimizer_was_built_trains_as_with_torch(moved_at, move, stage,
                                                                          options):
    """The common order "build the optimizer, then model.to(device)" (and
    back with .cpu()): torch's AdamW trains on with the same param objects,
    and so does ZeroAdamW, its buckets and state following the params. After
    steps, torch's state stays behind (its step then fails on two devices)
    until load_state_dict(state_dict()) moves it to the params; ZeroAdamW's
    follows by itself."""
    torch.manual_seed(0)
    start = "cpu" if move != "cpu" else "cuda"
    net = Net().to(start)
    ref = copy.deepcopy(net)
    opt = rlhfz.ZeroAdamW(net.parameters(), lr=1e-2, weight_decay=0.01, stage=stage, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for step in range(moved_at + 4):
        if step == moved_at:
            for model in (net, ref):
                {"to_cuda": lambda m: m.to("cuda"), "cuda": lambda m: m.cuda(),
                 "cpu": lambda m: m.cpu()}[move](model)
            if ref_opt.state:
                ref_opt.load_state_dict(ref_opt.state_dict())   # torch: state to the params
        device = start if step < moved_at else ("cpu" if move == "cpu" else "cuda")
        x, y = (t.to(device) for t in _batch(gen))
        _train_step(ref, ref_opt, x, y)
        _train_step(net, opt, x, y)
        _assert_params_close(net, ref, f"step {step}")
    assert {p.device.type for p in net.parameters()} == {device}
    assert opt.device.type == device
    # the state lives where the params went; nothing stays on the device after .cpu()
    assert (opt.memory_report()["exp_avg"]["device"] > 0) == (device == "cuda")
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p]["exp_avg"].to(device), ref_opt.state[q]["exp_avg"],
                                   rtol=1e-5, atol=1e-7)
