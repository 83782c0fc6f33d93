"""The peak host memory of `python -m rlhfz consolidate` against the
checkpoint's size, and its speed against a plain copy of the same bytes.

The checkpoint: a GPT-2-style model of 41.7M fp32 params (a 32k tied
vocabulary, width 512, 8 blocks) with ZeroAdamW's state after one step, saved
by 2 gloo ranks at stage 3: params and both moments, 500 MB in two
rank files. The export reads the params (the moments are left unread),
checks their CRC-32s and writes model.safetensors.

In a fresh child process: the steady resident memory after imports, then
the peak during consolidate (VmHWM after a reset through
/proc/self/clear_refs, else a 1 ms VmRSS sampler), both in extra_info with
the checkpoint's bytes and the largest tensor's. The peer is shutil.copyfile
of the rank files (the floor for moving those bytes through a process).

Run: python -m pytest benchmarks/test_bench_consolidate.py
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _save(rank, world_size, directory):
    import transformers
    import torch

    import rlhfz
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=8, n_embd=512, n_head=8, vocab_size=32000,
                                     n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() for p in model.parameters())
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-3)
    ids = torch.randint(0, 32000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    rlhfz.save_checkpoint(directory, model, opt)
    return params


@pytest.fixture(scope="module")
def checkpoint():
    pytest.importorskip("transformers")
    from rlhfz.launch import run_ranks
    directory = tempfile.mkdtemp(prefix="rlhfz-consolidate-")
    ckpt = os.path.join(directory, "ckpt")
    params = run_ranks(_save, 2, ckpt, timeout=900)[0]
    yield ckpt, params
    shutil.rmtree(directory, ignore_errors=True)


def _rank_files(ckpt):
    """The rank files of the checkpoint's generations (one generation here)."""
    return [os.path.join(root, name) for root, _, names in os.walk(ckpt) for name in names
            if name.endswith(".safetensors")]


def _checkpoint_bytes(ckpt):
    return sum(os.path.getsize(f) for f in _rank_files(ckpt))


def test_consolidate_peak_memory(benchmark, checkpoint):
    ckpt, params = checkpoint
    out = tempfile.mkdtemp(prefix="rlhfz-export-")
    report = os.path.join(out, "report.json")

    def run():
        subprocess.run([sys.executable, HERE, ckpt, os.path.join(out, "model"), report],
                       check=True, timeout=900)
    benchmark.group = "consolidate"
    benchmark.pedantic(run, rounds=1, iterations=1)
    with open(report) as f:
        figures = json.load(f)
    size = _checkpoint_bytes(ckpt)
    benchmark.extra_info.update({
        "params": params, "checkpoint_bytes": size, "export_bytes": figures["bytes"],
        "largest_tensor_bytes": figures["largest"], "steady_mb": figures["steady_kib"] / 1024,
        "peak_mb": figures["peak_kib"] / 1024,
        "peak_above_steady_mb": (figures["peak_kib"] - figures["steady_kib"]) / 1024,
        "peak_above_steady_per_checkpoint": (figures["peak_kib"] - figures["steady_kib"])
        * 1024 / size, "how": figures["how"], "seconds": figures["seconds"]})
    # bounded by the largest tensor (read, then cast) and the reader's chunks, not the file
    assert (figures["peak_kib"] - figures["steady_kib"]) * 1024 < 4 * figures["largest"] \
        + (64 << 20)
    shutil.rmtree(out, ignore_errors=True)


def test_copy_of_the_same_files(benchmark, checkpoint):
    ckpt, _ = checkpoint
    out = tempfile.mkdtemp(prefix="rlhfz-copy-")

    def run():
        for k, f in enumerate(_rank_files(ckpt)):
            shutil.copyfile(f, os.path.join(out, f"{k}.safetensors"))
    benchmark.group = "consolidate"
    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info["bytes"] = _checkpoint_bytes(ckpt)
    shutil.rmtree(out, ignore_errors=True)


def _measure(ckpt, out, report):
    from state_snapshots import peak_kib_during, status_kib

    from rlhfz.checkpoint.export import consolidate
    steady = status_kib("VmRSS:")
    done = {}
    start = time.perf_counter()
    peak, how = peak_kib_during(lambda: done.update(consolidate(ckpt, out)))
    seconds = time.perf_counter() - start
    with open(report, "w") as f:
        json.dump({"steady_kib": steady, "peak_kib": peak, "how": how, "seconds": seconds,
                   **done}, f)


if __name__ == "__main__":
    _measure(*sys.argv[1:4])
