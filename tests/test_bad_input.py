"""Bad input gets a clear exception, and leaves the optimizer as it was."""
import copy

import numpy as np
import pytest
import torch

import rlhfz


def _snapshot(opt, params):
    """Everything a failed call must not change: params, grads, state."""
    return (copy.deepcopy(opt.state_dict()),
            [p.detach().clone() for p in params],
            [None if p.grad is None else p.grad.clone() for p in params])


def _assert_unchanged(opt, params, snapshot):
    state, values, grads = snapshot
    after_state, after_values, after_grads = _snapshot(opt, params)
    for a, b in zip(values, after_values):
        assert torch.equal(a, b)
    for a, b in zip(grads, after_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert state["param_groups"] == after_state["param_groups"]
    assert state["state"].keys() == after_state["state"].keys()
    for key, entry in state["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after_state["state"][key][name]), (key, name)


def _trained(steps=3, dtype=torch.float32):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 3).to(dtype)),
              torch.nn.Parameter(torch.randn(3).to(dtype))]
    opt = rlhfz.ZeroAdamW(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape).to(dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(3, dtype=torch.int64),
    lambda: torch.zeros(3, dtype=torch.int32),
    lambda: torch.zeros(3, dtype=torch.uint8),
    lambda: torch.zeros(3, dtype=torch.bool),
    lambda: torch.zeros(3, dtype=torch.complex64),
    lambda: torch.zeros(3, dtype=torch.float64),
], ids=["int64", "int32", "uint8", "bool", "complex64", "float64"])
def test_unsupported_param_dtypes_raise(make):
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        rlhfz.ZeroAdamW([make()])


def test_sparse_param_raises():
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    with pytest.raises(ValueError, match="sparse"):
        rlhfz.ZeroAdamW([sparse])


def test_meta_device_params_raise():
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="not meta"):
        rlhfz.ZeroAdamW([meta])


def test_non_tensor_param_raises():
    with pytest.raises(TypeError, match="Tensors"):
        rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(2)), 3.0])


def test_duplicate_param_raises_within_and_across_groups():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="more than once"):
        rlhfz.ZeroAdamW([p, q, p])
    with pytest.raises(ValueError, match="more than one parameter group"):
        rlhfz.ZeroAdamW([{"params": [p]}, {"params": [q, p]}])


def test_failed_add_param_group_leaves_optimizer_and_model_alone():
    params, opt = _trained()
    snap = _snapshot(opt, params)
    extra = torch.nn.Parameter(torch.ones(4))
    before_ptr = extra.data_ptr()
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [extra, params[0]]})
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group({"params": [extra], "lr": -1.0})
    assert len(opt.param_groups) == 1 and len(opt.engine.buckets) == 1
    assert extra.data_ptr() == before_ptr
    _assert_unchanged(opt, params, snap)


@pytest.mark.parametrize("kwargs, match", [
    ({"amsgrad": True}, "amsgrad"),
    ({"capturable": True}, "capturable"),
    ({"differentiable": True}, "differentiable"),
    ({"foreach": True, "fused": True}, "fused"),
    ({"lr": -1e-3}, "learning rate"),
    ({"betas": (1.0, 0.999)}, "beta"),
    ({"betas": (0.9, -0.1)}, "beta"),
    ({"eps": -1.0}, "epsilon"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"stage": 4}, "stage"),
    ({"offload": "gpu"}, "offload"),
    ({"offload_ratio": 1.5}, "offload_ratio"),
    ({"offload_ratio": True}, "offload_ratio"),
    ({"offload_ratio": 0.5}, "needs offload='cpu'"),     # it would change nothing
    ({"pin_memory": "sometimes"}, "pin_memory"),
    ({"pin_memory": 0}, "pin_memory"),        # == False, but would pin without a budget
    ({"pin_memory": 1.0}, "pin_memory"),
    ({"nonfinite": "ignore"}, "nonfinite"),
    ({"reduce_dtype": torch.float16}, "reduce_dtype"),
])
def test_unsupported_or_invalid_options_raise(kwargs, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(2))], **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"betas": (0, 0.999)},
    {"betas": (0.9, 1)},
    {"betas": (torch.tensor(0.9), 0.999)},
    {"betas": (torch.tensor(0.9), torch.tensor(0.999)), "foreach": True},
    {"lr": torch.tensor(1e-3), "foreach": True},
    {"lr": torch.tensor([1e-3, 1e-3])},
    {"lr": -1.0, "betas": (0, 0.999)},
])
def test_torchs_constructor_refusals_are_refused_in_its_words(kwargs):
    """What torch.optim.AdamW refuses, ZeroAdamW refuses with the same
    exception and message."""
    with pytest.raises(Exception) as theirs:
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(2))], **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kwargs", [
    {"betas": (torch.tensor(0.9), torch.tensor(0.999))},
    {"lr": torch.tensor(1e-3)},
    {"betas": [0.9, 0.99]},
])
def test_what_torchs_constructor_takes_zero_adamw_takes(kwargs):
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], **kwargs)
    rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_a_numpy_offload_ratio_is_a_number():
    opt = rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(2))], offload="cpu",
                          offload_ratio=np.float32(0.5))
    assert opt.offload_ratio == 0.5


def test_unknown_keyword_raises():
    with pytest.raises(TypeError):
        rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(2))], nesterov=True)


def test_stage3_needs_the_module():
    with pytest.raises(ValueError, match="nn.Module"):
        rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(2))], stage=3)
    rlhfz.ZeroAdamW(torch.nn.Linear(2, 2), stage=3)     # single process: accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_grad_raise_policy_changes_nothing(dtype, bad):
    params, opt = _trained(dtype=dtype)
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype)
    params[1].grad[2] = bad
    snap = _snapshot(opt, params)
    with pytest.raises(rlhfz.NonFiniteGradError, match=r"\['params'\]\[1\]"):
        opt.step()
    _assert_unchanged(opt, params, snap)


def test_nonfinite_grad_skip_policy_skips_the_step():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(6))]
    opt = rlhfz.ZeroAdamW(params, lr=1e-2, nonfinite="skip")
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    for p in params:
        p.grad = torch.randn(p.shape)
    params[0].grad[0] = float("nan")
    snap = _snapshot(opt, params)
    opt.step()
    _assert_unchanged(opt, params, snap)
    assert opt.skipped_steps == 1
    # the next good step goes ahead, counting from where the state was
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    assert opt.state[params[0]]["step"].item() == 2


@pytest.mark.parametrize("stage", [0, 2])
def test_a_skipped_nan_step_after_a_clip_leaves_later_steps_alone(stage):
    """Clipping by a NaN norm multiplies every grad by NaN, as torch's does;
    the zero padding between params in a bucket must not take it, or every
    later norm is NaN and every later step skipped."""
    def run(opt_of, skip_by_hand):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
        opt = opt_of(model)
        for step in range(5):
            opt.zero_grad()
            data = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            model(data).pow(2).sum().backward()
            if step == 1:
                model[0].weight.grad.view(-1)[0] = float("nan")
            if skip_by_hand:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if step != 1:
                    opt.step()
            else:
                opt.clip_grad_norm_(1.0)
                opt.step()
        return model, opt

    ours, opt = run(lambda m: rlhfz.ZeroAdamW(m.parameters(), lr=3e-3, stage=stage,
                                              nonfinite="skip"), False)
    theirs, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3), True)
    assert opt.skipped_steps == 1
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bfloat16])
def test_a_grad_of_another_dtype_through_data_is_refused(dtype):
    """torch refuses p.grad = t of another dtype, but p.grad.data = t gets
    past it; torch's AdamW then fails, and so does rlhfz, before any write."""
    params, opt = _trained()
    params[0].grad = torch.ones(7, 3)
    params[0].grad.data = torch.ones(7, 3, dtype=dtype)
    params[1].grad = torch.ones(3)
    snap = _snapshot(opt, params)
    with pytest.raises(TypeError, match=f"has a grad of dtype {dtype}"):
        opt.step()
    _assert_unchanged(opt, params, snap)


def test_nonfinite_none_propagates_like_torch():
    p = torch.nn.Parameter(torch.ones(4))
    q = torch.nn.Parameter(torch.ones(4))
    opt = rlhfz.ZeroAdamW([p], lr=0.1, nonfinite=None)
    ref = torch.optim.AdamW([q], lr=0.1)
    for param, o in ((p, opt), (q, ref)):
        param.grad = torch.tensor([1.0, float("nan"), 2.0, 3.0])
        o.step()
    torch.testing.assert_close(p.detach(), q.detach(), equal_nan=True)
    assert torch.isnan(p[1]) and torch.isfinite(p[[0, 2, 3]]).all()


def test_clip_grad_norm_error_if_nonfinite():
    params, opt = _trained()
    params[0].grad = torch.full((7, 3), float("inf"))
    params[1].grad = torch.zeros(3)
    snap = _snapshot(opt, params)
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    _assert_unchanged(opt, params, snap)
    with pytest.raises(ValueError, match="norm_type must be > 0 or inf"):
        opt.clip_grad_norm_(1.0, norm_type=0.0)
    _assert_unchanged(opt, params, snap)


def _mutations():
    def wrong_group_count(sd):
        sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))

    def wrong_param_count(sd):
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:1]

    def wrong_shape(sd):
        sd["state"][0]["exp_avg"] = torch.zeros(3, 7)

    def missing_moment(sd):
        del sd["state"][1]["exp_avg_sq"]

    def unknown_param_index(sd):
        sd["state"][17] = sd["state"].pop(1)

    def bad_step(sd):
        sd["state"][0]["step"] = torch.tensor(-1.0)

    def fractional_step(sd):
        sd["state"][0]["step"] = torch.tensor(2.5)

    def integer_moment(sd):
        sd["state"][1]["exp_avg"] = torch.zeros(3, dtype=torch.int64)

    def amsgrad_group(sd):
        sd["param_groups"][0]["amsgrad"] = True

    def bad_lr(sd):
        sd["param_groups"][0]["lr"] = -5.0

    def not_a_state_dict(sd):
        sd.pop("state")

    def state_not_dict(sd):
        sd["state"][0] = [1, 2, 3]

    return [wrong_group_count, wrong_param_count, wrong_shape, missing_moment,
            unknown_param_index, bad_step, fractional_step, integer_moment, amsgrad_group,
            bad_lr, not_a_state_dict, state_not_dict]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_mismatched_state_dict_raises_and_changes_nothing(mutate):
    params, opt = _trained()
    snap = _snapshot(opt, params)
    sd = copy.deepcopy(opt.state_dict())
    # a valid dict from a different point in training, then made invalid
    sd["param_groups"][0]["lr"] = 0.5
    for entry in sd["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1
    mutate(sd)
    with pytest.raises(ValueError):
        opt.load_state_dict(sd)
    _assert_unchanged(opt, params, snap)


def test_state_dict_from_another_model_raises():
    _, opt = _trained()
    other = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4, 4)),
                               torch.nn.Parameter(torch.ones(3))])
    for p in other.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    other.step()
    with pytest.raises(ValueError, match="another model"):
        opt.load_state_dict(other.state_dict())


def test_sparse_grad_raises_and_changes_nothing():
    params, opt = _trained()
    for p in params:
        p.grad = torch.randn(p.shape)
    snap = _snapshot(opt, params)
    params[1].grad = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    params[1].grad = snap[2][1].clone()
    _assert_unchanged(opt, params, snap)


def test_invalid_lr_set_on_group_is_refused_before_any_update():
    params, opt = _trained()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(4))]})
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    all_params = params + opt.param_groups[1]["params"]
    snap = _snapshot(opt, all_params)
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="learning rate"):
        opt.step()
    opt.param_groups[1]["lr"] = snap[0]["param_groups"][1]["lr"]
    _assert_unchanged(opt, all_params, snap)
