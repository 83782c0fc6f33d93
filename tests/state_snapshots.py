"""Helpers the offload tests share: copies of a model's and an optimizer's
tensors, and this process's resident memory."""
import torch


def status_kib(key: str) -> int:
    """A memory figure of this process from /proc/self/status, e.g. "VmRSS:"."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/self/status")


def resident_kib() -> int:
    return status_kib("VmRSS:")


def peak_kib_during(fn):
    """fn's peak resident memory (KiB) and how it was measured: the kernel's
    high-water mark reset just before, else a thread sampling VmRSS."""
    import threading
    import time
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = status_kib("VmHWM:") <= status_kib("VmRSS:") + 1024
    except OSError:
        reset = False
    if reset:
        fn()
        return status_kib("VmHWM:"), "VmHWM"
    peak, done = [status_kib("VmRSS:")], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], status_kib("VmRSS:"))
            time.sleep(0.001)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], status_kib("VmRSS:")), "VmRSS sampled every 1 ms"


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
