"""Checkpoints: exact round trips at every stage and world size, resharding,
atomic replacement, damage detected before anything changes, and the
consolidated torch formats both ways."""
import json
import os
import re
import shutil
import struct

import pytest
import torch

import rlhfz
from rlhfz.launch import run_ranks
from state_snapshots import assert_same, snapshot

import checkpoint_workers as workers

transformers = pytest.importorskip("transformers")


def assert_equal(a, b, path="", atol=0.0):
    """Nested dicts/lists of tensors equal (bitwise unless atol)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_equal(a[key], b[key], f"{path}.{key}", atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{path}[{i}]", atol)
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        if atol:
            torch.testing.assert_close(a, b, atol=atol, rtol=atol, msg=path)
        else:
            assert torch.equal(a, b), f"{path}: max diff {(a - b).abs().max()}"
    else:
        assert a == b, path


def states(opt):
    return opt.state_dict()


# ---- one process ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"offload": "cpu", "offload_ratio": 0.5}])
def test_resume_is_bitwise(tmp_path, dtype, options):
    model, opt = workers.build("mlp", 2, dtype, **options)
    workers.train(model, opt, "mlp", 0, 1, 0, 4)
    rlhfz.save_checkpoint(tmp_path, model, opt, client_state={"step": 4, "note": "x"})
    saved = snapshot(model, opt)
    workers.train(model, opt, "mlp", 0, 1, 4, 8)
    fresh, fresh_opt = workers.build("mlp", 2, dtype, **options)
    assert rlhfz.load_checkpoint(tmp_path, fresh, fresh_opt) == {"step": 4, "note": "x"}
    loaded = snapshot(fresh, fresh_opt)
    assert_same({k: v for k, v in saved.items() if not k.endswith(".grad")}, loaded)
    workers.train(fresh, fresh_opt, "mlp", 0, 1, 4, 8)
    assert_same(snapshot(model, opt), snapshot(fresh, fresh_opt))


def test_loads_into_offloaded_state_and_saves_from_disk(tmp_path):
    model, opt = workers.build("mlp", 2)
    workers.train(model, opt, "mlp", 0, 1, 0, 3)
    os.makedirs(tmp_path / "tier")
    os.makedirs(tmp_path / "tier2")
    opt.offload(to="disk", path=str(tmp_path / "tier"))
    rlhfz.save_checkpoint(tmp_path / "ck", model, opt)
    opt.reload()
    expected = snapshot(model, opt)
    fresh, fresh_opt = workers.build("mlp", 2)
    fresh_opt.offload(to="disk", path=str(tmp_path / "tier2"))
    rlhfz.load_checkpoint(tmp_path / "ck", fresh, fresh_opt)
    fresh_opt.reload()
    assert_same({k: v for k, v in expected.items() if not k.endswith(".grad")},
                snapshot(fresh, fresh_opt))


def test_param_groups_hyperparameters_come_back(tmp_path):
    model, opt = workers.build("mlp", 2)
    workers.train(model, opt, "mlp", 0, 1, 0, 2)
    opt.param_groups[0]["lr"] = 1.25e-4
    opt.param_groups[0]["betas"] = (0.8, 0.95)
    rlhfz.save_checkpoint(tmp_path, model, opt)
    fresh, fresh_opt = workers.build("mlp", 2)
    rlhfz.load_checkpoint(tmp_path, fresh, fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == 1.25e-4
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_overwrite_keeps_one_generation_and_files_are_tensor_only(tmp_path):
    model, opt = workers.build("mlp", 2)
    rlhfz.save_checkpoint(tmp_path, model, opt, client_state={"step": 0})
    workers.train(model, opt, "mlp", 0, 1, 0, 2)
    rlhfz.save_checkpoint(tmp_path, model, opt, client_state={"step": 2})
    entries = sorted(os.listdir(tmp_path))
    assert len(entries) == 2 and entries[1] == "index.json" and entries[0].startswith("g-")
    shard = tmp_path / entries[0] / "rank-00000-of-00001.safetensors"
    assert (os.stat(shard).st_mode & 0o777) == 0o600
    from safetensors.torch import load_file
    tensors = load_file(str(shard))          # the safetensors library reads them as they are
    assert torch.equal(tensors["bucket0.exp_avg"][:5], opt.engine.buckets[0].flat_exp_avg[:5])
    fresh, fresh_opt = workers.build("mlp", 2)
    assert rlhfz.load_checkpoint(tmp_path, fresh, fresh_opt) == {"step": 2}


def test_bad_arguments_write_nothing(tmp_path):
    model, opt = workers.build("mlp", 2)
    with pytest.raises(TypeError, match="JSON"):
        rlhfz.save_checkpoint(tmp_path / "a", model, opt, client_state={"x": object()})
    assert not (tmp_path / "a").exists()
    with pytest.raises(TypeError, match="ZeroAdamW"):
        rlhfz.save_checkpoint(tmp_path / "b", model, torch.optim.AdamW(model.parameters()))
    (tmp_path / "file").write_text("x")
    with pytest.raises(rlhfz.CheckpointError, match="not a directory"):
        rlhfz.save_checkpoint(tmp_path / "file", model, opt)
    with pytest.raises(rlhfz.CheckpointError, match="no checkpoint"):
        rlhfz.load_checkpoint(tmp_path / "missing", model, opt)


def _saved(tmp_path):
    model, opt = workers.build("mlp", 2, torch.bfloat16)
    workers.train(model, opt, "mlp", 0, 1, 0, 2)
    rlhfz.save_checkpoint(tmp_path, model, opt)
    target, target_opt = workers.build("mlp", 2, torch.bfloat16)
    workers.train(target, target_opt, "mlp", 0, 1, 5, 6)
    return target, target_opt


def _shard(tmp_path):
    generation = next(e for e in os.listdir(tmp_path) if e.startswith("g-"))
    return tmp_path / generation / "rank-00000-of-00001.safetensors"


def _flip(file, offset_from_end):
    data = bytearray(file.read_bytes())
    data[len(data) - offset_from_end] ^= 0x10
    file.write_bytes(bytes(data))


DAMAGE = {
    "flipped data byte": lambda d: _flip(_shard(d), 7),
    "flipped header byte": lambda d: _flip(_shard(d), os.path.getsize(_shard(d)) - 20),
    "truncated shard": lambda d: _shard(d).write_bytes(_shard(d).read_bytes()[:-100]),
    "extended shard": lambda d: _shard(d).write_bytes(_shard(d).read_bytes() + b"\0" * 8),
    "huge header length": lambda d: _shard(d).write_bytes(
        struct.pack("<Q", 1 << 62) + _shard(d).read_bytes()[8:]),
    "missing shard": lambda d: os.unlink(_shard(d)),
    "index not json": lambda d: (d / "index.json").write_text("{not json"),
    "index truncated": lambda d: (d / "index.json").write_bytes(
        (d / "index.json").read_bytes()[:200]),
    "file outside": lambda d: (d / "index.json").write_text(
        (d / "index.json").read_text().replace("rank-00000-of-00001", "../../etc/passwd")),
    "wrong shape": lambda d: (d / "index.json").write_text(
        (d / "index.json").read_text().replace("[61,37]", "[37,61]", 1)),
    "wrong world size": lambda d: (d / "index.json").write_text(
        (d / "index.json").read_text().replace('"world_size":1', '"world_size":2')),
    "generation gone": lambda d: shutil.rmtree(_shard(d).parent),
    # well-formed edits that would drop state or move bytes: the index's CRC catches them
    "state dropped": lambda d: (d / "index.json").write_text(
        (d / "index.json").read_text().replace('"registered":[true', '"registered":[false', 1)),
    "lr edited": lambda d: (d / "index.json").write_text(
        re.sub(r'"lr":[^,]+', '"lr":0.5', (d / "index.json").read_text(), count=1)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_raises_and_changes_nothing(tmp_path, damage):
    target, target_opt = _saved(tmp_path)
    before = snapshot(target, target_opt)
    text = (tmp_path / "index.json").read_bytes()
    DAMAGE[damage](tmp_path)
    if damage in ("state dropped", "lr edited"):
        assert (tmp_path / "index.json").read_bytes() != text      # the edit landed
    with pytest.raises(rlhfz.CheckpointError):
        rlhfz.load_checkpoint(tmp_path, target, target_opt)
    assert_same(before, snapshot(target, target_opt))


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = workers.build("mlp", 2)
    rlhfz.save_checkpoint(tmp_path, model, opt)
    other = torch.nn.Sequential(torch.nn.Linear(37, 61), torch.nn.Linear(61, 30))
    other_opt = rlhfz.ZeroAdamW(other)
    before = snapshot(other, other_opt)
    with pytest.raises(rlhfz.CheckpointError, match="another model|params"):
        rlhfz.load_checkpoint(tmp_path, other, other_opt)
    assert_same(before, snapshot(other, other_opt))


# ---- the consolidated torch formats ---------------------------------------------------------

def test_consolidated_goes_to_plain_torch_and_back(tmp_path):
    model, opt = workers.build("mlp", 2)
    workers.train(model, opt, "mlp", 0, 1, 0, 3)
    rlhfz.save_consolidated(tmp_path, model, opt)
    plain = workers.mlp()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.1)
    plain_opt.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    # ...and back: torch's own files load into a fresh rlhfz optimizer
    workers.train(plain, plain_opt, "mlp", 0, 1, 3, 5)
    shutil.rmtree(tmp_path)
    os.makedirs(tmp_path)
    torch.save(plain.state_dict(), tmp_path / "model.pt")
    torch.save(plain_opt.state_dict(), tmp_path / "optimizer.pt")
    fresh, fresh_opt = workers.build("mlp", 2)
    rlhfz.load_checkpoint(tmp_path, fresh, fresh_opt)
    assert_equal(plain_opt.state_dict()["state"], fresh_opt.state_dict()["state"])
    for p, q in zip(plain.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/rlhfz-pwned",))


def test_consolidated_loading_executes_nothing(tmp_path):
    model, opt = workers.build("mlp", 2)
    state = model.state_dict()
    state["evil"] = _Payload()
    torch.save(state, tmp_path / "model.pt")
    before = snapshot(model, opt)
    if os.path.exists("/tmp/rlhfz-pwned"):
        os.unlink("/tmp/rlhfz-pwned")
    with pytest.raises(rlhfz.CheckpointError, match="tensor-only"):
        rlhfz.load_checkpoint(tmp_path, model, opt)
    assert not os.path.exists("/tmp/rlhfz-pwned")
    assert_same(before, snapshot(model, opt))


def test_consolidated_with_a_bad_optimizer_state_changes_nothing(tmp_path):
    model, opt = workers.build("mlp", 2)
    workers.train(model, opt, "mlp", 0, 1, 0, 2)
    rlhfz.save_consolidated(tmp_path, model, opt)
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    state["state"][0]["exp_avg"] = torch.zeros(3)
    torch.save(state, tmp_path / "optimizer.pt")
    target, target_opt = workers.build("mlp", 2)
    before = snapshot(target, target_opt)
    with pytest.raises(rlhfz.CheckpointError, match="shape"):
        rlhfz.load_checkpoint(tmp_path, target, target_opt)
    assert_same(before, snapshot(target, target_opt))


def test_a_checkpoint_of_another_min_8bit_size_with_the_same_split_keeps_stepping(tmp_path):
    """Both thresholds put the same params in int8 (2257 elements above,
    1769 below), so the moments load as they are; the loaded optimizer keeps
    the threshold its buckets were built with and steps on as the saved one."""
    model, opt = workers.build("mlp", 2, state_dtype="int8", min_8bit_size=2000)
    workers.train(model, opt, "mlp", 0, 1, 0, 2)
    rlhfz.save_checkpoint(tmp_path, model, opt)
    target, target_opt = workers.build("mlp", 2, state_dtype="int8", min_8bit_size=2200)
    rlhfz.load_checkpoint(tmp_path, target, target_opt)
    assert target_opt.param_groups[0]["min_8bit_size"] == 2200
    workers.train(model, opt, "mlp", 0, 1, 2, 4)
    workers.train(target, target_opt, "mlp", 0, 1, 2, 4)
    for a, b in zip(model.parameters(), target.parameters()):
        assert torch.equal(a, b)


def test_progress_shows_only_when_asked(tmp_path, capfd, monkeypatch):
    model, opt = workers.build("mlp", 2)
    rlhfz.save_checkpoint(tmp_path, model, opt)
    assert capfd.readouterr().err == ""
    monkeypatch.setenv("RLHFZ_PROGRESS", "1")
    rlhfz.save_checkpoint(tmp_path, model, opt)
    rlhfz.load_checkpoint(tmp_path, model, opt)
    err = capfd.readouterr().err
    assert "rlhfz save" in err and "rlhfz load" in err


@pytest.mark.parametrize("text, threshold", [("1G", 10**9), ("500M", 5 * 10**8),
                                             ("1073741824", 1 << 30), ("2.5k", 2500), ("0", 0)])
def test_progress_threshold_takes_counts_as_the_command_line_writes_them(tmp_path, monkeypatch,
                                                                        text, threshold):
    from rlhfz.progress import min_bytes
    monkeypatch.delenv("RLHFZ_PROGRESS", raising=False)
    monkeypatch.setenv("RLHFZ_PROGRESS_MIN_BYTES", text)
    assert min_bytes() == threshold
    model, opt = workers.build("mlp", 2)
    rlhfz.save_checkpoint(tmp_path, model, opt)
    rlhfz.load_checkpoint(tmp_path, model, opt)


@pytest.mark.parametrize("text", ["lots", "-1", "1GiB"])
def test_a_progress_threshold_that_is_no_count_is_refused_by_name(tmp_path, monkeypatch, capsys,
                                                                 text):
    from rlhfz.__main__ import main
    monkeypatch.delenv("RLHFZ_PROGRESS", raising=False)
    monkeypatch.setenv("RLHFZ_PROGRESS_MIN_BYTES", text)
    model, opt = workers.build("mlp", 2)
    with pytest.raises(ValueError, match="RLHFZ_PROGRESS_MIN_BYTES must be a whole number"):
        rlhfz.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "error: RLHFZ_PROGRESS_MIN_BYTES must be" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- across ranks: stages, world sizes, resharding ------------------------------------------

def _run(fn, world_size, *args):
    return run_ranks(fn, world_size, *args)


@pytest.mark.parametrize("kind,stage,dtype,options", [
    ("mlp", 2, torch.float32, {}),
    ("mlp", 1, torch.bfloat16, {"offload": "cpu", "offload_ratio": 0.5}),
    ("gpt2", 3, torch.float32, {}),
])
def test_two_ranks_resume_bitwise_and_reshard(tmp_path, kind, stage, dtype, options):
    path = str(tmp_path / "ck")
    first = _run(workers.save_and_continue, 2, path, kind, stage, dtype, options)
    saved, final = first[0]["saved"], first[0]["final"]
    assert_equal(first[1]["saved"], saved)
    # the same world size: the same trajectory, bit for bit
    again = _run(workers.load_and_continue, 2, path, kind, stage, dtype, options)
    assert_equal(again[0]["loaded"], saved)
    assert_equal(again[0]["final"], final)
    # three ranks, no host part: the state is resharded exactly
    wider = _run(workers.load_and_continue, 3, path, kind, stage, dtype, {})
    assert_equal(wider[0]["loaded"], saved)
    assert_equal(wider[2]["loaded"], saved)
    # (sums over 3 ranks round differently: one 16-bit ulp at most)
    assert_equal(wider[0]["final"]["params"], final["params"],
                 atol=1e-4 if dtype == torch.float32 else 1e-2)
    # one process, stage 2
    single = workers.load_and_continue(0, 1, path, kind, 2, dtype, {})
    assert_equal(single["loaded"], saved)
    assert single["client"] == {"step": 3}


@pytest.mark.parametrize("stage, world_size, dtype, options", [
    (2, 1, torch.bfloat16, {}),                      # the other optimizer's fp32 master
    (2, 1, torch.float32, {"offload": "cpu"}),       # its host part
    (1, 2, torch.bfloat16, {}),
    (3, 2, torch.float32, {}),                       # its params kept as shards
    (3, 2, torch.bfloat16, {}),
])
def test_a_checkpoint_of_one_optimizer_keeps_and_restores_the_other_ones_params(
        tmp_path, stage, world_size, dtype, options):
    outs = run_ranks(workers.checkpoint_beside_another_optimizer, world_size,
                     str(tmp_path / "ckpt"), stage, dtype, options)
    for out in outs:
        assert out["loaded"] == 0.0 and out["stepped"] == 0.0 and out["fresh"] == 0.0, out
        assert out["shapes"] == {"0.weight": [8, 8], "0.bias": [8], "2.weight": [4, 8],
                                 "2.bias": [4]}, out
    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    assert {k: v["shape"] for k, v in index["module"].items()} == {"2.weight": [4, 8],
                                                                   "2.bias": [4]}


def test_a_consolidated_optimizer_of_another_form_is_refused_before_any_write(tmp_path):
    results = _run(workers.consolidated_of_another_state_dtype, 2, str(tmp_path / "ck"))
    for result in results:
        assert "keeps its moments as" in result["error"]
        assert_equal(result["after"], result["before"])


def test_a_save_inside_a_gather_is_refused(tmp_path):
    """Writes to gathered stage-3 params reach the shards when their units
    are released: a checkpoint of the optimizer taken inside the context
    would miss them, so it is refused; the model alone gathers what it
    saves, and holds them."""
    results = _run(workers.save_inside_a_gather, 2, str(tmp_path))
    for result in results:
        assert "save after it closes" in result["refused"]
        assert result["found"] == {"model-inside": True, "after": True}
        assert not result["inside_written"]


def test_a_failure_on_one_rank_fails_every_rank_and_changes_nothing(tmp_path):
    path = str(tmp_path / "ck")
    _run(workers.save_and_continue, 2, path, "mlp", 2, torch.float32, {}, 1)
    results = _run(workers.one_rank_damaged, 2, path, "mlp", 2, torch.float32)
    assert "checksum" in results[1]["error"]
    assert "rank 1" in results[0]["error"]
    for rank in (0, 1):
        assert_equal(results[rank]["before"], results[rank]["after"])
