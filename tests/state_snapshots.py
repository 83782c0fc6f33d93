"""Helpers the offload tests share: copies of a model's and an optimizer's
tensors, and this process's resident memory."""
import torch


def resident_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def snapshot(model, opt=None) -> dict:
    """Copies of every param, grad, optimizer state tensor and buffer, by name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        if p.grad is not None:
            out[name + ".grad"] = p.grad.clone()
        if opt is not None:
            for key, value in opt.state.get(p, {}).items():
                out[f"{name}.{key}"] = value.clone()
    for name, b in model.named_buffers():
        out[name] = b.clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].cpu(), b[key].cpu()), key
