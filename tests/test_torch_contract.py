"""ZeroAdamW against torch.optim.AdamW as a user meets it: for each input
below, torch's own optimizer is run first and its outcome is the contract
(the same exception type, or acceptance), so a change in torch shows here."""
import warnings

import numpy as np
import pytest
import torch

import rlhfz


def _outcome(make):
    try:
        make()
    except Exception as error:              # noqa: BLE001 (the type is what is compared)
        return type(error)
    return None


def _param():
    return torch.nn.Parameter(torch.ones(3, 2))


PARAMS = {
    "a bare tensor": lambda: torch.ones(3, 2),
    "a bare Parameter": _param,
    "a list with a non-tensor": lambda: [_param(), 1.0],
    "a set of one": lambda: {_param()},
    "a generator": lambda: (p for p in [_param(), _param()]),
    "a tuple of named params": lambda: (("a", _param()), ("b", _param())),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_params_are_taken_or_refused_as_torch_does(name):
    expected = _outcome(lambda: torch.optim.AdamW(PARAMS[name]()))
    try:
        rlhfz.ZeroAdamW(PARAMS[name]())
        got = None
    except Exception as error:              # noqa: BLE001
        got = type(error)
        assert "non-leaf" not in str(error), error
    assert got is expected, f"{name}: torch {expected}, rlhfz {got}"


HPARAMS = {
    "lr as a string": {"lr": "0.001"},
    "eps as a string": {"eps": "1e-8"},
    "weight_decay as a string": {"weight_decay": "0.01"},
    "betas as strings": {"betas": ("0.9", "0.999")},
    "lr as a numpy float": {"lr": np.float64(1e-3)},
    "lr as an int": {"lr": 1},
    "lr as a 0-dim tensor": {"lr": torch.tensor(1e-3)},
    "betas as a list": {"betas": [0.8, 0.9]},
}


@pytest.mark.parametrize("name", list(HPARAMS))
def test_hyperparameters_are_taken_or_refused_as_torch_does(name):
    kwargs = HPARAMS[name]
    expected = _outcome(lambda: torch.optim.AdamW([_param()], **kwargs))
    got = _outcome(lambda: rlhfz.ZeroAdamW([_param()], **kwargs))
    assert got is expected, f"{name}: torch {expected}, rlhfz {got}"


def test_a_string_learning_rate_set_later_fails_the_step_and_changes_nothing():
    p = _param()
    opt = rlhfz.ZeroAdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = "0.1"
    p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="lr must be a number"):
        opt.step()
    assert torch.equal(p.detach(), before)
    opt.param_groups[0]["lr"] = 0.1
    opt.step()
    assert not torch.equal(p.detach(), before)


def _pair(**options):
    """The same two params under torch's AdamW and under ZeroAdamW, one step in."""
    out = []
    for cls in (torch.optim.AdamW, rlhfz.ZeroAdamW):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
        opt = cls(params, lr=0.01, **options)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        out.append(opt)
    return out


def test_state_dict_hooks_run_as_in_torch():
    for opt in _pair():
        calls = []
        opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))

        def post(o, sd):
            calls.append("post")
            return {**sd, "extra": sorted(sd["state"])}
        opt.register_state_dict_post_hook(post)
        sd = opt.state_dict()
        assert calls == ["pre", "post"], type(opt)
        assert sd["extra"] == [0, 1], type(opt)


def test_load_state_dict_hooks_run_as_in_torch():
    reference, ours = _pair()
    saved = reference.state_dict()
    results = []
    for opt in (reference, ours):
        calls = []

        def pre(o, sd):
            calls.append("pre")
            changed = {**sd, "param_groups": [dict(g, lr=0.5) for g in sd["param_groups"]]}
            return changed
        opt.register_load_state_dict_pre_hook(pre)
        opt.register_load_state_dict_post_hook(lambda o: calls.append(("post", o.param_groups[0]["lr"])))
        opt.load_state_dict(saved)
        results.append(calls)
    assert results[0] == results[1] == ["pre", ("post", 0.5)]
    assert saved["param_groups"][0]["lr"] == 0.01          # the caller's dict is left alone


def test_param_names_saved_are_kept_on_load_as_in_torch():
    named = []
    for cls in (torch.optim.AdamW, rlhfz.ZeroAdamW):
        model = torch.nn.Linear(3, 2)
        opt = cls(model.named_parameters(), lr=0.01)
        named.append(opt.state_dict())
    assert named[0]["param_groups"][0]["param_names"] == ["weight", "bias"]
    assert named[1]["param_groups"][0]["param_names"] == ["weight", "bias"]
    for cls, saved in zip((torch.optim.AdamW, rlhfz.ZeroAdamW), named):
        model = torch.nn.Linear(3, 2)
        opt = cls(model.parameters(), lr=0.01)          # built without names
        opt.load_state_dict(saved)
        assert opt.param_groups[0].get("param_names") == ["weight", "bias"], cls
        assert opt.state_dict()["param_groups"][0].get("param_names") == ["weight", "bias"], cls


def test_a_loaded_group_is_the_saved_one_as_in_torch():
    """torch rebuilds each group from the saved one: a key the dict lacks
    (a scheduler's initial_lr) goes, so a scheduler made after the load
    starts from the loaded lr; rlhfz kept the stale key (10x the lr)."""
    results = []
    for cls in (torch.optim.AdamW, rlhfz.ZeroAdamW):
        model, opt = _model_and(cls)
        for group in opt.param_groups:
            group["lr"] = 0.1
        torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)     # initial_lr = 0.1
        saved = _model_and(cls)[1].state_dict()                        # lr 0.01, no initial_lr
        opt.load_state_dict(saved)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
        _steps(model, opt, 3)
        results.append((sorted(opt.param_groups[0]), scheduler.base_lrs,
                        [p.detach().clone() for p in model.parameters()]))
    (torch_keys, torch_base, torch_params), (keys, base, params) = results
    assert set(torch_keys) <= set(keys) and "initial_lr" in keys
    assert base == torch_base == [0.01]
    for a, b in zip(params, torch_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_adams_l2_decay_is_refused_and_an_adam_dict_loads_as_adamw_as_in_torch():
    """torch's AdamW is Adam with decoupled_weight_decay=True: a group set to
    False steps Adam's L2 decay there, which rlhfz does not implement (it
    stepped AdamW regardless); loading an Adam dict sets it back to True."""
    model, opt = _model_and(rlhfz.ZeroAdamW, weight_decay=0.1)
    _steps(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        _steps(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    adam = torch.optim.Adam(model.parameters(), weight_decay=0.1)
    for cls in (torch.optim.AdamW, rlhfz.ZeroAdamW):
        opt = _model_and(cls)[1]
        opt.load_state_dict(adam.state_dict())
        assert opt.param_groups[0]["decoupled_weight_decay"] is True, cls


def test_params_over_the_same_memory_are_refused():
    """torch's AdamW applies both params' updates to their one memory; rlhfz
    gave each a slot of its own, untying them without a word."""
    base = torch.randn(2, 4)
    twins = [torch.nn.Parameter(base), torch.nn.Parameter(base)]
    overlapping = [torch.nn.Parameter(base[0]), torch.nn.Parameter(base.view(-1)[2:6])]
    for params in (twins, overlapping):
        with pytest.raises(ValueError, match="share memory"):
            rlhfz.ZeroAdamW(params)
    opt = rlhfz.ZeroAdamW([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group({"params": twins})
    assert len(opt.param_groups) == 1
    rlhfz.ZeroAdamW([torch.nn.Parameter(base[0]), torch.nn.Parameter(base[1])])   # apart


def _model_and(cls, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = cls(model.parameters(), lr=0.01, **options)
    return model, opt


def _steps(model, opt, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=gen)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_in_one_process_is_a_working_independent_optimizer(how, stage):
    import copy
    import pickle
    copies = []
    for cls, options in ((torch.optim.AdamW, {}), (rlhfz.ZeroAdamW, {"stage": stage})):
        model, opt = _model_and(cls, **options)
        _steps(model, opt, 3)
        if how == "deepcopy":
            model2, opt2 = copy.deepcopy((model, opt))
        else:
            model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
        assert type(opt2) is cls
        before = [p.detach().clone() for p in model.parameters()]
        _steps(model2, opt2, 3, seed=1)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), cls
        _steps(model, opt, 3, seed=1)              # the original goes on the same way
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
        copies.append([p.detach() for p in model2.parameters()])
    for ours, theirs in zip(*copies):
        torch.testing.assert_close(ours, theirs)


def test_stage_3_refuses_to_be_copied_at_copy_time():
    import copy
    import pickle
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    opt = rlhfz.ZeroAdamW(model, lr=0.01, stage=3)
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied"):
            copier(opt)
    _steps(model, opt, 1)                       # the original is untouched by the refusals


def test_a_shallow_copy_is_refused():
    import copy
    _, opt = _model_and(rlhfz.ZeroAdamW)
    with pytest.raises(TypeError, match="shallow copy"):
        copy.copy(opt)


# ---- clip_grad_norm_, step hooks, param groups, the state mapping ------------------------------

def _grads_set(params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, float("inf"), "inf"])
def test_clip_grad_norm_takes_what_torch_takes(norm_type, stage):
    model, opt = _model_and(rlhfz.ZeroAdamW, stage=stage)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    _grads_set(model.parameters())
    _grads_set(reference)
    for foreach in (None, False):
        expected = torch.nn.utils.clip_grad_norm_(reference, 0.5, norm_type=norm_type,
                                                  error_if_nonfinite=True, foreach=foreach)
        got = opt.clip_grad_norm_(0.5, norm_type=norm_type, error_if_nonfinite=True,
                                  foreach=foreach)
        torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), reference):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_step_hooks_run_as_in_torch():
    from torch.optim.optimizer import register_optimizer_step_post_hook
    outcomes = []
    for cls in (torch.optim.AdamW, rlhfz.ZeroAdamW):
        model, opt = _model_and(cls)
        calls = []

        def seen(when):
            # torch passes the step's own arguments, the optimizer first
            return lambda o, args, kwargs: calls.append((when, args[0] is o, args[1:], kwargs))
        opt.register_step_pre_hook(seen("pre"))
        opt.register_step_post_hook(seen("post"))
        handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append("global"))
        try:
            _grads_set(model.parameters())
            opt.step()
            opt.step(closure=None)
        finally:
            handle.remove()
        outcomes.append(calls)
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][:3] == [("pre", True, (), {}), ("post", True, (), {}), "global"]
    assert outcomes[1][3:] == [("pre", True, (), {"closure": None}),
                               ("post", True, (), {"closure": None}), "global"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_add_param_group_after_construction_trains_as_torch(stage):
    trained = []
    for cls, options in ((torch.optim.AdamW, {}), (rlhfz.ZeroAdamW, {"stage": stage})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        model[2].requires_grad_(False)
        opt = cls(model if stage == 3 and cls is rlhfz.ZeroAdamW else
                  [p for p in model.parameters() if p.requires_grad], lr=0.01, **options)
        _steps(model, opt, 2)
        model[2].requires_grad_(True)
        opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05,
                             "weight_decay": 0.0})
        _steps(model, opt, 3, seed=1)
        assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.05
        trained.append([p.detach().clone() for p in model.parameters()])
    for ours, theirs in zip(trained[1], trained[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_optimizer_state_is_a_mapping_as_torch_keeps_it():
    seen = []
    for cls in (torch.optim.AdamW, rlhfz.ZeroAdamW):
        model, opt = _model_and(cls)
        first = list(model.parameters())
        assert len(opt.state) == 0 and first[0] not in opt.state
        assert opt.state[first[0]] == {}                 # a defaultdict, as torch's
        del opt.state[first[0]]
        for p in first[:2]:
            p.grad = torch.ones_like(p)
        opt.step()
        keys = list(opt.state)
        assert keys == first[:2], cls                     # in the order they first stepped
        assert set(opt.state[first[0]]) >= {"step", "exp_avg", "exp_avg_sq"}
        assert opt.state[first[0]]["exp_avg"].shape == first[0].shape
        assert dict(opt.state.items()).keys() == set(first[:2])
        seen.append({k: {name: v.clone() for name, v in entry.items() if name != "master_param"}
                     for k, entry in zip(range(2), opt.state.values())})
    for ours, theirs in zip(seen[1].values(), seen[0].values()):
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name])


def _bf16_training(opt_of, params, steps, seed):
    opt = opt_of(params)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
    return opt


def test_a_state_dict_that_went_through_torch_adamw_continues_from_the_params():
    """torch keeps rlhfz's master_param as an unknown key: it casts it to
    bf16 on load and never updates it. Back in rlhfz, training goes on from
    the params torch trained, not from the master left behind."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 7).to(torch.bfloat16)) for _ in range(2)]
    ours = _bf16_training(lambda ps: rlhfz.ZeroAdamW(ps, lr=1e-2), params, 3, seed=1)
    theirs = torch.optim.AdamW(params, lr=1e-2)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state[params[0]]["master_param"].dtype == torch.bfloat16
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        theirs.step()
    again = rlhfz.ZeroAdamW(params, lr=1e-2)
    with pytest.warns(RuntimeWarning, match="master_param of 2 param.*not fp32.*start again") as caught:
        again.load_state_dict(theirs.state_dict())
    assert caught[0].filename == __file__
    for p in params:
        assert torch.equal(again.state[p]["master_param"], p.detach().float())


def test_an_fp32_master_is_kept_whichever_is_loaded_first():
    params = [torch.nn.Parameter(torch.randn(300, 7).to(torch.bfloat16))]
    ours = _bf16_training(lambda ps: rlhfz.ZeroAdamW(ps, lr=1e-2), params, 3, seed=2)
    saved = ours.state_dict()
    master = saved["state"][0]["master_param"].clone()
    assert not torch.equal(master, params[0].detach().float())    # finer than bf16
    # the optimizer's state first, the model's weights after (a fresh model)
    fresh = [torch.nn.Parameter(torch.zeros(300, 7, dtype=torch.bfloat16))]
    again = rlhfz.ZeroAdamW(fresh, lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(saved)
    assert torch.equal(again.state[fresh[0]]["master_param"], master)
