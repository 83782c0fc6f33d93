"""ZeroAdamW(state_dtype="bf16" | "int8"): moments stored in low precision,
master weights fp32, everything else as with fp32 moments.

The kernels are held to a float64 reference in test_lowp_kernels.py; here
the optimizer around them: what optimizer.state shows, what memory_report
counts, state dicts in torch's format both ways, the options' checks, and
that sharding over any world size steps exactly as one process does.
"""
import copy
import json

import pytest
import torch

import lowp_workers as workers
import rlhfz
from rlhfz import _C
from rlhfz.launch import run_ranks

QBLOCK = _C.QBLOCK


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, 10))


def train(model, opt, steps=20, seed=1, nan_at=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- options ------------------------------------------------------------------

@pytest.mark.parametrize("bad, error", [
    (dict(state_dtype="fp16"), ValueError), (dict(state_dtype="INT8"), ValueError),
    (dict(state_dtype=torch.bfloat16), ValueError), (dict(min_8bit_size=-1), ValueError),
    (dict(min_8bit_size=2.5), ValueError), (dict(min_8bit_size=True), ValueError),
])
def test_unknown_options_are_refused(bad, error):
    with pytest.raises(error, match="state_dtype|min_8bit_size"):
        rlhfz.ZeroAdamW(small_model().parameters(), stage=0, **bad)


def test_a_bad_group_option_is_refused_and_leaves_the_optimizer_as_it_was():
    model = small_model()
    opt = rlhfz.ZeroAdamW(model[0].parameters(), stage=0, state_dtype="int8")
    with pytest.raises(ValueError, match="state_dtype"):
        opt.add_param_group({"params": list(model[2].parameters()), "state_dtype": "int4"})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": list(model[2].parameters()), "state_dtype": "bf16"})
    train(model, opt, steps=2)
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.bfloat16
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.int8


def test_state_dtype_is_saved_in_param_groups():
    opt = rlhfz.ZeroAdamW([{"params": small_model().parameters(), "state_dtype": "bf16"}],
                          stage=0, state_dtype="int8", min_8bit_size=100)
    assert opt.param_groups[0]["state_dtype"] == "bf16"
    assert opt.param_groups[0]["min_8bit_size"] == 100
    assert opt.state_dict()["param_groups"][0]["state_dtype"] == "bf16"


def test_switching_state_dtype_on_a_built_optimizer_is_refused_and_nothing_changes():
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8")
    train(model, opt, steps=2)
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["state_dtype"] = "bf16"
    with pytest.raises(ValueError, match="cannot change form in place"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    after = opt.state_dict()
    for key, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][key][name], value)


# ---- the stored form -------------------------------------------------------------

def test_state_shows_the_stored_form():
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8", min_8bit_size=1000)
    train(model, opt, steps=3)
    big = opt.state[model[0].weight]                        # 96 x 64 = 6144 elements
    assert big["exp_avg"].dtype == torch.int8 and big["exp_avg"].shape == (96, 64)
    assert big["exp_avg_sq"].dtype == torch.uint8
    assert big["exp_avg_scale"].shape == big["exp_avg_sq_scale"].shape == (6144 // QBLOCK,)
    assert int(big["exp_avg"].abs().max()) == 127            # each block's largest is exact
    small = opt.state[model[0].bias]                         # under min_8bit_size: fp32
    assert small["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in small
    bf16 = rlhfz.ZeroAdamW(small_model().parameters(), stage=0, state_dtype="bf16")
    for p in bf16.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    bf16.step()
    assert all(e["exp_avg"].dtype == torch.bfloat16 for e in bf16.state.values())


def test_state_views_are_the_memory_the_step_updates():
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8", min_8bit_size=1000)
    train(model, opt, steps=1)
    entry = opt.state[model[0].weight]
    codes, scales = entry["exp_avg"], entry["exp_avg_scale"]
    before = codes.clone(), scales.clone()
    train(model, opt, steps=1)
    assert opt.state[model[0].weight]["exp_avg"] is codes
    assert not (torch.equal(codes, before[0]) and torch.equal(scales, before[1]))


def _expected_moment_bytes(model, state_dtype, min_8bit_size):
    total = 0
    for p in model.parameters():
        n = p.numel()
        if state_dtype == "int8" and n >= min_8bit_size:
            padded = -(-n // QBLOCK) * QBLOCK
            total += padded + 4 * (padded // QBLOCK)            # codes and their scales
        else:
            total += n * (2 if state_dtype == "bf16" else 4)
    return total


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_memory_report_counts_the_stored_bytes(state_dtype):
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 256))
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype=state_dtype,
                          min_8bit_size=4096)
    report = opt.memory_report()
    # buckets pad each param to an aligned offset: at most one alignment unit each
    expected = _expected_moment_bytes(model, state_dtype, 4096)
    for name in ("exp_avg", "exp_avg_sq"):
        got = sum(report[name].values())
        assert expected <= got <= expected + 64 * 4
    fp32 = _expected_moment_bytes(model, "fp32", 0)
    ratio = sum(report["exp_avg"].values()) / fp32
    assert ratio < {"fp32": 1.1, "bf16": 0.55, "int8": 0.3}[state_dtype]


# ---- state dicts ------------------------------------------------------------------

@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_state_dict_is_torchs_format_with_the_moments_decoded(state_dtype):
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype=state_dtype,
                          min_8bit_size=1000)
    train(model, opt, steps=4)
    sd = opt.state_dict()
    for key, entry in sd["state"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        assert entry["exp_avg"].dtype == torch.float32
    # what optimizer.state stores decodes to exactly these values
    weight = sd["state"][0]
    stored = opt.state[model[0].weight]
    if state_dtype == "bf16":
        assert torch.equal(weight["exp_avg"], stored["exp_avg"].float())
    else:
        q = stored["exp_avg"].int().reshape(-1)
        fraction = q.float() * torch.tensor(1.0 / 127, dtype=torch.float32)
        want = fraction * stored["exp_avg_scale"].repeat_interleave(QBLOCK)[:q.numel()]
        assert torch.equal(weight["exp_avg"].reshape(-1), want)
    # torch's AdamW takes it and steps on from it
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    torch_opt.load_state_dict(sd)
    train(ref, torch_opt, steps=1)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_load_state_dict_from_torch_quantizes_into_the_current_state_dtype(state_dtype):
    model = small_model()
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    train(ref, torch_opt, steps=3)
    sd = torch_opt.state_dict()
    opt = rlhfz.ZeroAdamW(copy.deepcopy(ref).parameters(), stage=0, state_dtype=state_dtype,
                          min_8bit_size=1000)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["state_dtype"] == state_dtype    # the dict named none
    got = opt.state_dict()["state"]
    for key, entry in sd["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            want = entry[name].float()
            err = (got[key][name] - want).abs().reshape(-1)
            # within the format's resolution: bf16's 8 bits, or half a step of
            # exp_avg's linear map (a block's largest / 127), or exp_avg_sq's ...
            bound = (want.abs() * 2 ** -8).reshape(-1) + 1e-30
            if state_dtype == "int8" and want.numel() >= 1000:
                scale = want.abs().reshape(-1)
                pad = -scale.numel() % QBLOCK
                blocks = torch.cat([scale, scale.new_zeros(pad)]).view(-1, QBLOCK).amax(dim=1)
                top = blocks.repeat_interleave(QBLOCK)[:scale.numel()]
                if name == "exp_avg":
                    bound = 0.501 * top / 127
                else:
                    root = scale.sqrt()
                    bound = (2.01 * (root * top.sqrt()).sqrt() / 255 + top.sqrt() / 255 ** 2) \
                        * (2 * root + 1e-30) + top / 255 ** 4
            assert bool((err <= bound).all()), name


def test_a_loaded_exp_avg_sq_above_zero_never_reads_as_zero():
    """Encoding a torch dict keeps the kernels' rule: an exp_avg_sq far below
    its block's largest gets code 1, not 0 (which would step its element by
    exp_avg / eps)."""
    weight = torch.nn.Parameter(torch.zeros(4 * QBLOCK))
    torch_opt = torch.optim.AdamW([weight])
    weight.grad = torch.zeros_like(weight)
    torch_opt.step()
    sd = torch_opt.state_dict()
    sq = sd["state"][0]["exp_avg_sq"]
    sq[0], sq[1:QBLOCK] = 1e6, 1e-12          # roots 1e3 and 1e-6: position 0.008
    sd["state"][0]["exp_avg"][1:QBLOCK] = 1e-3
    opt = rlhfz.ZeroAdamW([torch.nn.Parameter(torch.zeros(4 * QBLOCK))], stage=0,
                          state_dtype="int8", min_8bit_size=1000)
    opt.load_state_dict(sd)
    codes = next(iter(opt.state.values()))["exp_avg_sq"]
    assert codes[0] == 255 and bool((codes[1:QBLOCK] == 1).all())
    assert bool((codes[QBLOCK:] == 0).all())


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_state_dict_round_trip_keeps_every_code(state_dtype):
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype=state_dtype,
                          min_8bit_size=1000)
    train(model, opt, steps=4)
    other = rlhfz.ZeroAdamW(copy.deepcopy(model).parameters(), stage=0,
                            state_dtype=state_dtype, min_8bit_size=1000)
    other.load_state_dict(opt.state_dict())
    for p, q in zip(model.parameters(), other.param_groups[0]["params"]):
        a, b = opt.state[p], other.state[q]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"],
                                                                         b["exp_avg_sq"])
        for name in ("exp_avg_scale", "exp_avg_sq_scale"):
            if name in a:      # the top code decodes to the scale exactly
                assert torch.equal(a[name], b[name])


# ---- training -------------------------------------------------------------------

def test_a_nonfinite_grad_is_refused_before_any_code_changes():
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8", min_8bit_size=1000)
    train(model, opt, steps=2)
    codes = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[0].weight.grad[3, 5] = float("nan")
    with pytest.raises(rlhfz.optim.NonFiniteGradError):
        opt.step()
    for name, value in opt.state[model[0].weight].items():
        assert torch.equal(value, codes[name])


def _int8_linear(**options):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 256)
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8", **options)
    train_linear(model, opt)
    return model, opt


def train_linear(model, opt, big=None, clip=None):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    opt.zero_grad()
    model(x).square().mean().backward()
    if big is not None:
        model.weight.grad[200, 7] = big
    if clip is not None:
        opt.clip_grad_norm_(clip)
    opt.step()


def test_a_grad_that_would_overflow_int8_exp_avg_sq_is_refused_before_any_change():
    """torch's fp32 exp_avg_sq turns Inf at such a grad and stops that
    element; an int8 block's scale cannot hold an Inf and would stop the
    whole block (NaN), so the step is refused, like a NaN grad."""
    model, opt = _int8_linear()
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    weight = model.weight.detach().clone()
    with pytest.raises(rlhfz.optim.NonFiniteGradError,
                       match=r"exp_avg_sq would pass .* param_groups\[0\]\['params'\]\[0\]"):
        train_linear(model, opt, big=1e21)
    assert torch.equal(model.weight, weight)
    for name, value in opt.state[model.weight].items():
        assert torch.equal(value, state[name])
    model, opt = _int8_linear(nonfinite="skip")
    weight = model.weight.detach().clone()
    train_linear(model, opt, big=1e21)
    assert opt.skipped_steps == 1 and torch.equal(model.weight, weight)


def test_a_large_grad_that_int8_holds_or_a_clip_brings_down_steps():
    model, opt = _int8_linear()
    train_linear(model, opt, big=2e19)      # exp_avg_sq 4e35: large, and held
    assert bool(model.weight.isfinite().all())
    assert bool(opt.state[model.weight]["exp_avg_sq_scale"].isfinite().all())
    model, opt = _int8_linear()
    train_linear(model, opt, big=1e21, clip=1.0)
    assert bool(model.weight.isfinite().all())
    assert bool(opt.state[model.weight]["exp_avg_sq_scale"].isfinite().all())


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_every_rank_refuses_a_grad_int8_cannot_hold_on_one_rank(stage, nonfinite):
    results = run_ranks(workers.huge_grad, 2, stage, nonfinite)
    for rank, result in enumerate(results):
        assert result["same"], rank
        if nonfinite == "skip":
            assert result["outcome"] == "stepped" and result["skipped"] == 1
        else:
            assert "exp_avg_sq would pass" in result["outcome"]
    if nonfinite == "raise":
        assert "on another rank" in results[0]["outcome"]
        assert "params'][0]" in results[1]["outcome"]


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_training_follows_fp32_moments_closely(state_dtype):
    base = small_model()
    fp32_model, model = copy.deepcopy(base), copy.deepcopy(base)
    want = train(fp32_model, rlhfz.ZeroAdamW(fp32_model.parameters(), lr=3e-3, stage=0),
                 steps=60)
    got = train(model, rlhfz.ZeroAdamW(model.parameters(), lr=3e-3, stage=0,
                                       state_dtype=state_dtype, min_8bit_size=1000), steps=60)
    assert got[-1] < 0.5 * got[0]
    assert abs(sum(got[-10:]) - sum(want[-10:])) / sum(want[-10:]) < 0.05


def _assert_same_bits(result, want):
    for got, expected in zip(result["params"], want["params"]):
        assert torch.equal(got, expected)
    for key, entry in want["state"].items():
        for name, value in entry.items():
            assert torch.equal(result["state"][key][name], value), (key, name)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("stage", [1, 2])
def test_sharding_over_any_world_size_steps_as_one_process(stage, state_dtype):
    """Blocks start on param and shard boundaries, and stochastic rounding
    counts elements from the bucket's start: the same bits at 1, 2 and 4
    ranks (each rank taking the whole batch, so the grads agree exactly)."""
    want = run_ranks(workers.train_same_batch, 1, 0, state_dtype)[0]
    for world_size in (2, 4):
        for result in run_ranks(workers.train_same_batch, world_size, stage, state_dtype):
            _assert_same_bits(result, want)
    # and with half of each shard's state offloaded to the host, stepping there
    for result in run_ranks(workers.train_same_batch, 2, stage, state_dtype, 0.5):
        _assert_same_bits(result, want)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_stage3_steps_the_same_bits_at_any_world_size(state_dtype):
    """Stage 3 keeps a bucket per unit, so its buckets (and the elements its
    rounding counts) differ from stages 0-2; at any world size they are the
    same, and so are the bits."""
    want = run_ranks(workers.train_same_batch, 2, 3, state_dtype)[0]
    for result in run_ranks(workers.train_same_batch, 4, 3, state_dtype):
        _assert_same_bits(result, want)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_checkpoint_resumes_bit_for_bit_at_another_world_size(state_dtype, tmp_path):
    """Saved at 4 ranks (stage 2), resumed at 2 (stage 1) and in one process:
    the moments are copied in their stored form, and the run goes on exactly
    as one that never stopped."""
    want = run_ranks(workers.train_same_batch, 1, 0, state_dtype)[0]
    path = str(tmp_path / "ckpt")
    run_ranks(workers.save_or_resume, 4, 2, state_dtype, path, False)
    for world_size, stage in ((2, 1), (1, 0)):
        for result in run_ranks(workers.save_or_resume, world_size, stage, state_dtype, path,
                                True):
            _assert_same_bits(result, want)


def test_a_checkpoint_of_another_state_dtype_is_refused_with_what_to_do(tmp_path):
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8", min_8bit_size=1000)
    train(model, opt, steps=2)
    rlhfz.save_checkpoint(tmp_path / "ckpt", model, opt)
    other_model = small_model()
    other = rlhfz.ZeroAdamW(other_model.parameters(), stage=0, state_dtype="bf16")
    before = [p.detach().clone() for p in other_model.parameters()]
    with pytest.raises(rlhfz.CheckpointError, match="state_dtype='int8'"):
        rlhfz.load_checkpoint(tmp_path / "ckpt", other_model, other)
    assert all(torch.equal(p, q) for p, q in zip(other_model.parameters(), before))
    assert not other.state


def test_int8_codes_saved_under_other_maps_are_refused_with_what_to_do(tmp_path):
    """A checkpoint keeps int8 codes with the maps they were written under;
    codes of an earlier rlhfz's maps (no record, or another one) would
    decode to other moments, so they are refused, and nothing is loaded."""
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8", min_8bit_size=1000)
    train(model, opt, steps=2)
    rlhfz.save_checkpoint(tmp_path / "ckpt", model, opt)
    index_path = tmp_path / "ckpt" / "index.json"        # and the generation's copy
    index = json.loads(index_path.read_text())
    assert {b["maps"] for b in index["buckets"] if b["state_dtype"] == "int8"} == {
        "exp_avg q/127, exp_avg_sq (q^2/255^2)^2"}
    from rlhfz.checkpoint.validation import index_text
    for maps in (None, "exp_avg q|q|/127^2, exp_avg_sq (q^2/255^2)^2"):
        for b in index["buckets"]:
            b.pop("maps", None)
            if maps and b["state_dtype"] == "int8":
                b["maps"] = maps
        for copy_path in (tmp_path / "ckpt").rglob("index.json"):
            copy_path.write_bytes(index_text(index))     # as an earlier rlhfz wrote it
        other_model = small_model()
        other = rlhfz.ZeroAdamW(other_model.parameters(), stage=0, state_dtype="int8",
                                min_8bit_size=1000)
        before = [p.detach().clone() for p in other_model.parameters()]
        with pytest.raises(rlhfz.CheckpointError, match="codes of other maps.*save_consolidated"):
            rlhfz.load_checkpoint(tmp_path / "ckpt", other_model, other)
        assert all(torch.equal(p, q) for p, q in zip(other_model.parameters(), before))
        assert not other.state


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_the_estimate_predicts_the_moments_memory_report_shows(state_dtype):
    from rlhfz.estimate import estimate_bytes
    model = torch.nn.Sequential(torch.nn.Linear(512, 256, bias=False),
                                torch.nn.Linear(256, 512, bias=False))
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype=state_dtype)
    numel = sum(p.numel() for p in model.parameters())
    report = opt.memory_report()
    estimate = estimate_bytes(numel, 1, 0, "float32", state_dtype=state_dtype)
    for kind in ("exp_avg", "exp_avg_sq", "master"):
        assert sum(report[kind].values()) == sum(estimate[kind].values()), kind


def test_cli_estimate_takes_the_state_dtype():
    import subprocess
    import sys
    outs = {}
    for state_dtype in ("fp32", "int8"):
        outs[state_dtype] = subprocess.run(
            [sys.executable, "-m", "rlhfz", "estimate", "--params", "1B", "--stage", "0",
             "--state-dtype", state_dtype], check=True, capture_output=True, text=True).stdout
    assert "int8 moments" in outs["int8"] and outs["int8"] != outs["fp32"]
    bad = subprocess.run([sys.executable, "-m", "rlhfz", "estimate", "--params", "1B",
                          "--state-dtype", "int4"], capture_output=True, text=True)
    assert bad.returncode != 0 and "int4" in bad.stderr


def test_load_state_dict_switches_the_state_dtype_the_dict_names():
    """A dict saved with int8 moments, loaded into an fp32-state optimizer:
    the buckets are rebuilt to keep int8 codes, the params stay the same
    objects with the same values, and training goes on."""
    model = small_model()
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype="int8", min_8bit_size=1000)
    train(model, opt, steps=3)
    sd = opt.state_dict()
    other_model = copy.deepcopy(model)
    params = list(other_model.parameters())
    values = [p.detach().clone() for p in params]
    other = rlhfz.ZeroAdamW(other_model.parameters(), stage=0)
    other.load_state_dict(sd)
    assert other.param_groups[0]["state_dtype"] == "int8"
    assert list(other_model.parameters()) == params
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert torch.equal(other.state[params[0]]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    train(other_model, other, steps=2)
    assert other.state[params[0]]["exp_avg"].dtype == torch.int8
    # and back: a dict that names fp32
    fp32_sd = copy.deepcopy(sd)
    for group in fp32_sd["param_groups"]:
        group["state_dtype"] = "fp32"
    other.load_state_dict(fp32_sd)
    assert other.state[params[0]]["exp_avg"].dtype == torch.float32
    train(other_model, other, steps=1)


# ---- offload --------------------------------------------------------------------

def _stored(opt, model):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]


def _assert_same_run(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    for x, y in zip(_stored(opt_a, model_a), _stored(opt_b, model_b)):
        assert set(x) == set(y)
        for name in x:
            assert torch.equal(x[name].view(torch.uint8) if x[name].dtype == torch.bfloat16
                               else x[name], y[name].view(torch.uint8)
                               if y[name].dtype == torch.bfloat16 else y[name]), name


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_offload_cpu_steps_the_same_bits_as_without(state_dtype, ratio):
    """offload='cpu' moves the last `ratio` of each shard's state to the host
    (whole blocks) and steps it there: the same codes and the same params as
    with everything in one place."""
    runs = []
    for options in ({}, {"offload": "cpu", "offload_ratio": ratio}):
        model = small_model()
        opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype=state_dtype,
                              min_8bit_size=1000, **options)
        train(model, opt, steps=5)
        runs.append((model, opt))
    _assert_same_run(*runs)
    host = runs[1][1].memory_report()["exp_avg"]
    assert host["host"] + host["pinned"] > 0


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("to", ["cpu", "disk"])
def test_offload_and_reload_keep_every_code(state_dtype, to, tmp_path):
    runs = []
    for offload in (False, True):
        model = small_model()
        opt = rlhfz.ZeroAdamW(model.parameters(), stage=0, state_dtype=state_dtype,
                              min_8bit_size=1000)
        train(model, opt, steps=3)
        if offload:
            before = _stored(opt, model)
            opt.offload(what=("optimizer",), to=to, path=str(tmp_path) if to == "disk" else None)
            assert opt.placement()["exp_avg"] == ("disk" if to == "disk" else "host")
            opt.reload()
            for x, y in zip(before, _stored(opt, model)):
                for name in x:
                    assert torch.equal(x[name], y[name]), name
        train(model, opt, steps=2, seed=2)
        runs.append((model, opt))
    _assert_same_run(*runs)
