"""ZeroAdamW against torch.optim.AdamW: trained side by side, step for step."""
import copy

import pytest
import torch

import rlhfz


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(33, 65), torch.nn.LayerNorm(65), torch.nn.GELU(),
        torch.nn.Linear(65, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))


def _groups(model):
    """Three groups with their own lr and weight decay."""
    params = list(model.parameters())
    return [{"params": params[:2], "lr": 2e-3, "weight_decay": 0.1},
            {"params": params[2:4], "weight_decay": 0.0},
            {"params": params[4:], "lr": 5e-4, "betas": (0.8, 0.99), "eps": 1e-6}]


def _train(model, opt, steps, seed=1, sched=None, closure=False):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        y = torch.randn(16, 5, generator=gen)

        def compute():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if closure:
            loss = opt.step(compute)
        else:
            loss = compute()
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _assert_params_close(model_a, model_b, rtol=1e-5, atol=1e-7):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("maximize", [False, True])
def test_fp32_200_steps_with_groups_match_torch(maximize):
    ours, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW(_groups(ours), lr=1e-3, weight_decay=0.05, maximize=maximize)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3, weight_decay=0.05, maximize=maximize)
    losses = _train(ours, opt, 200)
    ref_losses = _train(ref, ref_opt, 200)
    _assert_params_close(ours, ref)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"],
                                   rtol=1e-5, atol=1e-8)
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == 200


def test_scheduler_and_closure_match_torch():
    ours, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW(ours.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=120)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=3e-3, total_steps=120)
    losses = _train(ours, opt, 120, sched=sched, closure=True)
    ref_losses = _train(ref, ref_opt, 120, sched=ref_sched, closure=True)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    _assert_params_close(ours, ref)


def test_params_without_grads_are_skipped_like_torch():
    """torch.optim.AdamW leaves a param with no grad alone (no decay, no step
    count); so must ZeroAdamW, even when the param sits mid-bucket."""
    ours, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    for step in range(30):
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            for i, p in enumerate(model.parameters()):
                # param 2 never gets a grad; param 4 gets one every third step
                if i == 2 or (i == 4 and step % 3):
                    continue
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(
                    step * 100 + i))
            o.step()
    _assert_params_close(ours, ref)
    params, ref_params = list(ours.parameters()), list(ref.parameters())
    assert params[2] not in opt.state and ref_params[2] not in ref_opt.state
    assert opt.state[params[4]]["step"].item() == ref_opt.state[ref_params[4]]["step"].item()
    del gen


def test_gradient_accumulation_over_micro_batches():
    ours, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW(ours.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        batches = [(torch.randn(8, 33, generator=gen), torch.randn(8, 5, generator=gen))
                   for _ in range(3)]
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            for x, y in batches:
                torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
    _assert_params_close(ours, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_with_fp32_master_match_fp32_reference(dtype):
    """Given the same (16-bit) grads, the fp32 master follows an fp32 AdamW,
    and each 16-bit param is that master rounded to nearest."""
    torch.manual_seed(0)
    shapes = [(37, 19), (19,), (5, 3, 7), (1,)]
    start = [torch.randn(s) for s in shapes]
    params = [torch.nn.Parameter(t.to(dtype)) for t in start]
    ref_params = [torch.nn.Parameter(t.to(dtype).float()) for t in start]
    opt = rlhfz.ZeroAdamW(params, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        for p, q in zip(params, ref_params):
            g = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad = g
            q.grad = g.float()
        opt.step()
        ref_opt.step()
    for p, q in zip(params, ref_params):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
        assert p.dtype == dtype
        # the 16-bit param is the master rounded to nearest even
        assert torch.equal(p.detach(), master.to(dtype))
        # hence within half a 16-bit ulp of the fp32 reference (plus the master's drift)
        ulp = torch.finfo(dtype).eps * q.detach().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((p.detach().float() - q.detach()).abs() <= ulp + 1e-5).all()


def test_mixed_dtypes_in_one_group_get_one_bucket_each():
    p32 = torch.nn.Parameter(torch.randn(10))
    p16 = torch.nn.Parameter(torch.randn(10).bfloat16())
    opt = rlhfz.ZeroAdamW([p32, p16], lr=1e-2)
    assert len(opt.engine.buckets) == 2
    p32.grad = torch.ones(10)
    p16.grad = torch.ones(10, dtype=torch.bfloat16)
    before32, before16 = p32.detach().clone(), p16.detach().clone()
    opt.step()
    assert (p32.detach() < before32).all()
    assert (p16.detach().float() < before16.float()).all()


def test_tied_parameters_are_one_param():
    emb = torch.nn.Embedding(11, 4)
    head = torch.nn.Linear(4, 11, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    ref = copy.deepcopy(model)
    opt = rlhfz.ZeroAdamW(model, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tokens = torch.tensor([[1, 2, 3, 4]])
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(10):
            o.zero_grad()
            m["head"](m["emb"](tokens)).logsumexp(-1).sum().backward()
            o.step()
    assert model["head"].weight is model["emb"].weight
    _assert_params_close(model, ref)
