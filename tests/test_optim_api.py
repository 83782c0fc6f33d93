"""ZeroAdamW's surface: buckets and views, grads, groups, state dicts, reports."""
import copy
import io
import math

import pytest
import torch

import rlhfz
from rlhfz import demo


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.ReLU(), torch.nn.Linear(31, 3))


def _step(model, opt, gen):
    opt.zero_grad()
    x = torch.randn(8, 13, generator=gen)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def test_is_a_torch_optimizer_with_adamw_defaults():
    opt = rlhfz.ZeroAdamW(_model().parameters())
    ref = torch.optim.AdamW(_model().parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    ours = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    theirs = {k: v for k, v in ref.param_groups[0].items() if k != "params"}
    # rlhfz's own per-group options: how the moments are stored
    assert ours == {**theirs, "state_dtype": "fp32", "min_8bit_size": 4096}


def test_params_and_grads_are_views_into_one_bucket():
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3)
    bucket, = opt.engine.buckets
    base = bucket.storage.buffers["param"].address
    end = base + bucket.storage.buffers["param"].nbytes
    for p in model.parameters():
        assert base <= p.data_ptr() < end
    gen = torch.Generator().manual_seed(0)
    _step(model, opt, gen)
    pointers = [p.grad.data_ptr() for p in model.parameters()]
    # Two backwards without zeroing: autograd accumulates in place, in the bucket.
    for _ in range(2):
        model(torch.randn(4, 13, generator=gen)).sum().backward()
        assert [p.grad.data_ptr() for p in model.parameters()] == pointers
    gbase = bucket.storage.buffers["grad"].address
    assert all(gbase <= ptr < gbase + bucket.storage.buffers["grad"].nbytes for ptr in pointers)


def test_set_to_none_then_backward_lands_grads_in_the_bucket():
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3)
    bucket, = opt.engine.buckets
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    model(torch.randn(4, 13)).sum().backward()
    for p, view in zip(model.parameters(), bucket.grad_views):
        assert p.grad is view
    # Module.zero_grad (what HF Trainer calls) sets grads to None as well.
    model.zero_grad()
    model(torch.randn(4, 13)).sum().backward()
    for p, view in zip(model.parameters(), bucket.grad_views):
        assert p.grad is view


def test_zero_grad_keep_tensors_zeroes_in_place():
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 13)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g
        assert not p.grad.any()


def test_assigned_grad_is_adopted_at_step():
    p = torch.nn.Parameter(torch.ones(5))
    q = torch.nn.Parameter(torch.ones(5))
    opt = rlhfz.ZeroAdamW([p], lr=0.1)
    ref = torch.optim.AdamW([q], lr=0.1)
    p.grad = torch.arange(5.0)
    q.grad = torch.arange(5.0)
    opt.step()
    ref.step()
    assert p.grad is opt.engine.buckets[0].grad_views[0]
    torch.testing.assert_close(p.detach(), q.detach())


def _train_alongside(model, opt, ref_model, ref, steps):
    gen, ref_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(steps):
        _step(model, opt, gen)
        _step(ref_model, ref, ref_gen)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_add_param_group_later():
    model = _model()
    first = list(model[0].parameters())
    later = list(model[2].parameters())
    opt = rlhfz.ZeroAdamW(first, lr=1e-3)
    opt.add_param_group({"params": later, "lr": 1e-2, "weight_decay": 0.0})
    assert len(opt.param_groups) == 2 and len(opt.engine.buckets) == 2
    assert opt.param_groups[1]["lr"] == 1e-2
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)
    ref_model = _model()
    ref = torch.optim.AdamW(list(ref_model[0].parameters()), lr=1e-3)
    ref.add_param_group({"params": list(ref_model[2].parameters()), "lr": 1e-2,
                         "weight_decay": 0.0})
    _train_alongside(model, opt, ref_model, ref, steps=20)


def test_param_groups_given_as_generators_keep_every_param():
    model, ref_model = _model(), _model()
    opt = rlhfz.ZeroAdamW([{"params": model[0].parameters()},
                           {"params": model[2].parameters(), "lr": 1e-2}], lr=1e-3)
    ref = torch.optim.AdamW([{"params": ref_model[0].parameters()},
                             {"params": ref_model[2].parameters(), "lr": 1e-2}], lr=1e-3)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    _train_alongside(model, opt, ref_model, ref, steps=5)


def test_named_parameters_are_accepted():
    model = _model()
    opt = rlhfz.ZeroAdamW(model.named_parameters(), lr=1e-3)
    assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    _step(model, opt, torch.Generator().manual_seed(0))


def test_module_argument_takes_trainable_params():
    model = _model()
    model[0].bias.requires_grad_(False)
    opt = rlhfz.ZeroAdamW(model, lr=1e-3)
    assert all(p is not model[0].bias for p in opt.param_groups[0]["params"])
    assert len(opt.param_groups[0]["params"]) == 3


@pytest.mark.parametrize("direction", ["torch_to_rlhfz", "rlhfz_to_torch"])
def test_state_dict_interchanges_with_torch_and_training_continues(direction):
    gen = torch.Generator().manual_seed(2)
    src_model = _model()
    src_cls = torch.optim.AdamW if direction == "torch_to_rlhfz" else rlhfz.ZeroAdamW
    dst_cls = rlhfz.ZeroAdamW if direction == "torch_to_rlhfz" else torch.optim.AdamW
    src = src_cls(src_model.parameters(), lr=2e-3, weight_decay=0.03)
    for _ in range(15):
        _step(src_model, src, gen)
    # Round trip through bytes, as a checkpoint would.
    blob = io.BytesIO()
    torch.save({"model": src_model.state_dict(), "optim": src.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    dst_model = _model(seed=99)
    dst_model.load_state_dict(saved["model"])
    dst = dst_cls(dst_model.parameters(), lr=1.0)
    dst.load_state_dict(saved["optim"])
    assert dst.param_groups[0]["lr"] == 2e-3
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(15):
        _step(src_model, src, gen_a)
        _step(dst_model, dst, gen_b)
    for a, b in zip(src_model.parameters(), dst_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(src_model.parameters(), dst_model.parameters()):
        assert src.state[a]["step"].item() == dst.state[b]["step"].item() == 30


def test_state_dict_has_torch_format():
    model = _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3)
    ref = torch.optim.AdamW(_model().parameters(), lr=1e-3)
    assert opt.state_dict()["state"] == {} == ref.state_dict()["state"]
    _step(model, opt, torch.Generator().manual_seed(0))
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    for i, p in enumerate(model.parameters()):
        entry = sd["state"][i]
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        assert entry["step"].shape == () and entry["step"].dtype == torch.float32
        assert entry["exp_avg"].shape == p.shape


def test_bf16_state_dict_round_trips_master_weights():
    p = torch.nn.Parameter(torch.randn(40).bfloat16())
    opt = rlhfz.ZeroAdamW([p], lr=1e-3)
    p.grad = torch.randn(40).bfloat16()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["master_param"].dtype == torch.float32
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = rlhfz.ZeroAdamW([q], lr=1e-3)
    opt2.load_state_dict(sd)
    for o, param in ((opt, p), (opt2, q)):
        param.grad = torch.ones(40, dtype=torch.bfloat16)
        o.step()
    assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])
    assert torch.equal(p, q)


def test_memory_report_and_placement():
    p32 = torch.nn.Parameter(torch.randn(1000))
    p16 = torch.nn.Parameter(torch.randn(500).bfloat16())
    opt = rlhfz.ZeroAdamW([p32, p16])
    report = opt.memory_report()
    assert set(report) == {"params", "grads", "master", "exp_avg", "exp_avg_sq"}
    # fp32 params are their own master; bf16 ones get an fp32 copy.
    assert report["params"]["host"] == 1008 * 4 + 512 * 2
    assert report["grads"]["host"] == report["params"]["host"]
    assert report["master"]["host"] == 512 * 4
    assert report["exp_avg"]["host"] == report["exp_avg_sq"]["host"] == (1008 + 512) * 4
    assert opt.placement() == {k: "host" for k in report}


def _pair_with_large_grads():
    """The same model under ZeroAdamW and torch's AdamW, after one backward
    with grads large enough to clip."""
    model, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = torch.randn(8, 13)
    for m in (model, ref):
        (100 * m(x)).pow(2).mean().backward()
    return model, opt, ref, ref_opt


def test_clip_grad_norm_matches_torch():
    model, opt, ref, ref_opt = _pair_with_large_grads()
    norm = opt.clip_grad_norm_(1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-9)
    opt.step()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_clip_grad_value_matches_torch_on_all_or_some_params():
    model, opt, ref, ref_opt = _pair_with_large_grads()
    opt.clip_grad_value_(5.0, params=model[2].parameters())
    torch.nn.utils.clip_grad_value_(ref[2].parameters(), 5.0)
    opt.clip_grad_value_(50.0)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 50.0)
    assert max(float(p.grad.abs().max()) for p in model[2].parameters()) == 5.0
    opt.step()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.5])
def test_clip_grad_norm_over_some_params_matches_torch(norm_type):
    """torch's clip over a layer measures and scales that layer alone; the
    whole clip after it sees the part already scaled."""
    model, opt, ref, ref_opt = _pair_with_large_grads()
    ours = opt.clip_grad_norm_(0.5, norm_type, params=model[2].parameters())
    theirs = torch.nn.utils.clip_grad_norm_(ref[2].parameters(), 0.5, norm_type)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6) and float(theirs) > 0.5
    for a, b in zip(model[0].parameters(), ref[0].parameters()):
        assert torch.equal(a.grad, b.grad)              # the rest untouched
    ours = opt.clip_grad_norm_(1.0, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    opt.step()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_an_inf_norm_over_a_nan_grad_is_nan_as_in_torch():
    """A NaN in a later group's grads was dropped by the maximum over them."""
    model, ref = _model(), _model()
    opt = rlhfz.ZeroAdamW([{"params": model[0].parameters()},
                           {"params": model[2].parameters()}])
    x = torch.randn(8, 13)
    for m in (model, ref):
        m(x).pow(2).mean().backward()
        m[2].weight.grad[0, 0] = float("nan")
    ours = opt.clip_grad_norm_(1.0, "inf")
    theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, "inf")
    assert math.isnan(float(ours)) and math.isnan(float(theirs))
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, "inf", error_if_nonfinite=True)


def test_get_total_norm_and_clip_grads_with_norm_match_torch():
    """torch's two halves of a clip, for a norm over several optimizers'
    params: the norm of some params, then a clip by a norm from outside."""
    model, opt, ref, ref_opt = _pair_with_large_grads()
    ours = opt.get_total_norm(params=model[2].parameters())
    theirs = torch.nn.utils.get_total_norm([p.grad for p in ref[2].parameters()])
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    outside = theirs * 3
    opt.clip_grads_with_norm_(1.0, outside)
    torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 1.0, outside)
    opt.step()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_a_clip_by_a_norm_from_outside_leaves_the_step_its_check():
    p = torch.nn.Parameter(torch.ones(8))
    opt = rlhfz.ZeroAdamW([p], lr=0.1)
    p.grad = torch.ones(8)
    p.grad[3] = float("nan")
    opt.clip_grads_with_norm_(1.0, torch.tensor(2.0))     # a finite norm, not of these grads
    with pytest.raises(rlhfz.NonFiniteGradError):
        opt.step()


def test_clip_grad_value_refuses_params_of_another_optimizer():
    model = _model()
    opt = rlhfz.ZeroAdamW(model[0].parameters(), lr=1e-3)
    model(torch.randn(4, 13)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="this optimizer's params only"):
        opt.clip_grad_value_(1e-6, params=model.parameters())
    with pytest.raises(ValueError, match="this optimizer's params only"):
        opt.clip_grad_norm_(1e-6, params=model.parameters())
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_clip_then_modified_grads_are_checked_again():
    p = torch.nn.Parameter(torch.ones(8))
    opt = rlhfz.ZeroAdamW([p], lr=0.1)
    p.grad = torch.ones(8)
    opt.clip_grad_norm_(1.0)
    p.grad[3] = float("nan")          # in place, after the clip's check
    with pytest.raises(rlhfz.NonFiniteGradError):
        opt.step()


def test_build_info_and_threads():
    info = rlhfz.build_info()
    for key in ("version", "cuda", "nccl", "simd", "threads", "cuda_compiled"):
        assert key in info
    assert info["simd"] in ("scalar", "avx2", "avx512")
    before = rlhfz.get_num_threads()
    try:
        rlhfz.set_num_threads(1)
        assert rlhfz.get_num_threads() == 1
        assert rlhfz.build_info()["threads"] == 1
    finally:
        rlhfz.set_num_threads(before)
    with pytest.raises(ValueError):
        rlhfz.set_num_threads(0)


def test_thread_count_does_not_change_results():
    results = []
    before = rlhfz.get_num_threads()
    try:
        for threads in (1, 2, 3):
            rlhfz.set_num_threads(threads)
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(300_001))
            opt = rlhfz.ZeroAdamW([p], lr=1e-2)
            for step in range(3):
                p.grad = torch.randn(300_001, generator=torch.Generator().manual_seed(step))
                opt.step()
            results.append(p.detach().clone())
    finally:
        rlhfz.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_import_does_not_need_torch():
    import subprocess
    import sys
    code = ("import sys; import rlhfz, numpy as np; "
            "b = rlhfz._C.Buffer(16); a = np.from_dlpack(b.view('float32')); a[:] = 2; "
            "assert rlhfz._C.sumsq(b.view('float32')) == 16.0; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_info_and_estimate():
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "rlhfz", "info"], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out)["version"] == rlhfz.__version__
    out = subprocess.run([sys.executable, "-m", "rlhfz", "estimate", "--params", "7B",
                          "--world-size", "8", "--stage", "3"], check=True,
                         capture_output=True, text=True).stdout
    assert "exp_avg" in out and "total" in out


@pytest.mark.parametrize("arguments, message", [
    (["--params", "abc"], "'abc' is not a parameter count"),
    (["--params", "-5"], "at least one parameter"),
    (["--params", "7B", "--world-size", "0"], "--world-size: '0': at least 1"),
    (["--params", "7B", "--offload-ratio", "0.5"], "it needs --offload cpu"),
    (["--params", "7B", "--offload", "cpu", "--offload-ratio", "2"], "between 0 and 1"),
    (["--params", "7B", "--world-size", "4", "--stage", "0"], "stage 0 does not shard"),
    (["--params", "7B", "--world-size", "2", "--bucket-bytes", "100"], "at least 4096"),
])
def test_cli_estimate_refuses_bad_input_with_a_message(arguments, message):
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "rlhfz", "estimate", *arguments],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    assert message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert "_parse" not in run.stderr and "_ratio" not in run.stderr


@pytest.mark.parametrize("arguments, message", [
    (["--steps", "0"], "--steps: '0': at least 1"),
    (["--steps", "-1"], "--steps: '-1': at least 1"),
    (["--world-size", "0"], "--world-size: '0': at least 1"),
    (["--world-size", "-1"], "--world-size: '-1': at least 1"),
    (["--batch-size", "0"], "--batch-size: '0': at least 1"),
    (["--batch-size", "3", "--world-size", "2"], "does not divide over 2 ranks"),
    (["--lr", "-1"], "--lr: '-1': a finite number above 0"),
    (["--lr", "nan"], "--lr: 'nan': a finite number above 0"),
    (["--stage", "0"], "stage 0 does not shard, so it has no use for 2 ranks"),
    (["--steps", "1", "--world-size", "1"], "the demo needs at least 2 steps"),
])
def test_cli_demo_refuses_bad_input_before_training(arguments, message):
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "rlhfz", "demo", *arguments],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert message in run.stderr and "Traceback" not in run.stderr, run.stderr


def _no_training(**arguments):
    raise AssertionError(f"the demo trained: {arguments}")


@pytest.mark.parametrize("environment, arguments, message", [
    ({"WORLD_SIZE": "abc"}, [], "WORLD_SIZE='abc' (set by the launcher) must be a whole number"),
    ({"WORLD_SIZE": "0"}, [], "WORLD_SIZE='0' (set by the launcher) must be a whole number"),
    ({"WORLD_SIZE": "4"}, ["--stage", "0"], "no use for 4 ranks"),
    ({"WORLD_SIZE": "4"}, ["--batch-size", "6"], "does not divide over 4 ranks"),
])
def test_cli_demo_takes_the_world_size_of_the_launcher_that_started_it(monkeypatch, capsys,
                                                                      environment, arguments,
                                                                      message):
    from rlhfz.__main__ import main
    monkeypatch.setattr(demo, "run", _no_training)
    for name, value in {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                        **environment}.items():
        monkeypatch.setenv(name, value)
    assert main(["demo", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_cli_demo_leaves_world_size_alone_when_no_launcher_started_it(monkeypatch, capsys):
    """WORLD_SIZE alone (no torchrun) is not the demo's: --world-size is."""
    from rlhfz.__main__ import main
    monkeypatch.setattr(demo, "run", _no_training)
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["demo", "--world-size", "3", "--batch-size", "4"]) == 2
    assert "batch size 4 does not divide over 3 ranks" in capsys.readouterr().err


def test_run_ranks_needs_a_rank():
    from rlhfz.launch import run_ranks
    for world_size in (0, -3, 1.5):
        with pytest.raises(ValueError, match="world_size must be a whole number of ranks"):
            run_ranks(print, world_size)


def test_cli_estimate_puts_the_offload_ratio_on_the_host():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "rlhfz", "estimate", "--params", "1B",
                          "--dtype", "float32", "--offload", "cpu", "--offload-ratio", "0.25"],
                         check=True, capture_output=True, text=True).stdout
    line = next(line for line in out.splitlines() if line.strip().startswith("exp_avg "))
    device, host = (float(part.split()[0]) for part in line.split("device")[1].split("host"))
    assert abs(host / (device + host) - 0.25) < 1e-3, out


def test_cli_estimate_follows_bucket_bytes():
    """Stage 2 grads: the shard and two staging slots of the cap."""
    from rlhfz.estimate import estimate_bytes
    shard = 1_000_000 * 4 // 2
    for cap in (8 << 20, 32 << 20):
        grads = estimate_bytes(1_000_000 * 16, world_size=2, stage=2, param_dtype="float32",
                               bucket_bytes=cap)["grads"]["device"]
        assert grads == 16 * shard + 2 * cap


def test_estimate_stage3_stages_no_more_than_the_largest_unit():
    """Stage 3 keeps a unit's grads whole: each of the two staging slots is
    the largest unit where that is below the cap. Without the unit the
    figure counts the cap and says it is an upper bound."""
    import subprocess
    import sys
    from rlhfz.estimate import estimate_bytes
    params, unit, cap = 1_000_000, 50_000, 64 << 20
    grads = estimate_bytes(params, world_size=2, stage=3, param_dtype="float32",
                           bucket_bytes=cap, largest_unit=unit)["grads"]["device"]
    assert grads == params * 4 // 2 + 2 * unit * 4
    small_cap = estimate_bytes(params, world_size=2, stage=3, param_dtype="float32",
                               bucket_bytes=8192, largest_unit=unit)["grads"]["device"]
    assert small_cap == params * 4 // 2 + 2 * 8192
    command = [sys.executable, "-m", "rlhfz", "estimate", "--params", "1M", "--world-size", "2",
               "--stage", "3", "--bucket-bytes", str(cap)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    assert "grads is an upper bound" in out and "--largest-unit" in out
    out = subprocess.run(command + ["--largest-unit", "50K"], check=True, capture_output=True,
                         text=True).stdout
    assert "upper bound" not in out
    refused = subprocess.run(command[:-4] + ["--largest-unit", "50K"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "needs --stage 3" in refused.stderr


@pytest.mark.parametrize("command", [["estimate", "--params", "1M", "--world-size", "2"],
                                     ["estimate", "--params", "1M"],
                                     ["bench", "--params", "1K"],
                                     ["demo", "--world-size", "1", "--steps", "2"]])
def test_cli_refuses_a_bucket_size_from_the_environment_below_a_page(monkeypatch, capsys,
                                                                     command):
    from rlhfz.__main__ import main
    monkeypatch.setenv("RLHFZ_BUCKET_BYTES", "-100000000")
    assert main(command) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"python -m rlhfz {command[0]}: error: RLHFZ_BUCKET_BYTES must be a whole number " \
           f"of bytes >= 4096 (digits), not '-100000000'" in captured.err, captured.err


def test_cli_bench_runs_every_peer_on_the_same_threads_and_says_so(capsys):
    from rlhfz.__main__ import main
    before = torch.get_num_threads(), rlhfz.get_num_threads()
    rlhfz.set_num_threads(1)
    torch.set_num_threads(2)
    try:
        assert main(["bench", "--params", "1K", "--repeat", "1"]) == 0
        assert torch.get_num_threads() == 2          # torch's own count is given back
    finally:
        torch.set_num_threads(before[0])
        rlhfz.set_num_threads(before[1])
    lines = capsys.readouterr().out.splitlines()
    assert "each peer on 1 threads" in lines[0]
    rows = [line for line in lines if "ms/step" in line]
    assert len(rows) == 3 and all(line.endswith(", 1 threads)") for line in rows), lines


def test_cli_bench_refuses_more_params_than_memory_with_the_bytes_needed(capsys, monkeypatch):
    from rlhfz.__main__ import main
    assert main(["bench", "--params", "1e30"]) == 2
    err = capsys.readouterr().err
    assert "python -m rlhfz bench: error: --params" in err and "needs about 24" in err, err
    assert "more than this machine's" in err

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "4000 bytes")
    monkeypatch.setattr(torch, "randn", no_memory)
    assert main(["bench", "--params", "1K"]) == 2
    err = capsys.readouterr().err
    assert "--params 1,000 needs about 24,000 bytes" in err and "allocation failed" in err, err


def test_cli_info_names_torch():
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "rlhfz", "info"], check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out)["torch"] == torch.__version__
