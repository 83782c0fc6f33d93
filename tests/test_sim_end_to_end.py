"""The optimizer on the simulated device, end to end, against the same run on
the CPU: training at stages 0 to 3 on 1 to 3 gloo ranks (the stage-2
reduce-scatter overlapping backward; two micro-batches and a clip per step),
offload to pinned memory and to disk
and back, partial host-resident state, gather-for-generation in all three
modes, and a checkpoint saved and resumed. The CUDA kernels compiled for the
host compute what the CPU's SIMD kernels do, so every param must match bit
for bit."""
import pytest
import torch

import sim_workers as workers
from device_support import needs_simulator
from rlhfz.launch import run_ranks

pytestmark = needs_simulator

CASES = [
    # world, stage, dtype, scenario, options
    (1, 0, "float32", "offload-cpu", {}),
    (1, 0, "bfloat16", "offload-disk", {"offload": "cpu", "offload_ratio": 0.5}),
    (2, 1, "float32", "checkpoint", {}),
    (2, 2, "bfloat16", "offload-cpu", {}),
    (3, 2, "float32", "offload-disk", {"offload": "cpu", "offload_ratio": 0.25}),
    (2, 3, "float32", "generate", {}),
    (3, 3, "bfloat16", "checkpoint", {}),
]


def _run(world, *args):
    if world == 1:
        return [workers.train(0, 1, *args)]
    return run_ranks(workers.train, world, *args, timeout=240)


@pytest.mark.parametrize("world, stage, dtype, scenario, options", CASES,
                         ids=[f"w{c[0]}-stage{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_the_device_trains_as_the_cpu_does(monkeypatch, tmp_path, world, stage, dtype, scenario,
                                           options):
    monkeypatch.delenv("RLHFZ_SIM_DEVICE", raising=False)
    on_cpu = _run(world, stage, dtype, scenario, str(tmp_path / "cpu"), options)
    # each rank on a device of its own, as on a GPU machine (rank r on device r)
    monkeypatch.setenv("RLHFZ_SIM_DEVICES", str(world))
    monkeypatch.setenv("RLHFZ_SIM_DEVICE", "0" if world == 1 else "local_rank")
    on_device = _run(world, stage, dtype, scenario, str(tmp_path / "device"), options)
    assert on_cpu[0]["seen"]["backend"] == "HostBackend"
    assert on_device[0]["seen"]["backend"] == "SimulatedCudaBackend"
    home = on_device[0]["seen"]["placement"]      # "device+pinned": a host-resident part
    assert home["params"].startswith("device") and home["exp_avg"].startswith("device")
    if "offloaded" in on_device[0]["seen"]:
        assert on_device[0]["seen"]["offloaded"]["params"] in ("pinned", "host", "disk")
    for rank in range(world):
        for name, value in on_cpu[rank]["params"].items():
            mine = on_device[rank]["params"][name]
            assert torch.equal(mine.view(torch.int16 if mine.dtype != torch.float32
                                         else torch.int32),
                               value.view(torch.int16 if value.dtype != torch.float32
                                          else torch.int32)), f"rank {rank}, {name}"
        for key, value in on_cpu[rank]["seen"].items():
            if key.startswith("generate"):
                assert torch.equal(on_device[rank]["seen"][key], value), key
