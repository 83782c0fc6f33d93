"""Checkpoint save and load: rlhfz against raw file I/O of the same bytes,
and the peak memory of a load against torch.load.

The state: one fp32 param of 64M elements with ZeroAdamW after one step,
1 GiB in memory (param, grad, exp_avg, exp_avg_sq, 256 MiB each; fp32 params
are their own master). A checkpoint holds the param and both moments, not
the grad: 768 MiB plus a header and the step counts.

- save: `save_checkpoint` into an empty directory against writing the same
  three arrays with os.write into three new files of an empty directory,
  each file and the directory fsynced: both are durable when they return.
  rlhfz also computes CRC-32s, writes an index, renames and fsyncs twice.
- load: `load_checkpoint` against os.preadv of those three files straight
  into the same arrays (no allocation). rlhfz first reads every byte once
  more to check its CRC-32 before it writes anything; `verify_fraction` is
  the share of the load spent there. Both read a warm page cache (the files
  were just written), which is what a resume right after a save sees; cold,
  both would wait on the disk alike.
- peak RSS during load, in a fresh child process each: `load_checkpoint`
  against `torch.load(weights_only=True)` of save_consolidated's files
  followed by load_state_dict (model.pt, then optimizer.pt), and
  `load_consolidated` (rlhfz's reader of those files, memory-mapped). The
  peak is VmHWM after a reset through /proc/self/clear_refs (a 1 ms VmRSS
  sampler where that is not writable); it is reported in MB and against the
  steady state just before the load. The benchmark time of those tests is
  the whole child process; their figures are in extra_info.

GB/s counts bytes moved once (10^9 bytes per second). The machine's disk is
shared, so fsync-bound figures move between runs: compare within a run.

Run: python -m pytest benchmarks/test_bench_checkpoint.py
"""
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import rlhfz
import rlhfz.checkpoint.sharded

NUMEL = 64 << 20
ROUNDS = 3
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))     # the peak-memory probe the tests use
from state_snapshots import peak_kib_during, status_kib  # noqa: E402
_raw: dict[str, float] = {}


class _One(torch.nn.Module):
    def __init__(self, numel):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, numel))


def _trained(numel=NUMEL):
    """A model and optimizer with every state tensor written once, the same
    values in every run."""
    model = _One(numel)
    opt = rlhfz.ZeroAdamW(model, lr=1e-3, nonfinite=None)
    model.weight.grad = torch.sin(model.weight.detach() * 3.0)
    opt.step()
    return model, opt


def _saved_arrays(model, opt):
    """The tensors a checkpoint writes, as flat numpy arrays over their memory."""
    state = opt.state[model.weight]
    return [t.detach().reshape(-1).numpy() for t in
            (model.weight, state["exp_avg"], state["exp_avg_sq"])]


def _record(benchmark, nbytes: int, key: str, raw: bool = False) -> float:
    seconds = benchmark.stats.stats.median
    gbps = nbytes / seconds / 1e9
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s"] = round(gbps, 3)
    if raw:
        _raw[key] = gbps
    elif key in _raw:
        benchmark.extra_info["fraction_of_raw"] = round(gbps / _raw[key], 3)
    return seconds


@pytest.fixture(scope="module")
def trained():
    root = tempfile.mkdtemp(prefix="rlhfz-bench-ckpt-")
    model, opt = _trained()
    yield {"root": root, "model": model, "opt": opt,
           "arrays": _saved_arrays(model, opt),
           "checkpoint": os.path.join(root, "ckpt"), "raw": os.path.join(root, "raw")}
    shutil.rmtree(root, ignore_errors=True)
    del model, opt
    gc.collect()


@pytest.fixture(autouse=True)
def _collect():
    gc.collect()
    yield
    gc.collect()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_write(directory, arrays):
    os.makedirs(directory)
    for i, array in enumerate(arrays):
        fd = os.open(os.path.join(directory, f"raw{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                     0o600)
        try:
            view = memoryview(array).cast("B")
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(directory)


def _raw_read(directory, arrays):
    for i, array in enumerate(arrays):
        fd = os.open(os.path.join(directory, f"raw{i}"), os.O_RDONLY)
        try:
            view, offset = memoryview(array).cast("B"), 0
            while view:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    raise EOFError(f"raw{i} is short")
                view, offset = view[n:], offset + n
        finally:
            os.close(fd)


def _checkpoint_bytes(path) -> int:
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    return sum(entry["bytes"] for entry in index["files"]) + \
        os.path.getsize(os.path.join(path, "index.json"))


def _remove(path):
    shutil.rmtree(path, ignore_errors=True)


# ---- save ---------------------------------------------------------------------------------

def test_raw_write_fsync(benchmark, trained):
    benchmark.group = "save 768 MiB (durable)"
    raw, arrays = trained["raw"], trained["arrays"]
    benchmark.pedantic(_raw_write, args=(raw, arrays), setup=lambda: _remove(raw),
                       rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, sum(a.nbytes for a in arrays), "save", raw=True)


def test_rlhfz_save_checkpoint(benchmark, trained):
    benchmark.group = "save 768 MiB (durable)"
    path, model, opt = trained["checkpoint"], trained["model"], trained["opt"]
    benchmark.pedantic(rlhfz.save_checkpoint, args=(path, model, opt, {"step": 1}),
                       setup=lambda: _remove(path), rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, _checkpoint_bytes(path), "save")


# ---- load ---------------------------------------------------------------------------------

def test_raw_preadv_into_arrays(benchmark, trained):
    benchmark.group = "load 768 MiB (warm page cache)"
    raw, arrays = trained["raw"], trained["arrays"]
    if not os.path.isdir(raw):
        _raw_write(raw, arrays)
    benchmark.pedantic(_raw_read, args=(raw, arrays), rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, sum(a.nbytes for a in arrays), "load", raw=True)


def test_rlhfz_load_checkpoint(benchmark, trained, monkeypatch):
    benchmark.group = "load 768 MiB (warm page cache)"
    path, model, opt = trained["checkpoint"], trained["model"], trained["opt"]
    if not os.path.isdir(path):
        rlhfz.save_checkpoint(path, model, opt, {"step": 1})
    verify = rlhfz.checkpoint.sharded.verify
    spent = []

    def timed_verify(*args):
        start = time.perf_counter()
        try:
            return verify(*args)
        finally:
            spent.append(time.perf_counter() - start)
    monkeypatch.setattr(rlhfz.checkpoint.sharded, "verify", timed_verify)   # where load_checkpoint looks it up
    returned = []
    benchmark.pedantic(lambda: returned.append(rlhfz.load_checkpoint(path, model, opt)),
                       rounds=ROUNDS, warmup_rounds=1)
    assert returned[-1] == {"step": 1}
    seconds = _record(benchmark, _checkpoint_bytes(path), "load")
    timed = sorted(spent[-ROUNDS:])           # the warmup's comes first
    benchmark.extra_info["verify_seconds"] = round(timed[len(timed) // 2], 4)
    benchmark.extra_info["verify_fraction"] = round(timed[len(timed) // 2] / seconds, 3)


# ---- peak memory during load, each in a fresh process ----------------------------------------

LOADERS = ["rlhfz.load_checkpoint", "torch.load+load_state_dict", "rlhfz.load_consolidated"]


@pytest.mark.parametrize("loader", LOADERS)
def test_peak_rss_during_load(benchmark, loader):
    benchmark.group = "peak RSS during load (child process)"
    directory = tempfile.mkdtemp(prefix="rlhfz-bench-rss-")
    out = os.path.join(directory, "result.json")
    env = dict(os.environ, RLHFZ_PROGRESS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))

    def child():
        done = subprocess.run([sys.executable, HERE, loader, directory, out], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    try:
        benchmark.pedantic(child, rounds=1, iterations=1)
        with open(out) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    steady, peak = result["steady_kib"] * 1024, result["peak_kib"] * 1024
    benchmark.extra_info.update({
        "steady_MB": round(steady / 1e6, 1), "peak_MB": round(peak / 1e6, 1),
        "extra_MB": round((peak - steady) / 1e6, 1), "peak/steady": round(peak / steady, 3),
        "load_seconds": round(result["seconds"], 3), "bytes_read": result["bytes"],
        "GB/s": round(result["bytes"] / result["seconds"] / 1e9, 3),
        "measured_by": result["how"], "timed": "the whole child process"})


def _measure_load(loader, directory, out):
    """In a child: train, save in the loader's format, clear the state, then
    load it back while watching the peak."""
    model, opt = _trained()
    tensors = [torch.from_numpy(a) for a in _saved_arrays(model, opt)]
    digest = [float(t.double().sum()) for t in tensors]
    path = os.path.join(directory, "state")
    if loader == "rlhfz.load_checkpoint":
        rlhfz.save_checkpoint(path, model, opt)
        nbytes = _checkpoint_bytes(path)
    else:
        rlhfz.save_consolidated(path, model, opt)
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in ("model.pt", "optimizer.pt"))
    with torch.no_grad():
        for t in tensors:
            t.zero_()
    gc.collect()
    steady = status_kib("VmRSS:")

    def load():
        if loader == "rlhfz.load_checkpoint":
            rlhfz.load_checkpoint(path, model, opt)
        elif loader == "rlhfz.load_consolidated":
            rlhfz.load_consolidated(path, model, opt)
        else:
            model.load_state_dict(torch.load(os.path.join(path, "model.pt"),
                                             map_location="cpu", weights_only=True))
            opt.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"),
                                           map_location="cpu", weights_only=True))
    start = time.perf_counter()
    peak, how = peak_kib_during(load)
    seconds = time.perf_counter() - start
    restored = [float(torch.from_numpy(a).double().sum()) for a in _saved_arrays(model, opt)]
    if restored != digest:
        raise AssertionError(f"{loader} did not restore the state: {restored} != {digest}")
    with open(out, "w") as f:
        json.dump({"steady_kib": steady, "peak_kib": peak, "how": how, "seconds": seconds,
                   "bytes": nbytes}, f)


if __name__ == "__main__":
    _measure_load(*sys.argv[1:4])
