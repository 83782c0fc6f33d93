"""Weight sync from a model and optimizer on the GPU, over gloo: the sender's
device bytes are staged through host memory, and a receiver's model on the
GPU is loaded from host buffers. Bit-exact, with a checksum, at full
precision and cast to bf16 on the way."""
import pytest
import torch

import sync_device_workers as workers
from device_support import needs_real_gpu
from rlhfz.launch import run_ranks

pytestmark = needs_real_gpu


@pytest.mark.parametrize("case", ["plain", "one-tensor", "stage2", "stage3"])
def test_a_sync_from_gpu_memory_is_bit_exact(case, monkeypatch):
    monkeypatch.setenv("RLHFZ_RANK_START", "spawn")     # no CUDA state through a fork
    results = run_ranks(workers.sync_from_the_device, 2, case)
    sender, receiver = results[workers.SRC], results[workers.RECEIVER]
    assert sender["on_device"] == {"cuda"}
    expected = [sender["whole"]] * 2 + [{n: t.to(torch.bfloat16)
                                          for n, t in sender["whole"].items()}] * 2
    for want, got in zip(expected, receiver["got"], strict=True):
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), name
    total = sum(t.numel() * t.element_size() for t in sender["whole"].values())
    for report in sender["reports"][:2]:
        assert report["bytes"] == total
        assert report["copied_bytes"] >= total     # every byte staged through host memory
