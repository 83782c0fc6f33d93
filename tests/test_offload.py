"""Offload and reload between host memory and disk, in one process.

Every combination of params, grads and optimizer state round-trips exactly;
training with an offload/reload cycle between steps is bitwise the training
without; Parameter, grad and state tensors keep their identity; RSS drops
while the state is on disk and the files go on reload; a view held outside
is reported; and failures (no room, an unwritable directory, a failed
allocation) leave everything where it was.
"""
import gc
import itertools
import os
import warnings

import pytest
import torch

import rlhfz
from rlhfz import migrate
from rlhfz.engine import host_memory
import disk_files
from state_snapshots import assert_same, resident_kib, snapshot

WHATS = [combo for r in (1, 2, 3) for combo in itertools.combinations(
    ("params", "grads", "optimizer"), r)]


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(),
                                        torch.nn.Linear(40, 7)).to(dtype)
        self.norm = torch.nn.BatchNorm1d(7).to(dtype)      # buffers the optimizer does not own
        self.frozen = torch.nn.Parameter(torch.randn(5, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return self.norm(self.body(x)) * self.frozen.sum()


def make(dtype=torch.float32, seed=0, **options):
    torch.manual_seed(seed)
    model = Net(dtype)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, **options)
    return model, opt


def train_step(model, opt, step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 24, generator=gen).to(next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


def identities(model, opt):
    ids = [id(p) for p in model.parameters()] + [id(b) for b in model.buffers()]
    ids += [id(p.grad) for p in model.parameters() if p.grad is not None]
    ids += [id(v) for state in opt.state.values() for v in state.values()]
    ids += [id(g) for g in opt.param_groups] + [id(opt.state)]
    return ids


@pytest.mark.parametrize("what", WHATS, ids=["+".join(w) for w in WHATS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_combination_round_trips_exactly(tmp_path, what, dtype):
    model, opt = make(dtype)
    train_step(model, opt, 0)
    before, ids = snapshot(model, opt), identities(model, opt)
    opt.offload(what=what, to="disk", path=tmp_path)
    placement = opt.placement()
    for kind in what:
        names = {"optimizer": ("exp_avg", "exp_avg_sq") + (("master",) if dtype != torch.float32
                                                           else ())}.get(kind, (kind,))
        assert all(placement[name] == "disk" for name in names), placement
    assert disk_files.held(tmp_path)
    assert_same(before, snapshot(model, opt))          # readable where it is
    opt.reload()
    assert opt.placement() == {k: "host" for k in placement}
    assert disk_files.held(tmp_path) == []
    assert_same(before, snapshot(model, opt))
    assert identities(model, opt) == ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_through_offload_cycles_is_bitwise_the_same(tmp_path, dtype):
    plain, plain_opt = make(dtype)
    cycled, cycled_opt = make(dtype)
    for step in range(12):
        train_step(plain, plain_opt, step)
        train_step(cycled, cycled_opt, step)
        target = dict(to="disk", path=tmp_path) if step % 2 else dict(to="cpu")
        rlhfz.offload(cycled, cycled_opt, **target)
        rlhfz.reload(cycled, cycled_opt)
    assert_same(snapshot(plain, plain_opt), snapshot(cycled, cycled_opt))
    assert plain_opt.state_dict()["state"].keys() == cycled_opt.state_dict()["state"].keys()


def test_offloaded_state_cannot_step_and_reload_is_idempotent(tmp_path):
    model, opt = make()
    train_step(model, opt, 0)
    opt.offload(what="optimizer", to="disk", path=tmp_path)
    files = sorted(disk_files.held(tmp_path))
    opt.offload(what="optimizer", to="disk", path=tmp_path)      # already there
    assert sorted(disk_files.held(tmp_path)) == files
    with pytest.raises(RuntimeError, match="optimizer are offloaded: call reload"):
        train_step(model, opt, 1)
    with pytest.raises(RuntimeError, match="reload"):
        opt.clip_grad_norm_(1.0)
    opt.reload()
    opt.reload()
    train_step(model, opt, 1)


def test_rss_drops_on_disk_and_the_files_go_on_reload(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8 << 20)) for _ in range(2)]   # 64 MiB of params
    opt = rlhfz.ZeroAdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    owned = sum(sum(per_tier.values()) for per_tier in opt.memory_report().values())
    before = resident_kib()
    opt.offload(to="disk", path=tmp_path)
    after = resident_kib()
    assert before - after > 0.8 * owned / 1024, (before, after, owned)
    assert len(disk_files.held(tmp_path)) == 4      # one bucket: params, grads, exp_avg, exp_avg_sq
    opt.reload()
    assert disk_files.held(tmp_path) == []


def test_a_view_held_outside_is_reported(tmp_path):
    model, opt = make()
    train_step(model, opt, 0)
    held = model.body[0].weight.detach()[:2]            # shares the bucket's memory
    with pytest.warns(RuntimeWarning, match=r"\d+ bytes \(params\) could not be freed"):
        opt.offload(what="params", to="disk", path=tmp_path)
    report = opt.memory_report()
    assert report["params"]["held_elsewhere"] == report["params"]["disk"]
    del held
    assert "held_elsewhere" not in opt.memory_report()["params"]
    opt.reload()


def test_an_unwritable_directory_loses_nothing(tmp_path):
    model, opt = make()
    train_step(model, opt, 0)
    before, ids = snapshot(model, opt), identities(model, opt)
    with pytest.raises(OSError, match="disk buffer at /proc/self"):
        rlhfz.offload(model, opt, to="disk", path="/proc/self")
    assert opt.placement()["exp_avg"] == "host"
    assert_same(before, snapshot(model, opt))
    assert identities(model, opt) == ids
    train_step(model, opt, 1)


def test_a_failed_allocation_midway_loses_nothing(tmp_path, monkeypatch):
    model, opt = make(torch.bfloat16)
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    real = migrate._allocator

    def failing(to, path, pin_memory):
        allocate, calls = real(to, path, pin_memory), []

        def third_fails(nbytes):
            calls.append(nbytes)
            if len(calls) == 3:
                raise MemoryError("simulated: out of memory")
            return allocate(nbytes)
        return third_fails
    monkeypatch.setattr(migrate, "_allocator", failing)
    with pytest.raises(MemoryError, match="simulated"):
        opt.offload(to="disk", path=tmp_path)
    assert disk_files.held(tmp_path) == []                 # the two made were freed
    assert set(opt.placement().values()) == {"host"}
    assert_same(before, snapshot(model, opt))
    monkeypatch.undo()
    # A reload that fails leaves the state on disk, intact.
    opt.offload(to="disk", path=tmp_path)
    real_buffer, calls = opt.backend.buffer, []

    def failing_buffer(nbytes, **kwargs):
        calls.append(nbytes)
        if len(calls) == 2:
            raise MemoryError("simulated: no room to reload")
        return real_buffer(nbytes, **kwargs)
    monkeypatch.setattr(opt.backend, "buffer", failing_buffer)
    with pytest.raises(MemoryError, match="no room to reload"):
        opt.reload()
    assert opt.placement()["exp_avg"] == "disk"
    assert_same(before, snapshot(model, opt))
    monkeypatch.undo()
    opt.reload()
    assert_same(before, snapshot(model, opt))
    train_step(model, opt, 1)


def test_a_module_move_that_fails_takes_the_optimizers_back(tmp_path, monkeypatch):
    """rlhfz.offload moves the optimizer first, then the model's own tensors:
    if those fail, the optimizer is reloaded before the error comes out,
    and the context manager is never entered."""
    model, opt = make()
    train_step(model, opt, 0)
    before, ids = snapshot(model, opt), identities(model, opt)

    def no_room(*args, **kwargs):
        raise OSError(28, "simulated: no space left for the model's buffers")
    monkeypatch.setattr(migrate, "offload_module", no_room)
    with pytest.raises(OSError, match="simulated"):
        with rlhfz.offloaded(model, opt, to="disk", path=tmp_path):
            raise AssertionError("entered")
    assert set(opt.placement().values()) == {"host"}
    _assert_back_and_training(model, opt, tmp_path, before, ids)


def test_a_failed_module_move_takes_back_only_what_it_moved(tmp_path, monkeypatch):
    """Grads offloaded before, then a rlhfz.offload whose module move fails:
    the params and optimizer state it moved come back, the grads stay."""
    model, opt = make()
    train_step(model, opt, 0)
    opt.offload(what=("grads",), to="disk", path=tmp_path)

    def no_room(*args, **kwargs):
        raise OSError(28, "simulated: no space left for the model's buffers")
    monkeypatch.setattr(migrate, "offload_module", no_room)
    with pytest.raises(OSError, match="simulated"):
        rlhfz.offload(model, opt, to="disk", path=tmp_path)
    placement = opt.placement()
    assert placement.pop("grads") == "disk" and set(placement.values()) == {"host"}
    opt.reload()
    train_step(model, opt, 1)


@pytest.mark.parametrize("what", [("params",), ("grads",), ("optimizer",)])
def test_a_param_swapped_before_an_offload_is_kept(tmp_path, what):
    """p.data = t since the last step is adopted by the next step; an
    offload cycle between them keeps it, as the step would have."""
    model, opt = make()
    plain, plain_opt = make()
    for m, o in ((model, opt), (plain, plain_opt)):
        train_step(m, o, 0)
        m.body[0].weight.data = torch.full_like(m.body[0].weight, 0.5)
    opt.offload(what=what, to="disk", path=tmp_path)
    opt.reload()
    assert bool((model.body[0].weight == 0.5).all())
    for m, o in ((model, opt), (plain, plain_opt)):
        train_step(m, o, 1)
    assert_same(snapshot(plain, plain_opt), snapshot(model, opt))


def test_a_cast_before_an_offload_is_refused_as_the_step_refuses_it(tmp_path):
    model, opt = make()
    train_step(model, opt, 0)
    model.double()
    with pytest.raises(RuntimeError, match="moved or cast"):
        opt.offload(what=("optimizer",), to="disk", path=tmp_path)
    assert next(model.parameters()).dtype == torch.float64
    assert set(opt.placement().values()) == {"host"}


def test_writes_behind_the_optimizer_reach_a_checkpoint_taken_while_offloaded(tmp_path):
    """bf16 params written in place, then offloaded: the checkpoint's fp32
    master holds the write, as one taken without the offload does."""
    model, opt = make(torch.bfloat16)
    plain, plain_opt = make(torch.bfloat16)
    for m, o in ((model, opt), (plain, plain_opt)):
        train_step(m, o, 0)
        with torch.no_grad():
            m.body[0].weight.add_(0.01)
    (tmp_path / "away").mkdir()
    opt.offload(to="disk", path=tmp_path / "away")
    rlhfz.save_checkpoint(tmp_path / "offloaded", model, opt)
    rlhfz.save_checkpoint(tmp_path / "plain", plain, plain_opt)
    for name in ("offloaded", "plain"):
        m, o = make(torch.bfloat16, seed=3)
        rlhfz.load_checkpoint(tmp_path / name, m, o)
        train_step(m, o, 1)
        if name == "offloaded":
            first = snapshot(m, o)
    assert_same(first, snapshot(m, o))


@pytest.mark.parametrize("call", ["optimizer", "module", "context"])
def test_the_held_memory_warning_names_the_callers_line(tmp_path, call):
    model, opt = make()
    train_step(model, opt, 0)
    held = model.body[0].weight.detach()[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "optimizer":
            opt.offload(what="params", to="disk", path=tmp_path)
            opt.reload()
        elif call == "module":
            rlhfz.offload(model, opt, what="params", to="disk", path=tmp_path)
            rlhfz.reload(model, opt)
        else:
            with rlhfz.offloaded(model, opt, what="params", to="disk", path=tmp_path):
                pass
    held_warnings = [w for w in caught if "could not be freed" in str(w.message)]
    assert held_warnings and {w.filename for w in held_warnings} == {__file__}
    del held


def test_held_memory_is_reported_under_its_own_kind(tmp_path):
    model, opt = make()
    train_step(model, opt, 0)
    held = opt.state[model.body[0].weight]["exp_avg"][:2]     # shares the optimizer's memory
    with pytest.warns(RuntimeWarning, match=r"\(exp_avg\) could not be freed"):
        opt.offload(what="optimizer", to="disk", path=tmp_path)
    report = opt.memory_report()
    assert report["exp_avg"]["held_elsewhere"] == report["exp_avg"]["disk"]
    assert "held_elsewhere" not in report["master"]
    del held
    opt.reload()


def test_module_tensors_the_optimizer_does_not_own_move_too(tmp_path):
    model, opt = make()
    train_step(model, opt, 0)
    before, ids = snapshot(model, opt), identities(model, opt)
    with rlhfz.offloaded(model, opt, to="disk", path=tmp_path):
        assert model.norm.running_mean.data_ptr() != before["norm.running_mean"].data_ptr()
        files = disk_files.held(tmp_path)
        # the bucket's four buffers, and the norm's running_mean, running_var and
        # num_batches_tracked (int64), which the optimizer does not own
        assert len(files) == 4 + 3
        assert_same(before, snapshot(model, opt))
    _assert_back_and_training(model, opt, tmp_path, before, ids)


def _assert_back_and_training(model, opt, directory, before, ids):
    """No file left, every value and identity as before, and a step works."""
    assert disk_files.held(directory) == []
    assert_same(before, snapshot(model, opt))
    assert identities(model, opt) == ids
    train_step(model, opt, 1)


def test_the_context_manager_reloads_when_the_block_raises(tmp_path):
    model, opt = make()
    train_step(model, opt, 0)
    with pytest.raises(KeyError):
        with rlhfz.offloaded(model, opt, to="disk", path=tmp_path):
            raise KeyError("inference failed")
    assert disk_files.held(tmp_path) == []
    assert set(opt.placement().values()) == {"host"}
    train_step(model, opt, 1)


def _reference_on_disk(path):
    """A model with no optimizer, offloaded to files, and its state before."""
    torch.manual_seed(0)
    reference = Net()
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    rlhfz.offload(reference, to="disk", path=path)
    assert len(disk_files.held(path)) == len(before)
    return reference, before


def test_a_model_without_an_optimizer(tmp_path):
    reference, before = _reference_on_disk(tmp_path)
    rlhfz.offload(reference, to="disk", path=tmp_path)       # already offloaded
    assert len(disk_files.held(tmp_path)) == len(before)
    rlhfz.reload(reference)
    after = reference.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert disk_files.held(tmp_path) == []


def test_a_second_module_offload_goes_where_it_names(tmp_path):
    reference, before = _reference_on_disk(tmp_path)
    rlhfz.offload(reference, to="cpu")                        # out of the files, into RAM
    assert disk_files.held(tmp_path) == []
    assert all(torch.equal(before[k], v) for k, v in reference.state_dict().items())
    rlhfz.offload(reference, to="disk", path=tmp_path)        # and back to disk
    assert len(disk_files.held(tmp_path)) == len(before)
    rlhfz.reload(reference)
    assert disk_files.held(tmp_path) == []
    after = reference.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].device.type == "cpu" for k in before)


def test_a_module_tensor_held_outside_is_reported(tmp_path):
    torch.manual_seed(0)
    reference = Net()
    held = reference.body[0].weight.detach()[:2]        # shares the weight's memory
    nbytes = reference.body[0].weight.untyped_storage().nbytes()
    with pytest.warns(RuntimeWarning, match=rf"{nbytes} bytes of the model's own") as caught:
        rlhfz.offload(reference, to="disk", path=tmp_path)
    assert caught[0].filename == __file__
    del held
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rlhfz.offload(reference, to="cpu")              # nothing held now: no warning
    rlhfz.reload(reference)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(what="weights"), ValueError, "what must name some of"),
    (dict(what=()), ValueError, "what must name some of"),
    (dict(to="gpu"), ValueError, "to must be 'cpu' or 'disk'"),
    (dict(to="disk"), ValueError, "needs path="),
    (dict(to="disk", path="/nonexistent/dir"), FileNotFoundError, "is not a directory"),
    (dict(to="cpu", path="/tmp"), ValueError, "path= is for to='disk'"),
])
def test_bad_arguments_change_nothing(kwargs, error, message):
    model, opt = make()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    with pytest.raises(error, match=message):
        opt.offload(**kwargs)
    with pytest.raises(error, match=message):
        rlhfz.offload(model, opt, **kwargs)
    assert_same(before, snapshot(model, opt))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(model, opt, 1)


def test_the_top_level_names_stay_functions(tmp_path):
    model, opt = make()
    opt.offload(to="disk", path=tmp_path)      # imports the module behind them
    opt.reload()
    assert callable(rlhfz.offload) and callable(rlhfz.reload) and callable(rlhfz.offloaded)
    rlhfz.offload(model, opt, to="disk", path=tmp_path)
    rlhfz.reload(model, opt)


# ---- training with host-resident optimizer state (offload="cpu") ----------------------

@pytest.mark.parametrize("ratio", [0.0, 0.37, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_host_resident_state_steps_bitwise_like_the_plain_optimizer(ratio, dtype):
    plain, plain_opt = make(dtype)
    hosted, hosted_opt = make(dtype, offload="cpu", offload_ratio=ratio)
    for step in range(8):
        train_step(plain, plain_opt, step)
        train_step(hosted, hosted_opt, step)
    assert_same(snapshot(plain, plain_opt), snapshot(hosted, hosted_opt))
    shard = sum(b.layout.shard_numel for b in hosted_opt.engine.buckets)
    host = sum(b.layout.shard_numel - b.shard.split for b in hosted_opt.engine.buckets)
    assert abs(host - ratio * shard) <= len(hosted_opt.engine.buckets)
    report = hosted_opt.memory_report()
    assert report["exp_avg"]["host"] == 4 * shard         # both parts are host memory here
    if 0 < ratio < 1:
        # some param's state crosses the split: its state tensors are kept current
        assert any(b.state.stitched for b in hosted_opt.engine.buckets)


def test_host_resident_state_loads_and_saves_in_torch_format():
    torch.manual_seed(0)
    model, opt = make(torch.float32, offload="cpu", offload_ratio=0.5)
    train_step(model, opt, 0)
    saved = opt.state_dict()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    torch_opt.load_state_dict(saved)
    other, other_opt = make(torch.float32, seed=1, offload="cpu", offload_ratio=0.5)
    other.load_state_dict(model.state_dict())
    other_opt.load_state_dict(torch_opt.state_dict())
    for step in range(1, 4):
        train_step(model, opt, step)
        train_step(other, other_opt, step)
    assert_same(snapshot(model, opt), snapshot(other, other_opt))


def test_offload_ratio_is_checked():
    for bad in (-0.1, 1.5, "half", None):
        with pytest.raises(ValueError, match="offload_ratio must be a number in"):
            make(offload="cpu", offload_ratio=bad)
    with pytest.raises(ValueError, match="offload must be None or 'cpu'"):
        make(offload="nvme")


class _PinningRefused:
    """rlhfz._C as a machine with CUDA whose pinning fails would show it."""

    def __init__(self, real):
        self.real, self.pinned_asks = real, 0

    def build_info(self):
        return {**self.real.build_info(), "cuda": True}

    def Buffer(self, nbytes, tier="host", **kwargs):
        if tier == "pinned":
            self.pinned_asks += 1
            raise MemoryError("cudaHostAlloc: out of memory (simulated)")
        return self.real.Buffer(nbytes, tier, **kwargs)


def test_a_refused_pin_falls_back_to_pageable_memory(monkeypatch):
    fake = _PinningRefused(host_memory._C)
    monkeypatch.setattr(host_memory, "_C", fake)
    monkeypatch.setattr(host_memory.PinnedPool, "noticed", False)
    with pytest.warns(RuntimeWarning, match="pinning 4096 bytes failed .* pageable") as caught:
        buffer = host_memory.host_buffer(4096, True)
    assert caught[0].filename == __file__
    assert buffer.tier == "host" and fake.pinned_asks == 1
    assert host_memory.host_buffer(64, False).tier == "host" and fake.pinned_asks == 1


def test_auto_pinning_stops_at_its_budget(monkeypatch):
    fake = _PinningRefused(host_memory._C)
    monkeypatch.setattr(host_memory, "_C", fake)
    monkeypatch.setattr(host_memory.PinnedPool, "noticed", False)
    monkeypatch.setenv("RLHFZ_PIN_BUDGET_BYTES", "1000")
    assert host_memory.pin_budget() == 1000
    with pytest.warns(RuntimeWarning, match="at its budget \\(1000 bytes"):
        buffer = host_memory.host_buffer(4096, "auto")
    assert buffer.tier == "host" and fake.pinned_asks == 0      # not even tried
    monkeypatch.delenv("RLHFZ_PIN_BUDGET_BYTES")
    assert 0 < host_memory.pin_budget() <= host_memory._available_ram()


@pytest.mark.parametrize("value", ["abc", "1e9", "8M", "-5"])
def test_a_bad_pin_budget_names_its_variable(monkeypatch, value):
    monkeypatch.setenv("RLHFZ_PIN_BUDGET_BYTES", value)
    with pytest.raises(ValueError, match="RLHFZ_PIN_BUDGET_BYTES must be .*" + value):
        host_memory.pin_budget()


def test_each_optimizer_after_a_release_hears_of_its_fall_back(monkeypatch):
    monkeypatch.setattr(host_memory, "_C", _PinningRefused(host_memory._C))
    monkeypatch.setattr(host_memory.PinnedPool, "noticed", False)
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="pageable"):
            host_memory.host_buffer(4096, True)
        host_memory.release_pinned()       # what an optimizer's close() does


def test_pinned_buffers_pooled_for_a_dropped_optimizer_are_unpinned():
    """reload() pools the pinned buffers it emptied for the next offload;
    an optimizer dropped without close() must not leave them pinned."""
    class Pinned:
        tier, exports, nbytes = "pinned", 0, 4096

    class Engine:
        pass

    kept, dropped = Engine(), Engine()
    base = host_memory.PinnedPool.pooled()
    host_memory.PinnedPool.give(Pinned(), None, kept)
    host_memory.PinnedPool.give(Pinned(), None, dropped)
    assert host_memory.PinnedPool.pooled() == base + 8192
    del dropped
    gc.collect()
    assert host_memory.PinnedPool.pooled() == base + 4096
    assert host_memory.PinnedPool.take(4096) is not None


def test_pinned_memory_counts_the_pool_against_the_budget(monkeypatch):
    class Pinned:
        tier, exports, nbytes = "pinned", 0, 8192

    class Engine:
        pass

    monkeypatch.setenv("RLHFZ_PIN_BUDGET_BYTES", "123456")
    before = rlhfz.pinned_memory()
    assert before["budget"] == 123456
    giver = Engine()
    host_memory.PinnedPool.give(Pinned(), None, giver)
    after = rlhfz.pinned_memory()
    assert after["pooled"] == before["pooled"] + 8192
    del giver
    gc.collect()
    assert rlhfz.pinned_memory()["pooled"] == before["pooled"]
