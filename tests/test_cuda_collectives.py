"""The native NCCL engine behind ZeroAdamW(collectives="nccl").

On a GPU: one GPU allows one NCCL rank, so a world of one: the unique-id
bootstrap over the gloo control group, each collective on rlhfz's stream
joined back to torch's, results read after torch's stream waits (no host
sync in between), and explicit destruction. On the simulated CUDA runtime
with its NCCL stand-in (make test-sim), worlds of 2 and 3 processes too:
training with the native engine against the torch.distributed engine, at
stages 2 and 3, and a rank killed in the middle of a collective, which NCCL
would wait on forever: the watchdog aborts the communicator and the other
ranks raise CollectiveError within RLHFZ_COLLECTIVE_TIMEOUT.
"""
import datetime
import json
import os
import socket

import pytest
import torch

import native_nccl_workers as workers
import rlhfz
from device_support import (SIMULATED, needs_device, needs_simulator, params_on_device,
                            to_device, zeros)
from rlhfz.launch import run_ranks

pytestmark = [pytest.mark.gpu, needs_device]


def _nccl_problem():
    info = rlhfz.build_info()
    return None if info["nccl"] else f"NCCL is not usable here: {info['nccl_error']}"


needs_nccl = pytest.mark.skipif(_nccl_problem() is not None, reason=str(_nccl_problem()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_devices(monkeypatch, world_size):
    """Each rank on a simulated device of its own (cuda:LOCAL_RANK on a
    GPU): NCCL, and so its stand-in, takes no two ranks on one device."""
    monkeypatch.setenv("RLHFZ_SIM_DEVICES", str(world_size))
    monkeypatch.setenv("RLHFZ_SIM_DEVICE", "local_rank")


@pytest.fixture
def world_of_one(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", "60")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        with params_on_device(monkeypatch):
            yield
    finally:
        dist.destroy_process_group()


@needs_nccl
def test_native_collectives_round_trip(world_of_one):
    from rlhfz.engine import backend_for
    from rlhfz.comm import NativeNcclCommunicator
    backend = backend_for(torch.device("cpu") if SIMULATED else
                          torch.device("cuda", torch.cuda.current_device()))
    comm = NativeNcclCommunicator(None, backend)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            full = to_device(torch.randn(4099).to(dtype))
            shard = zeros(4099, dtype)
            comm.reduce_scatter(shard, to_device(full))     # the mean of one rank: itself
            assert torch.equal(shard, full)
            gathered = zeros(4099, dtype)
            work = comm.all_gather(gathered, shard, async_op=True)
            work.wait()
            assert torch.equal(gathered, full)
            averaged = to_device(full)
            comm.all_reduce_avg(averaged)
            assert torch.equal(averaged, full)
        # Work torch queued just before is seen by the collective.
        x = zeros(1 << 20)
        x.add_(3.0)
        out = zeros(1 << 20)
        comm.all_gather(out, x)
        assert bool((out == 3.0).all())
        # NcclComm checks what it borrows, and the communicator stays usable
        with pytest.raises(BufferError, match="float32, bfloat16 and float16"):
            comm.all_reduce_avg(to_device(torch.zeros(4, dtype=torch.float64)))
        with pytest.raises(BufferError, match="needs CUDA device memory"):
            comm.all_reduce_avg(torch.zeros(4))            # host memory
        with pytest.raises(BufferError, match="not contiguous"):
            comm.all_reduce_avg(zeros((4, 4)).t())
        with pytest.raises(ValueError, match="world_size \\(1\\) times"):
            comm.reduce_scatter(zeros(3), zeros(4))
        with pytest.raises(TypeError, match="send must be float32, not bfloat16"):
            comm.all_gather(zeros(4), zeros(4, torch.bfloat16))
        averaged = to_device(full)
        comm.all_reduce_avg(averaged)
        assert torch.equal(averaged, full)
    finally:
        comm.destroy()
    assert not comm.nccl.alive


@needs_simulator
@needs_nccl
@pytest.mark.parametrize("world_size, stage, dtype", [(2, 2, "float32"), (3, 2, "bfloat16"),
                                                      (2, 3, "float32"), (3, 3, "float32")])
def test_native_engine_trains_as_the_torch_engine(monkeypatch, world_size, stage, dtype):
    """Ranks on simulated devices: the native engine's reduce-scatters and
    all-gathers (NCCL's average is a premultiplied sum) against gloo's."""
    _own_devices(monkeypatch, world_size)
    native = run_ranks(workers.train, world_size, "nccl", stage, dtype)
    reference = run_ranks(workers.train, world_size, "torch", stage, dtype)
    assert native[0]["comm"] == "NativeNcclCommunicator"
    assert native[0]["backend"] == reference[0]["backend"] == "SimulatedCudaBackend"
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for rank in range(world_size):
        for name, value in native[rank]["params"].items():
            torch.testing.assert_close(value, reference[rank]["params"][name], rtol=tolerance,
                                       atol=tolerance, msg=lambda m: f"rank {rank}, {name}: {m}")
            assert torch.equal(value, native[0]["params"][name])    # every rank the same


@needs_simulator
@needs_nccl
@pytest.mark.parametrize("collectives, stage", [("nccl", 2), ("torch", 2), ("nccl", 3)])
def test_torch_clips_reach_shards_on_the_device(monkeypatch, collectives, stage):
    """torch.nn.utils.clip_grad_norm_ / clip_grad_value_ over a model whose
    grads live in device shards: the clips reach them, as torch's reach
    whole grads."""
    _own_devices(monkeypatch, 2)
    for out in run_ranks(workers.torch_clips, 2, collectives, stage):
        assert out["backend"] == "SimulatedCudaBackend", out
        for ours, theirs in out["norms"]:
            assert theirs > 0.05 and ours == pytest.approx(theirs, rel=1e-5), out
        assert out["diff"] < 5e-6, out
        for ours, theirs in out["bf16"]:          # bf16 values: equal, not close
            assert ours == theirs, out["bf16"]


@needs_simulator
@needs_nccl
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_sharing_a_device_are_refused(monkeypatch, world_size):
    """NCCL refuses a communicator with two ranks on one device (Duplicate
    GPU detected); so does its stand-in, on every rank, at once: each
    constructor raises, none hangs, and nothing is left behind."""
    monkeypatch.setenv("RLHFZ_SIM_DEVICES", str(world_size))
    monkeypatch.setenv("RLHFZ_SIM_DEVICE", "0")
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", "20")
    outcomes = run_ranks(workers.one_device_for_all, world_size, timeout=60)
    for rank, out in enumerate(outcomes):
        assert out["raised"] is not None, out
        assert "ncclInvalidUsage" in out["raised"], out
        other = 1 if rank == 0 else 0
        assert f"Duplicate GPU detected : rank {rank} and rank {other} both on CUDA device 0" \
            in out["raised"], out
        assert out["after_s"] < 15 and out["watchdogs"] == 0, out


def _survivors(tmp_path, world_size, victim):
    outcomes = []
    for rank in range(world_size):
        if rank == victim:
            assert not os.path.exists(tmp_path / f"rank{victim}.json")
            continue
        with open(tmp_path / f"rank{rank}.json") as f:
            outcomes.append(json.load(f))
        assert outcomes[-1]["raised"], f"rank {rank} went on as if nothing happened"
    return outcomes


@needs_simulator
@needs_nccl
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_killed_mid_training_makes_the_others_raise(monkeypatch, tmp_path, world_size):
    """ZeroAdamW(collectives="nccl"), stage 2: whichever notices first (the
    watchdog of the collective the dead rank never joins, or the gloo
    control group's agreement), every other rank raises CollectiveError
    within the timeout."""
    timeout = 6
    _own_devices(monkeypatch, world_size)
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", str(timeout))
    victim = world_size - 1
    with pytest.raises(RuntimeError, match=rf"ranks \[{victim}\] gave no result"):
        run_ranks(workers.die_mid_collective, world_size, victim, str(tmp_path), timeout=90)
    for outcome in _survivors(tmp_path, world_size, victim):
        assert outcome["after_s"] < timeout + 10, outcome


@needs_simulator
@needs_nccl
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_watchdog_aborts_a_collective_a_dead_rank_never_joins(monkeypatch, tmp_path,
                                                                  world_size):
    """The native communicator alone, nothing on gloo to notice the death:
    NCCL (and its stand-in) waits for the dead rank forever; the watchdog
    aborts the communicator at the timeout and the wait raises."""
    timeout = 4
    _own_devices(monkeypatch, world_size)
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", str(timeout))
    victim = 1
    with pytest.raises(RuntimeError, match=rf"ranks \[{victim}\] gave no result"):
        run_ranks(workers.collective_after_death, world_size, victim, str(tmp_path), timeout=90)
    for outcome in _survivors(tmp_path, world_size, victim):
        assert "did not complete within 4 s" in outcome["raised"]
        assert "NCCL communicator was aborted" in outcome["raised"]
        assert timeout <= outcome["after_s"] < timeout + 5, outcome
        assert outcome["alive"] is False


@needs_simulator
@needs_nccl
def test_an_error_nccl_flags_raises_at_the_first_wait(monkeypatch):
    """Different sizes on the two ranks: the stand-in flags the error, and
    the wait that would hand back an unreduced tensor raises instead. The
    communicator is aborted then; destroy() releases the rest."""
    _own_devices(monkeypatch, 2)
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", "20")
    for out in run_ranks(workers.mismatched_sizes_then_destroy, 2):
        assert out["first"] is not None and "NCCL" in out["first"], out
        assert out["second"] is not None and "aborted" in out["second"], out
        assert out["destroy"] is None, out         # aborted at the error: nothing to destroy
        assert out["stream_closed"] and out["control_released"], out


@needs_simulator
@needs_nccl
def test_a_refused_constructor_leaves_no_communicator(monkeypatch):
    _own_devices(monkeypatch, 2)
    for out in run_ranks(workers.refused_constructor, 2):
        assert out["refused"] is not None and out["watchdogs"] == 0, out


@needs_simulator
@needs_nccl
@pytest.mark.parametrize("world_size, failing_rank", [(2, 1), (3, 0)])
def test_a_rank_failing_before_the_nccl_init_fails_every_rank_at_once(monkeypatch, world_size,
                                                                        failing_rank):
    """A blocking ncclCommInitRank waits for every rank: one that failed
    before it (here its stream) would leave the others waiting for ever, or
    for a communicator whose first collective times out."""
    _own_devices(monkeypatch, world_size)
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", "30")
    outcomes = run_ranks(workers.bootstrap_fails_on_one_rank, world_size, failing_rank,
                         timeout=90)
    for rank, out in enumerate(outcomes):
        assert out["raised"] is not None and out["watchdogs"] == 0, out
        assert out["after_s"] < 15, out
        if rank == failing_rank:
            assert out["raised"].startswith("RuntimeError: CudaStream"), out
        else:
            assert out["raised"].startswith("CollectiveError"), out
            assert f"rank {failing_rank} failed first" in out["raised"], out


@needs_simulator
@needs_nccl
@pytest.mark.parametrize("world_size, failing_rank", [(2, 1), (3, 0)])
def test_a_rank_failing_inside_the_nccl_init_fails_every_rank_within_the_timeout(
        monkeypatch, world_size, failing_rank):
    """The others are inside their own init by then: a blocking init would
    wait there for the failing rank for ever (the stand-in, for its own
    init timeout of 300 s). Non-blocking, they poll, and at rlhfz's
    timeout they abort and raise."""
    timeout = 6
    _own_devices(monkeypatch, world_size)
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", str(timeout))
    outcomes = run_ranks(workers.init_fails_on_one_rank, world_size, failing_rank, timeout=90)
    for rank, out in enumerate(outcomes):
        assert out["raised"] is not None and out["watchdogs"] == 0, out
        assert out["after_s"] < timeout + 10, out
        if rank == failing_rank:
            assert out["raised"].startswith("RuntimeError: "), out
            assert (f"ncclCommInitRankConfig (rank {rank} of {world_size}, device {rank}) failed: "
                    "ncclUnhandledCudaError") in out["raised"], out
        else:
            assert out["raised"].startswith("CollectiveError"), out
            assert f"did not finish within {timeout} s" in out["raised"], out
            assert "the communicator is aborted" in out["raised"], out


@needs_simulator
@needs_nccl
def test_a_peer_dying_after_a_gather_for_generation_raises(monkeypatch, tmp_path):
    """Stage 3: buffers released after the gather free device memory, which
    waits for the collectives queued before it: those are watched from
    before their launch, so the watchdog still aborts them at the timeout."""
    timeout = 6
    _own_devices(monkeypatch, 2)
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", str(timeout))
    with pytest.raises(RuntimeError, match=r"ranks \[1\] gave no result"):
        run_ranks(workers.gather_then_peer_dies, 2, 1, str(tmp_path), timeout=90)
    for outcome in _survivors(tmp_path, 2, 1):
        assert outcome["after_s"] < timeout + 10, outcome


@needs_simulator
@needs_nccl
def test_a_collective_refused_at_launch_is_a_collective_error(monkeypatch):
    _own_devices(monkeypatch, 2)
    monkeypatch.setenv("RLHFZ_COLLECTIVE_TIMEOUT", "6")
    for out in run_ranks(workers.launch_fails, 2, 0):
        assert out["raised"] is not None and out["unchanged"] and out["state"] == 0, out
