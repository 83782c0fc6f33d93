"""A param's or grad's storage swapped behind the optimizer, on the CPU.

module._apply (model.half(), .float(), .to(dtype)) replaces param.data and,
where a grad exists, grad.data; `param.data = t` and
load_state_dict(..., assign=True) replace the storage too. Each case runs
torch.optim.AdamW through the same sequence and holds ZeroAdamW to it: the
optimizer adopts the new values (or refuses with an error that says what
to do), and never steps buckets that no param views any more. Device moves
are in tests/test_cuda_optim.py (they need a GPU).
"""
import copy

import pytest
import torch

import rlhfz


def _round_trip(model):
    model.half()
    model.float()


def _assign_data(model):
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def _load_assign(model):
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _bf16_round_trip(model):
    model.to(torch.bfloat16)
    model.to(torch.float32)


SWAPS = {"half-float": _round_trip, "param.data=": _assign_data,
         "load_state_dict(assign)": _load_assign, "to(bf16)-to(fp32)": _bf16_round_trip}


def _train(swap, *, stage=2, set_to_none=True, steps=6, swap_at=2, options=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    ref = copy.deepcopy(model)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, stage=stage,
                          **(options or {}))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == swap_at:
            swap(model)
            swap(ref)
        x = torch.randn(4, 16, generator=gen)
        for net, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=set_to_none)
            net(x).square().mean().backward()
            o.step()
        for name, (a, b) in enumerate(zip(model.parameters(), ref.parameters())):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, param {name}: {m}")
    return model, opt


@pytest.mark.parametrize("swap", SWAPS, ids=list(SWAPS))
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_swapped_storage_trains_as_torch_does(swap, stage):
    model, opt = _train(SWAPS[swap], stage=stage)
    buckets = opt.engine.buckets
    views = {p.data_ptr() for b in buckets for p in b.param_views}
    grads = {g.data_ptr() for b in buckets for g in b.grad_views}
    # the optimizer's params (load_state_dict(assign=True) gives the module new
    # Parameter objects, which neither torch's AdamW nor rlhfz's ever sees)
    for p in (p for group in opt.param_groups for p in group["params"]):
        assert p.data_ptr() in views       # back in the buckets, grads too
        assert p.grad is None or p.grad.data_ptr() in grads


@pytest.mark.parametrize("swap", ["half-float", "param.data="])
def test_a_swap_with_grads_kept_between_steps(swap):
    """zero_grad(set_to_none=False): the grads the cast moved are the ones
    zeroed, and the next backward accumulates into the bucket."""
    _train(SWAPS[swap], set_to_none=False)


def test_a_swap_with_part_of_the_state_on_the_host():
    _train(_round_trip, options=dict(offload="cpu", offload_ratio=0.5))


def test_a_swap_between_backward_and_step_keeps_the_grads():
    """A cast after backward carries the grads with it (module._apply casts
    .grad too): the step uses them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = copy.deepcopy(model)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(3, 8)
    for net in (model, ref):
        net(x).sum().backward()
    opt.step()
    ref_opt.step()
    for net in (model, ref):
        net.zero_grad(set_to_none=False)
        net(x).square().sum().backward()
        _assign_data(net)
    opt.step()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_cast_that_stays_is_refused_with_what_to_do():
    """model.half() alone: the buckets hold fp32, so the step refuses and
    says so; nothing has been stepped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    model.half()
    with pytest.raises(RuntimeError, match="cast to torch.float16.*build the optimizer after"):
        opt.step()
    for key, value in opt.state[model.weight].items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("stage", [0, 1])
def test_a_backward_after_a_cast_reaches_the_step_that_refuses_it(stage):
    """model.half() then a backward: autograd's half grads stay where it
    made them (the bucket holds fp32), and the step says what to do, not
    torch's complaint about a grad's dtype."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.half()
    model(torch.randn(2, 8).half()).float().sum().backward()
    assert model.weight.grad.dtype == torch.float16
    with pytest.raises(RuntimeError, match="cast to torch.float16.*build the optimizer after"):
        opt.step()


def _bf16_run(swap=None, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, offload="cpu", offload_ratio=0.5)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == 2 and swap is not None:
            swap(model)
        opt.zero_grad()
        model(torch.randn(4, 16, generator=gen).to(torch.bfloat16)).float().square().mean() \
            .backward()
        opt.step()
    return model, opt


def test_a_16_bit_round_trip_that_changes_no_value_keeps_the_fp32_master():
    """bf16 params through fp32 and back hold the same values: the fp32
    master keeps its precision, and training is bit for bit the run without
    the round trip (host part included)."""
    plain, plain_opt = _bf16_run()
    swapped, swapped_opt = _bf16_run(lambda m: (m.float(), m.to(torch.bfloat16)))
    for a, b in zip(plain.parameters(), swapped.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(plain_opt.state[a]["master_param"], swapped_opt.state[b]["master_param"])


def test_new_values_written_into_16_bit_params_become_the_master():
    """param.data = other values: the optimizer adopts them as its fp32
    master (the old master would step the old values)."""
    model, opt = _bf16_run(steps=2)
    with torch.no_grad():
        for p in model.parameters():
            p.data = torch.full_like(p, 0.5)
    opt.zero_grad()
    for p in model.parameters():
        assert torch.equal(opt.state[p]["master_param"], torch.full(p.shape, 0.5))


def test_a_refused_swap_takes_nothing_back():
    """One param given new values, another cast to fp16, in one bucket: the
    step refuses the cast before it adopts anything, so the bucket still
    holds what it held."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    (bucket,) = opt.engine.buckets
    held = [view.clone() for view in bucket.param_views]
    with torch.no_grad():
        model.weight.data = torch.zeros_like(model.weight)
        model.bias.data = model.bias.data.half()
    with pytest.raises(RuntimeError, match="cast to torch.float16"):
        opt.step()
    for view, before in zip(bucket.param_views, held):
        assert torch.equal(view, before)
    assert model.weight.data_ptr() != bucket.param_views[0].data_ptr()
