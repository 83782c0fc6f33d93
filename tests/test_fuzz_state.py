"""Fuzzing ZeroAdamW.load_state_dict with mutated state dicts.

Each case applies one to three mutations to a copy of a real state dict:
wrong, missing or extra keys, shapes, dtypes (int, bool, complex, other
floats), non-tensors, NaN, group counts and sizes, steps of every type,
hyperparameters good and bad. A slow reference decides from the result
whether the load must be refused. A refused load raises ValueError,
TypeError or KeyError and leaves params, state and param groups bitwise as
they were; a taken one gives what torch.optim.AdamW gives when it loads the
same dict. Case counts:
RLHFZ_FUZZ_EXAMPLES (see fuzz_support)."""
import copy
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlhfz
from fuzz_support import Tally, fuzz_settings, outcome, watchdog
from state_snapshots import assert_same, snapshot

REFUSALS = (ValueError, TypeError, KeyError)


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                               torch.nn.Linear(7, 3))


def groups_of(model):
    weights = [model[0].weight, model[2].weight]
    rest = [p for p in model.parameters() if all(p is not w for w in weights)]
    return [{"params": weights}, {"params": rest, "lr": 3e-3, "weight_decay": 0.0}]


def trained(**options):
    model = small_model()
    opt = rlhfz.ZeroAdamW(groups_of(model), lr=1e-2, weight_decay=0.1, **options)
    for step in range(2):
        opt.zero_grad()
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt


# ---- mutations, and the reference's verdict on them -----------------------------------------

def bad_tensor(draw, t):
    t = t.detach()                  # a leaf, as a loaded dict's tensors are
    kind = draw(st.sampled_from(["shape", "flat", "extra_dim", "int", "bool", "complex",
                                 "list", "number", "none", "scalar"]))
    if kind == "shape":
        return torch.zeros([s + 1 for s in t.shape] or [2])
    if kind == "flat":
        return t.reshape(-1).clone() if t.dim() != 1 else t.reshape(1, -1).clone()
    if kind == "extra_dim":
        return t.unsqueeze(0).clone()
    if kind in ("int", "bool", "complex"):
        return t.to({"int": torch.int32, "bool": torch.bool, "complex": torch.complex64}[kind])
    if kind == "scalar":
        return torch.tensor(1.0)
    return {"list": t.tolist(), "number": 1.0, "none": None}[kind]


def with_nonfinite(t, index, kind):
    """A copy of t (strides kept: an earlier mutation may have made it
    non-contiguous) with one element, the index-th in row-major order, NaN
    or Inf."""
    out = t.clone()
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), out.shape))
    out[position] = float(kind)
    return out


def good_tensor(draw, t):
    t = t.detach()                  # a leaf, as a loaded dict's tensors are
    kind = draw(st.sampled_from(["float64", "bfloat16", "float16", "nan", "inf", "strided",
                                 "grad", "zeros"]))
    if kind in ("float64", "bfloat16", "float16"):
        return t.to(getattr(torch, kind))
    if kind in ("nan", "inf") and t.numel():
        return with_nonfinite(t, draw(st.integers(0, t.numel() - 1)), kind)
    if kind == "strided" and t.dim() == 2:
        return t.t().contiguous().t()
    if kind == "grad":
        return t.clone().requires_grad_(True)
    return torch.zeros_like(t)


BAD_STEPS = [-1, 1.5, float("nan"), float("inf"), "3", None, [2], 10**400,
             torch.tensor([1.0, 2.0]), torch.tensor(-2.0), torch.tensor(0.5),
             torch.tensor(1 + 2j)]
GOOD_STEPS = [0, 7, 2.0, 2**40, torch.tensor(3.0), torch.tensor([4.0]),
              torch.tensor(5, dtype=torch.int64), torch.tensor(6.0, dtype=torch.float64)]
BAD_OPTIONS = [("lr", -1.0), ("lr", float("nan")), ("lr", "x"), ("betas", (1.5, 0.9)),
               ("betas", (0.9,)), ("betas", "ab"), ("betas", 0.9), ("eps", -1e-8),
               ("weight_decay", float("inf")), ("amsgrad", True), ("capturable", True),
               ("differentiable", True), ("foreach+fused", True)]
GOOD_OPTIONS = [("lr", 0.5), ("lr", 0), ("betas", (0.5, 0.6)), ("betas", [0.8, 0.9]),
                ("eps", 1e-3), ("weight_decay", 0.0), ("custom", 3), ("foreach", True),
                ("maximize", False)]


def hyperparameters_valid(group) -> bool:
    """The reference rule for a param group's options after a load."""
    if any(group.get(k) for k in ("amsgrad", "capturable", "differentiable")):
        return False
    if group.get("foreach") and group.get("fused"):
        return False
    try:
        lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        betas = [float(b) for b in group["betas"]]
    except (TypeError, ValueError):
        return False
    return (all(math.isfinite(v) and v >= 0 for v in (lr, eps, decay)) and len(betas) == 2
            and all(0 <= b < 1 for b in betas))


def reference_refuses(sd, current_groups) -> bool:
    """The slow reference: whether loading sd must be refused. It holds the
    dict to torch's format and to this optimizer's params."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) \
            or not isinstance(sd.get("param_groups"), list):
        return True
    saved_groups, state = sd["param_groups"], sd["state"]
    if len(saved_groups) != len(current_groups):
        return True
    index_to_param = {}
    for saved, mine in zip(saved_groups, current_groups):
        if len(saved["params"]) != len(mine["params"]):
            return True
        merged = {**{k: v for k, v in mine.items() if k != "params"}, **saved}
        if not hyperparameters_valid(merged):
            return True
        index_to_param.update(zip(saved["params"], mine["params"]))
    for key, entry in state.items():
        if key not in index_to_param or not isinstance(entry, dict) \
                or not {"step", "exp_avg", "exp_avg_sq"} <= set(entry):
            return True
        step = entry["step"]
        if torch.is_tensor(step):
            if step.numel() != 1 or step.is_complex():
                return True
            step = step.item()
        if not isinstance(step, (int, float)):
            return True
        try:
            step = float(step)
        except OverflowError:
            return True
        if not math.isfinite(step) or step < 0 or step != int(step):
            return True
        shape = tuple(index_to_param[key].shape)
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            if name not in entry:
                continue
            value = entry[name]
            if not torch.is_tensor(value) or tuple(value.shape) != shape \
                    or not value.is_floating_point():
                return True
    return False


@st.composite
def mutations(draw, sd):
    """Mutates sd (a deep copy) in place; returns it and what was done."""
    done = []
    for _ in range(draw(st.integers(1, 3))):
        state, groups = sd["state"], sd["param_groups"]
        keys = sorted(state, key=repr)
        op = draw(st.sampled_from(
            ["top_key", "groups_len", "group_params", "bad_option", "good_option",
             "drop_option", "stray_key", "entry_type", "entry_missing", "bad_step",
             "good_step", "bad_tensor", "good_tensor", "drop_entry", "extra_entry_key",
             "master_param", "duplicate_index"]))
        if not groups:
            break
        key = draw(st.sampled_from(keys)) if keys else None
        g = draw(st.integers(0, len(groups) - 1))
        if op == "top_key":
            del sd[draw(st.sampled_from(["state", "param_groups"]))]
            return sd, done + [op]
        if op == "groups_len":
            if draw(st.booleans()):
                groups.pop()
            else:
                groups.append(copy.deepcopy(groups[0]))
            done.append(op)
        elif op == "group_params":
            params = groups[g]["params"]
            if draw(st.booleans()) and params:
                params.pop(draw(st.integers(0, len(params) - 1)))
            else:
                params.append(draw(st.sampled_from([0, 99, "x"])))
            done.append(op)
        elif op in ("bad_option", "good_option"):
            name, value = draw(st.sampled_from(BAD_OPTIONS if op == "bad_option"
                                               else GOOD_OPTIONS))
            if name == "foreach+fused":
                groups[g]["foreach"] = groups[g]["fused"] = True
            else:
                groups[g][name] = value
            done.append(f"{op} {name}={value!r}")
        elif op == "drop_option":
            name = draw(st.sampled_from(sorted(k for k in groups[g] if k != "params")))
            del groups[g][name]
            done.append(f"{op} {name}")
        elif op == "stray_key":
            state[draw(st.sampled_from([99, -1, "0", 1.5]))] = copy.deepcopy(
                state[key]) if key is not None else {}
            done.append(op)
        elif op == "entry_type" and key is not None:
            state[key] = draw(st.sampled_from([None, [], 3, "state"]))
            done.append(op)
        elif op == "entry_missing" and key is not None and isinstance(state[key], dict):
            state[key].pop(draw(st.sampled_from(["step", "exp_avg", "exp_avg_sq"])), None)
            done.append(op)
        elif op == "bad_step" and key is not None and isinstance(state[key], dict):
            state[key]["step"] = draw(st.sampled_from(BAD_STEPS))
            done.append(f"{op} {state[key]['step']!r}")
        elif op == "good_step" and key is not None and isinstance(state[key], dict):
            state[key]["step"] = draw(st.sampled_from(GOOD_STEPS))
            done.append(f"{op} {state[key]['step']!r}")
        elif op == "bad_tensor" and key is not None and isinstance(state[key], dict) \
                and torch.is_tensor(state[key].get("exp_avg")):
            name = draw(st.sampled_from(["exp_avg", "exp_avg_sq", "master_param"]))
            state[key][name] = bad_tensor(draw, state[key]["exp_avg"])
            done.append(f"{op} {name}")
        elif op == "good_tensor" and key is not None and isinstance(state[key], dict):
            name = draw(st.sampled_from(["exp_avg", "exp_avg_sq"]))
            if torch.is_tensor(state[key].get(name)):
                state[key][name] = good_tensor(draw, state[key][name])
                done.append(f"{op} {name}")
        elif op == "drop_entry" and key is not None:
            del state[key]
            done.append(op)
        elif op == "extra_entry_key" and key is not None and isinstance(state[key], dict):
            state[key]["extra"] = torch.ones(2)
            done.append(op)
        elif op == "master_param" and key is not None and isinstance(state[key], dict) \
                and torch.is_tensor(state[key].get("exp_avg")):
            # a leaf, as in a loaded dict, even beside an exp_avg that requires grad
            state[key]["master_param"] = state[key]["exp_avg"].detach() + 1
            done.append(op)
        elif op == "duplicate_index" and len(groups[g]["params"]) > 1:
            params = groups[g]["params"]
            params[1] = params[0]          # the second param then has no index
            done.append(op)
    if draw(st.integers(0, 30)) == 0:
        return draw(st.sampled_from([None, [], "state_dict", {}])), ["not a state dict"]
    return sd, done


# ---- the oracle ------------------------------------------------------------------------------

def raw(t):
    """Bits, so NaN compares equal to itself."""
    t = t.detach().to(torch.float32).contiguous()
    return t.view(torch.int32)


def group_view(opt):
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in opt.param_groups]


def assert_like_torch(opt, reference, mutated):
    """The loaded optimizer holds what torch.optim.AdamW holds after loading
    the same dict: the same hyperparameters the dict names, and the same
    state (torch casts it to the params' dtype, float32 here)."""
    reference.load_state_dict(copy.deepcopy(mutated))
    ours, theirs = opt.state_dict(), reference.state_dict()
    for mine, saved in zip(opt.param_groups, mutated["param_groups"]):
        for k, v in saved.items():
            if k not in ("params", "param_names"):
                assert mine[k] == v, k
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        got = ours["state"][index]
        step = entry["step"]
        assert float(got["step"]) == float(step.item() if torch.is_tensor(step) else step)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(raw(got[name]), raw(entry[name])), (index, name)
    for state in opt.state.values():
        assert not any(torch.is_tensor(v) and v.requires_grad for v in state.values())


@pytest.mark.parametrize("options", [{}, {"offload": "cpu", "offload_ratio": 0.5}],
                         ids=["plain", "half-offloaded"])
def test_fuzz_load_state_dict(options):
    model, opt = trained(**options)
    reference = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.1)
    pristine = copy.deepcopy(opt.state_dict())
    initial, initial_groups = snapshot(model, opt), group_view(opt)
    tally = Tally(f"load_state_dict ({'plain' if not options else 'half-offloaded'})")

    @fuzz_settings()
    @given(data=st.data())
    def case(data):
        mutated, done = data.draw(mutations(copy.deepcopy(pristine)))
        refused = reference_refuses(mutated, opt.param_groups)
        # both foreach and fused: torch's own RuntimeError, as torch raises it
        allowed = REFUSALS + ((RuntimeError,) if any("foreach+fused" in d for d in done)
                              else ())
        with watchdog():
            kind, value = outcome(lambda: opt.load_state_dict(mutated), allowed)
        if kind == "raised":
            assert refused, f"a load that must work was refused: {value!r} after {done}"
            assert_same(initial, snapshot(model, opt))
            assert group_view(opt) == initial_groups
        else:
            assert not refused, f"a load that must be refused was taken: {done}"
            assert_like_torch(opt, reference, mutated)
            opt.load_state_dict(copy.deepcopy(pristine))    # back to the start
            assert_same(initial, snapshot(model, opt))
            for g, saved in zip(opt.param_groups, initial_groups):   # keys the dict added
                for k in set(g) - set(saved) - {"params"}:
                    del g[k]
            assert group_view(opt) == initial_groups
        tally.case("refused" if kind == "raised" else "loaded")

    case()
    tally.report()


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_a_strided_state_with_a_nonfinite_element_loads_as_torch_loads_it(kind):
    """A draw that make fuzz once failed on in its own generator: the
    "strided" mutation, then "nan" on the same tensor."""
    model, opt = trained()
    reference = torch.optim.AdamW(groups_of(model), lr=1e-2, weight_decay=0.1)
    sd = copy.deepcopy(opt.state_dict())
    entry = sd["state"][0]                          # the first Linear's weight: 2-D
    strided = entry["exp_avg"].t().contiguous().t()
    assert not strided.is_contiguous()
    entry["exp_avg"] = with_nonfinite(strided, 11, kind)
    assert not entry["exp_avg"].is_contiguous()
    assert not reference_refuses(sd, opt.param_groups)
    opt.load_state_dict(copy.deepcopy(sd))
    assert_like_torch(opt, reference, sd)
    flat = opt.state[model[0].weight]["exp_avg"].reshape(-1)
    assert (torch.isnan(flat[11]) if kind == "nan" else torch.isinf(flat[11]))
