"""Model-only checkpoints: save_checkpoint(path, model) and
load_checkpoint(path, model) with no optimizer.

A reference or reward model has no optimizer, and a policy's weights are
often wanted without its states: the model alone is saved, and loaded
either from such a checkpoint or from a full one (its params gathered from
every rank's bucket shards). Every load checks first and changes nothing
on an error."""
import pathlib

import pytest
import torch

import checkpoint_workers as workers
import rlhfz
from rlhfz.checkpoint import CheckpointError
from rlhfz.launch import run_ranks
from stage3_workers import tiny_lm


def _tensors(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_same(model, expected):
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name


@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
def test_a_model_alone_round_trips_bitwise(tmp_path, kind):
    model = workers.mlp(seed=1) if kind == "mlp" else tiny_lm("gpt2", seed=1)
    rlhfz.save_checkpoint(tmp_path, model, client_state={"step": 7})
    fresh = workers.mlp(seed=2) if kind == "mlp" else tiny_lm("gpt2", seed=2)
    assert rlhfz.load_checkpoint(tmp_path, fresh) == {"step": 7}
    _assert_same(fresh, _tensors(model))
    if kind == "gpt2":           # the tied weight is saved once and stays tied
        assert fresh.lm_head.weight is fresh.transformer.wte.weight
        files = list(pathlib.Path(tmp_path).glob("g-*/rank-*.safetensors"))
        assert len(files) == 1


@pytest.mark.parametrize("dtype, options", [
    (torch.bfloat16, dict(stage=0)), (torch.bfloat16, dict(stage=2)),
    (torch.float32, dict(stage=1, offload="cpu", offload_ratio=0.5))],
    ids=["bf16-stage0", "bf16-stage2", "fp32-offload"])
def test_weights_loaded_alone_are_what_a_live_optimizer_steps_from(tmp_path, dtype, options):
    """The optimizer keeps its own copy of these params (an fp32 master, a
    host part): a model-only load under it must reach that copy, as torch's
    AdamW steps from the loaded values."""
    saved = workers.mlp(seed=1).to(dtype)
    rlhfz.save_checkpoint(tmp_path, saved)
    model = workers.mlp(seed=2).to(dtype)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3, **options)
    rlhfz.load_checkpoint(tmp_path, model)
    ref = workers.mlp(seed=2)
    ref.load_state_dict({k: v.float() for k, v in saved.state_dict().items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = torch.full_like(p, 0.01)
        q.grad = torch.full_like(q, 0.01)
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q.to(dtype))


@pytest.mark.parametrize("stage", [2, 3])
def test_the_weights_of_a_full_checkpoint_load_into_a_model_alone(tmp_path, stage):
    """A 2-rank checkpoint (params in each rank's bucket shards) into a
    plain model in one process: its params and buffers as they were saved."""
    results = run_ranks(workers.save_and_continue, 2, str(tmp_path), "mlp", stage,
                        torch.float32, {})
    saved = results[0]["saved"]
    fresh = workers.mlp(seed=5)
    assert rlhfz.load_checkpoint(tmp_path, fresh) == {"step": 3}
    for name, t in fresh.named_parameters():
        assert torch.equal(t.detach(), saved["params"][name]), name
    for name, t in fresh.named_buffers():
        assert torch.equal(t, saved["buffers"][name]), name


def test_another_model_is_refused_and_left_as_it_was(tmp_path):
    rlhfz.save_checkpoint(tmp_path, workers.mlp(seed=1))
    other = torch.nn.Sequential(torch.nn.Linear(37, 60), torch.nn.GELU(),
                                torch.nn.LayerNorm(60), torch.nn.Linear(60, 29))
    before = _tensors(other)
    with pytest.raises(CheckpointError, match="does not hold this model.*0.weight"):
        rlhfz.load_checkpoint(tmp_path, other)
    _assert_same(other, before)


def test_a_damaged_file_is_refused_and_the_model_left_as_it_was(tmp_path):
    rlhfz.save_checkpoint(tmp_path, workers.mlp(seed=1))
    (shard,) = pathlib.Path(tmp_path).glob("g-*/rank-*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x10
    shard.write_bytes(bytes(data))
    fresh = workers.mlp(seed=2)
    before = _tensors(fresh)
    with pytest.raises(CheckpointError):
        rlhfz.load_checkpoint(tmp_path, fresh)
    _assert_same(fresh, before)


def test_a_model_alone_is_no_optimizer_state(tmp_path):
    model = workers.mlp(seed=1)
    rlhfz.save_checkpoint(tmp_path, model)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match="no optimizer state.*load_checkpoint\\(path, model\\)"):
        rlhfz.load_checkpoint(tmp_path, model, opt)


def test_a_save_replaces_the_last_atomically(tmp_path):
    first, second = workers.mlp(seed=1), workers.mlp(seed=2)
    rlhfz.save_checkpoint(tmp_path, first)
    rlhfz.save_checkpoint(tmp_path, second)
    assert len(list(pathlib.Path(tmp_path).glob("g-*"))) == 1
    fresh = workers.mlp(seed=3)
    rlhfz.load_checkpoint(tmp_path, fresh)
    _assert_same(fresh, _tensors(second))


def test_a_model_sharded_at_stage_3_saves_and_loads_alone(tmp_path):
    for result in run_ranks(workers.model_alone_of_a_sharded_model, 2, str(tmp_path)):
        assert result["loaded"] and result["trained"]
        assert result["keys"]
