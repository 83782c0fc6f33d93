"""rlhfz's native NCCL engine against the torch.distributed NCCL engine, on
one GPU (a world of one rank, over NCCL all the same).

- collectives: reduce-scatter and all-gather of a 256 MiB bucket and of a
  1 MiB one through each engine (Communicator over a torch "nccl" process
  group, NativeNcclCommunicator over rlhfz's own ncclComm), GB/s of the
  bucket's bytes and the median time per call;
- the stage-2 step: a 4-layer MLP (about 67M params) trained for a few
  steps with collectives="torch" and with collectives="nccl", the
  communicator kept even though the world is one rank (a single process
  otherwise runs no collectives at all), its median iteration time and
  the params checked equal between the two.

With one rank NCCL copies within the device: this measures each engine's
own cost per call (launch, stream hand-off, borrow bookkeeping), not a
link. Run: make gpu-check (phase bench-nccl), or
python -m pytest benchmarks/test_bench_nccl_cuda.py
"""

import inspect

import pytest
import torch
import torch.distributed as dist

import rlhfz
import rlhfz.optim
from gpu_timing import median_seconds, one_rank_nccl
from rlhfz import comm as rlhfz_comm


def _usable():
    info = rlhfz.build_info()
    return (torch.cuda.is_available() and bool(info["cuda"]) and info["cuda"] != "sim"
            and dist.is_nccl_available())


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not _usable(), reason="needs a CUDA device, rlhfz built with CUDA and torch with NCCL")]

ROUNDS = 20


@pytest.fixture(scope="module")
def nccl_world():
    with one_rank_nccl():
        yield


def _engine(kind):
    if kind == "torch":
        return rlhfz_comm.Communicator(None)
    from rlhfz.engine import backend_for
    native = rlhfz_comm.NativeNcclCommunicator(None, backend_for(torch.device("cuda", 0)))
    if not native.nccl.alive:
        pytest.skip("rlhfz's NCCL communicator did not start")
    return native


@pytest.mark.parametrize("nbytes", [256 << 20, 1 << 20], ids=["256MiB", "1MiB"])
@pytest.mark.parametrize("kind", ["torch", "native"])
def test_collectives(benchmark, nccl_world, kind, nbytes):
    benchmark.group = f"nccl collectives, world 1, {nbytes >> 20} MiB"
    engine = _engine(kind)
    try:
        full = torch.randn(nbytes // 4, device="cuda")
        shard = torch.empty_like(full)
        rs = median_seconds(lambda: engine.reduce_scatter(shard, full), ROUNDS, warmup=3)
        assert torch.equal(shard, full)
        gathered = torch.empty_like(full)
        ag = median_seconds(lambda: engine.all_gather(gathered, shard), ROUNDS, warmup=3)
        assert torch.equal(gathered, full)
        benchmark.pedantic(lambda: engine.all_gather(gathered, shard) and None, rounds=1)
        benchmark.extra_info.update(
            engine=kind, bytes=nbytes, reduce_scatter_us=round(rs * 1e6, 1),
            all_gather_us=round(ag * 1e6, 1), reduce_scatter_GBps=round(nbytes / rs / 1e9, 1),
            all_gather_GBps=round(nbytes / ag / 1e9, 1))
        print(f"\n{kind} {nbytes >> 20} MiB: reduce-scatter {rs * 1e6:.0f} us, "
              f"all-gather {ag * 1e6:.0f} us")
    finally:
        engine.destroy()


_params_after: dict[str, list[torch.Tensor]] = {}


@pytest.mark.parametrize("kind", ["torch", "nccl"])
def test_stage2_iteration(benchmark, nccl_world, monkeypatch, kind):
    benchmark.group = "stage-2 iteration, world 1, NCCL engines"
    made = []

    def keep_the_communicator(process_group, collectives="torch", backend=None,
                              device_mesh=None):
        # the optimizer's would give none at world 1: this one keeps an engine
        assert device_mesh is None
        engine = (rlhfz_comm.NativeNcclCommunicator(process_group, backend)
                  if collectives == "nccl" else rlhfz_comm.Communicator(process_group))
        made.append(engine)
        return engine
    assert (inspect.signature(keep_the_communicator).parameters.keys()
            == inspect.signature(rlhfz.optim.communicator_for).parameters.keys()), \
        "communicator_for's arguments changed: update the stand-in"
    monkeypatch.setattr(rlhfz.optim, "communicator_for", keep_the_communicator)
    torch.manual_seed(0)
    width = 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).cuda()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-4, stage=2, collectives=kind,
                          nonfinite=None)
    assert made and type(opt.comm).__name__ == type(made[0]).__name__
    x = torch.randn(64, width, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def iteration():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    seconds = median_seconds(iteration, 10, warmup=3)
    benchmark.pedantic(iteration, rounds=1)
    torch.cuda.synchronize()
    _params_after[kind] = [p.detach().clone() for p in model.parameters()]
    benchmark.extra_info.update(engine=kind, iteration_ms=round(seconds * 1e3, 3),
                                params=sum(p.numel() for p in model.parameters()))
    print(f"\nstage 2, collectives={kind}: {seconds * 1e3:.2f} ms per iteration")
    if len(_params_after) == 2:
        for a, b in zip(_params_after["torch"], _params_after["nccl"]):
            assert torch.equal(a, b)
    opt.close()
