"""ZeroAccelerator against accelerate's own Accelerator with torch.optim.AdamW:
clipping through the accelerator, and save_state / save_model / load_state."""
import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import rlhfz  # noqa: E402
from rlhfz.integrations.accelerate import ZeroAccelerator  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.frozen(torch.relu(self.hidden(self.embed(ids)))))


def _backward(model, seed=1):
    ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(seed))
    (model(ids) * 3).pow(2).mean().backward()


def _prepared(kind):
    torch.manual_seed(0)
    model = Tied()
    if kind == "zero":
        acc, opt = ZeroAccelerator(cpu=True), rlhfz.ZeroAdamW(model, lr=1e-2)
    else:
        acc = accelerate.Accelerator(cpu=True)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def test_clipping_the_models_params_is_torchs_clip():
    norms, params = {}, {}
    for kind in ("torch", "zero"):
        acc, model, opt = _prepared(kind)
        for seed in range(3):
            _backward(model, seed)
            norms.setdefault(kind, []).append(float(acc.clip_grad_norm_(model.parameters(), 0.1)))
            opt.step()
            opt.zero_grad()
        params[kind] = [p.detach().clone() for p in model.parameters()]
    assert norms["zero"] == pytest.approx(norms["torch"], rel=1e-6)
    for got, want in zip(params["zero"], params["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_clipping_part_of_an_optimizers_params_is_torchs_clip_of_that_part():
    norms, grads = {}, {}
    for kind in ("zero", "torch"):
        acc, model, opt = _prepared(kind)
        _backward(model)
        norms[kind] = float(acc.clip_grad_norm_(model.hidden.parameters(), 0.1))
        zero = getattr(opt, "optimizer", None)
        if isinstance(zero, rlhfz.ZeroAdamW):
            # the unclipped part keeps its norm: only the part was scaled
            grads[kind] = float(zero.clip_grad_norm_(float("inf"), params=model.embed.parameters()))
        else:
            grads[kind] = float(torch.nn.utils.clip_grad_norm_(model.embed.parameters(),
                                                               float("inf")))
    assert norms["zero"] == pytest.approx(norms["torch"], rel=1e-6) and norms["torch"] > 0.1
    assert grads["zero"] == pytest.approx(grads["torch"], rel=1e-6)


def test_clipping_two_optimizers_params_together_is_torchs_clip():
    norms, params = {}, {}
    for kind, make in (("zero", rlhfz.ZeroAdamW), ("torch", torch.optim.AdamW)):
        torch.manual_seed(0)
        model = Tied()
        acc = ZeroAccelerator(cpu=True) if kind == "zero" else accelerate.Accelerator(cpu=True)
        first = make(list(model.hidden.parameters()), lr=1e-2)
        second = make(list(model.embed.parameters()), lr=1e-2)
        model, first, second = acc.prepare(model, first, second)
        _backward(model)
        norms[kind] = float(acc.clip_grad_norm_(model.parameters(), 0.1))
        first.step()
        second.step()
        params[kind] = [p.detach().clone() for p in model.parameters()]
    assert norms["zero"] == pytest.approx(norms["torch"], rel=1e-6) and norms["torch"] > 0.1
    for got, want in zip(params["zero"], params["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_save_state_and_save_model_keep_every_weight(tmp_path):
    from safetensors.torch import load_file
    acc, model, opt = _prepared("zero")
    _backward(model)
    opt.step()
    opt.zero_grad()
    expected = {n: t.clone() for n, t in model.state_dict().items()}
    acc.save_state(str(tmp_path / "state"))
    saved = load_file(str(tmp_path / "state" / "model.safetensors"))
    # the tied weight once, as accelerate saves a plain model's
    assert set(saved) == set(expected) - {"out.weight"}
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    acc.save_model(model, str(tmp_path / "model"))
    assert set(load_file(str(tmp_path / "model" / "model.safetensors"))) == set(saved)

    state = {k: v.clone() if torch.is_tensor(v) else v
             for k, v in opt.state_dict()["state"][0].items()}
    _backward(model, seed=2)
    opt.step()
    opt.zero_grad()
    acc.load_state(str(tmp_path / "state"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert model.out.weight is model.embed.weight
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[key])), key
