"""What a user changes behind the optimizer, on the CPU, held to torch.

torch's AdamW steps from whatever the params, optimizer.state and
param_groups hold when step() runs. ZeroAdamW keeps its own copies (fp32
masters, host parts, its buckets), so each edit must reach them, or be
refused with nothing changed: values written into params in place,
optimizer.state entries cleared, replaced or written, param lists edited.
A state dict that fails while it loads changes nothing, and
clip_grad_norm_ treats non-finite and overflowing norms as torch does.
(Storage swaps, `param.data = t`, are in test_storage_swaps.py.)
"""
import copy
import threading
from collections import defaultdict

import pytest
import torch

import dist_workers as workers
import rlhfz
from rlhfz.launch import run_ranks


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(dtype)


def _backward(model, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 8, generator=gen).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()))


def _assert_same_snapshot(before, after):
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    assert before[1]["param_groups"] == after[1]["param_groups"]
    assert before[1]["state"].keys() == after[1]["state"].keys()
    for key, entry in before[1]["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after[1]["state"][key][name]), (key, name)


# ---- values written into params in place --------------------------------------------

def _write_loaded(net, loaded):
    net.load_state_dict({k: v.to(net[0].weight.dtype) for k, v in loaded.items()})


def _write_one_element(net, loaded):
    with torch.no_grad():
        net[0].weight[1, 2] = 0.75


def _write_fill(net, loaded):
    with torch.no_grad():
        net[2].bias.fill_(-0.5)


WRITES = {"load_state_dict": _write_loaded, "one element": _write_one_element,
          "fill_": _write_fill}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_in_place_writes_to_16_bit_params_are_stepped_from(write, dtype, stage):
    """16-bit params step from an fp32 master: the reference is torch's
    AdamW on fp32 params, which play that master, with the same grads. The
    writes are exact in 16 bits, so both sides hold the same values after
    them; the elements a write left keep the master's precision."""
    model = _model(dtype)
    ref = _model(torch.float32)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q.float())
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loaded = _model(dtype, seed=7).state_dict()
    for step in range(8):
        if step == 3:
            WRITES[write](model, loaded)
            WRITES[write](ref, loaded)
        opt.zero_grad()
        _backward(model, step)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q.to(dtype)), (write, step)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_loaded_model_trains_from_the_loaded_weights_under_offload(stage):
    """offload="cpu" steps the host part from its own fp32 copy: weights
    loaded after the optimizer was built must reach it."""
    model, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, offload="cpu",
                          offload_ratio=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loaded = _model(seed=5).state_dict()
    for step in range(6):
        if step == 2:
            model.load_state_dict(loaded)
            ref.load_state_dict(loaded)
        for net, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _backward(net, step)
            o.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


# ---- optimizer.state edited ----------------------------------------------------------

def _clear(opt, model):
    opt.state.clear()


def _delete_one(opt, model):
    del opt.state[model[0].weight]


def _new_dict(opt, model):
    opt.state = defaultdict(dict)


def _empty_entry(opt, model):
    opt.state[model[2].bias] = {}


def _zero_exp_avg(opt, model):
    p = model[0].weight
    opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])


def _replace_step(opt, model):
    opt.state[model[2].weight]["step"] = torch.tensor(1.0)


def _new_entry(opt, model):
    p = model[0].bias
    opt.state[p] = {name: value.clone() * (2 if name == "exp_avg_sq" else 1)
                    for name, value in opt.state[p].items()}


def _write_in_place(opt, model):
    opt.state[model[0].weight]["exp_avg_sq"].mul_(3.0)


EDITS = {"clear": _clear, "del": _delete_one, "new dict": _new_dict, "empty entry": _empty_entry,
         "exp_avg replaced": _zero_exp_avg, "step replaced": _replace_step,
         "entry replaced": _new_entry, "written in place": _write_in_place}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("options", [dict(stage=0), dict(stage=1), dict(stage=2),
                                     dict(stage=2, offload="cpu", offload_ratio=0.5),
                                     dict(stage=2, state_dtype="bf16")],
                         ids=["stage0", "stage1", "stage2", "offload-half", "bf16-states"])
def test_optimizer_state_edits_are_stepped_from_as_torch_does(edit, options):
    model, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(7):
        if step == 3:
            EDITS[edit](opt, model)
            EDITS[edit](ref_opt, ref)
            if options.get("state_dtype") == "bf16":    # the reference holds what rlhfz stores
                for p, q in zip(model.parameters(), ref.parameters()):
                    for name in ("exp_avg", "exp_avg_sq"):
                        if p in opt.state and name in opt.state[p]:
                            ref_opt.state[q][name] = opt.state[p][name].float().clone()
        for net, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _backward(net, step)
            o.step()
        tol = 2e-2 if options.get("state_dtype") == "bf16" else 1e-6
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol)
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert float(ours[key]["step"]) == float(theirs[key]["step"])


def test_a_cleared_state_is_left_out_of_the_state_dict_made_before_the_next_step():
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2)
    _backward(model, 0)
    opt.step()
    del opt.state[model[0].weight]
    assert sorted(opt.state_dict()["state"]) == [1, 2, 3]
    _backward(model, 1)
    opt.step()
    assert float(opt.state[model[0].weight]["step"]) == 1.0


def _lose_a_key(opt, model):
    del opt.state[model[0].weight]["exp_avg"]


def _wrong_shape(opt, model):
    opt.state[model[0].weight]["exp_avg_sq"] = torch.zeros(3)


def _bad_step(opt, model):
    opt.state[model[2].bias]["step"] = -1


def _entry_before_its_first_step(opt, model):
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    opt.state[extra] = {"step": torch.tensor(4.0), "exp_avg": torch.ones(3),
                        "exp_avg_sq": torch.ones(3)}


REFUSED = {"a key lost": _lose_a_key, "wrong shape": _wrong_shape, "bad step": _bad_step,
           "an entry before its first step": _entry_before_its_first_step}


@pytest.mark.parametrize("edit", sorted(REFUSED))
def test_state_edits_no_step_can_take_are_refused_and_change_nothing(edit):
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2, stage=2)
    _backward(model, 0)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    buffers = [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg"].clone())
               for p in model.parameters()]        # views of the optimizer's buffers
    REFUSED[edit](opt, model)
    _backward(model, 1)
    with pytest.raises(ValueError, match="optimizer.state"):
        opt.step()
    for p, b, (view, m) in zip(model.parameters(), before, buffers):
        assert torch.equal(p, b)
        assert torch.equal(view, m)


# ---- param_groups edited ---------------------------------------------------------------

def _append_param(opt, model):
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(2)))


def _drop_param(opt, model):
    opt.param_groups[0]["params"].pop()


def _new_list(opt, model):
    opt.param_groups[0]["params"] = list(reversed(opt.param_groups[0]["params"]))


def _append_group(opt, model):
    opt.param_groups.append(dict(opt.param_groups[0], params=[]))


@pytest.mark.parametrize("edit", [_append_param, _drop_param, _new_list, _append_group],
                         ids=["append", "pop", "new list", "new group"])
def test_param_lists_edited_in_place_are_refused_before_the_step(edit):
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2)
    _backward(model, 0)
    opt.step()
    edit(opt, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="add_param_group"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


# ---- load_state_dict fails whole ----------------------------------------------------------

def _meta_moment(sd):
    sd["state"][3]["exp_avg"] = torch.empty(4, device="meta")


def _uncopyable_option(sd):
    sd["param_groups"][0]["tag"] = threading.Lock()


@pytest.mark.parametrize("spoil", [_meta_moment, _uncopyable_option], ids=["meta", "uncopyable"])
def test_a_state_dict_that_cannot_be_loaded_changes_nothing(spoil):
    donor_model = _model(seed=3)
    donor = torch.optim.AdamW(donor_model.parameters(), lr=0.5)
    _backward(donor_model, 0)
    donor.step()
    sd = copy.deepcopy(donor.state_dict())
    spoil(sd)
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-2)
    _backward(model, 0)
    opt.step()
    before = _snapshot(model, opt)
    with pytest.raises((ValueError, TypeError)):
        opt.load_state_dict(sd)
    _assert_same_snapshot(before, _snapshot(model, opt))


# ---- clip_grad_norm_ at the edges ---------------------------------------------------------

def _clip_pair(dtype, grads, stage):
    out = []
    for _ in range(2):
        params = [torch.nn.Parameter(torch.zeros(len(g), dtype=dtype)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g, dtype=dtype)
        out.append(params)
    return out[0], out[1], rlhfz.ZeroAdamW(out[1], stage=stage, nonfinite=None)


CLIP_CASES = {
    "nan": (torch.float32, [[float("nan"), 1.0, 2.0], [3.0, 4.0]]),
    "inf": (torch.float32, [[float("inf"), 1.0, 2.0], [3.0, 4.0]]),
    "overflow": (torch.float32, [[1e19] * 6, [1.0, 2.0]]),
    "bf16": (torch.bfloat16, [[0.3, -1.7, 2.25, 0.01], [5.5, -0.125, 3.0]]),
    "fp16": (torch.float16, [[0.3, -1.7, 2.25, 0.01], [5.5, -0.125, 3.0]]),
}


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("case", sorted(CLIP_CASES))
def test_clip_grad_norm_matches_torch_at_the_edges(case, stage):
    """The norm's dtype, and its value and the clipped grads bit for bit
    in fp32. With 16-bit grads torch rounds each param's norm to 16 bits
    before it combines them, rlhfz rounds the total once: one unit in the
    last place apart at most."""
    dtype, grads = CLIP_CASES[case]
    theirs, ours, opt = _clip_pair(dtype, grads, stage)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    got = opt.clip_grad_norm_(0.1)
    assert got.dtype == expected.dtype
    ulp = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=ulp, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True, rtol=ulp, atol=0)


@pytest.mark.parametrize("stage", [1, 2])
def test_writes_and_a_cleared_state_reach_every_ranks_shard(stage):
    """Across 2 gloo ranks, each holding part of the masters and moments: a
    write that crosses the shard boundary and state.clear() on every rank
    train as torch's AdamW on fp32 params (the master) does."""
    steps, edit_at = 12, 5
    results = run_ranks(workers.bf16_edits, 2, steps, stage, edit_at)
    ref_params = workers.bf16_reference(steps, edit_at)
    for result in results:
        state = result["state_dict"]["state"]
        for i, (p, q) in enumerate(zip(result["params"], ref_params)):
            torch.testing.assert_close(state[i]["master_param"], q.detach(), rtol=1e-5,
                                       atol=1e-6)
            assert float(state[i]["step"]) == steps - edit_at
            assert torch.equal(p, state[i]["master_param"].bfloat16())


# ---- what the state read out carries -------------------------------------------------

def _edit_entries(model, opt):
    first, second = list(model.parameters())[:2]
    opt.state[first]["exp_avg"] = torch.full_like(opt.state[first]["exp_avg"], 0.25)
    opt.state[second]["step"] = torch.tensor(7.0)
    with torch.no_grad():
        model[2].weight.fill_(0.5)             # reaches a 16-bit param's master


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dicts_and_checkpoints_carry_the_edits_a_step_would_take(tmp_path, dtype,
                                                                       state_dtype):
    """state_dict() and save_checkpoint right after edits hold them, so a run
    resumed from either goes on as the edited run does."""
    runs = {}
    for how in ("edited", "state_dict", "checkpoint"):
        model = _model(dtype)
        opt = rlhfz.ZeroAdamW(model, lr=1e-2, state_dtype=state_dtype, min_8bit_size=0)
        for seed in range(2):
            _backward(model, seed)
            opt.step()
            opt.zero_grad()
        _edit_entries(model, opt)
        if how == "state_dict":
            saved = copy.deepcopy(opt.state_dict())
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            model = _model(dtype, seed=1)
            model.load_state_dict(weights)
            opt = rlhfz.ZeroAdamW(model, lr=1e-2, state_dtype=state_dtype, min_8bit_size=0)
            opt.load_state_dict(saved)
        elif how == "checkpoint":
            rlhfz.save_checkpoint(tmp_path, model, opt)
            model = _model(dtype, seed=1)
            opt = rlhfz.ZeroAdamW(model, lr=1e-2, state_dtype=state_dtype, min_8bit_size=0)
            rlhfz.load_checkpoint(tmp_path, model, opt)
        _backward(model, 5)
        opt.step()
        runs[how] = [p.detach().clone() for p in model.parameters()]
    for how in ("state_dict", "checkpoint"):
        for a, b in zip(runs[how], runs["edited"]):
            assert torch.equal(a, b), how


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_writes_into_a_state_that_straddles_the_offload_split_are_read_out(tmp_path,
                                                                           state_dtype):
    results = {}
    for options in ({}, {"offload": "cpu", "offload_ratio": 0.5}):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1000))
        opt = rlhfz.ZeroAdamW([p], state_dtype=state_dtype, min_8bit_size=0, **options)
        for seed in range(2):
            p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
            opt.step()
        opt.state[p]["exp_avg"].zero_()
        saved = opt.state_dict()["state"][0]["exp_avg"].clone()
        rlhfz.save_checkpoint(tmp_path / str(len(options)), None, opt)
        p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(2))
        opt.step()
        results[len(options)] = (saved, p.detach().clone())
    assert not results[0][0].any()
    for a, b in zip(results[0], results[2]):
        assert torch.equal(a, b)
