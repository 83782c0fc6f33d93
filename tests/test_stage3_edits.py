"""What a user does to a stage-3 model's params, across 2 gloo ranks, held
to an unsharded model and torch's AdamW doing the same.

Outside a forward a sharded param is an empty placeholder, so what torch
does to its values must reach the shards, or be refused: a whole tensor
assigned (`p.data = t`), model.load_state_dict, writes into whole params
inside gather_for_generation. A cast there and back cannot be followed,
and load_state_dict(assign=True) would orphan trained params: both are
refused. transformers' generate keeps the
ranks in step when their sequences end apart (synced_gpus), as under FSDP.
"""
import pytest
import torch

import stage3_edit_workers as workers
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")


def _relative(a, b):
    return float((a - b).norm() / b.norm())


def _close(ours, theirs):
    """The whole model within 1e-5 relative; per tensor 1e-3, since a
    weight whose grads are of rounding size takes lr-sized Adam steps whose
    sign is noise (as in test_stage3's parity)."""
    assert ours.keys() == theirs.keys()
    names = sorted(theirs)
    assert _relative(torch.cat([ours[n].reshape(-1) for n in names]),
                     torch.cat([theirs[n].reshape(-1) for n in names])) <= 1e-5
    for name in names:
        assert _relative(ours[name], theirs[name]) <= 1e-3, name


@pytest.mark.parametrize("write", sorted(workers.WRITES))
def test_values_written_to_sharded_params_are_trained_from(write):
    losses, state = workers.reference(workers.WRITES[write])
    results = run_ranks(workers.sharded_run, 2, write)
    for _, rank_state in results:
        _close(rank_state, state)
    # each rank's loss is over its half of the batch: their mean is the whole's
    means = [sum(pair) / 2 for pair in zip(*(losses for losses, _ in results))]
    torch.testing.assert_close(torch.tensor(means), torch.tensor(losses), rtol=1e-5, atol=1e-6)


def test_a_cast_of_a_sharded_model_is_refused_before_anything_changes():
    """A cast there and back would leave torch's params rounded to bf16 and
    the shards not: the first cast is refused, with the model untouched."""
    for error, unchanged, losses in run_ranks(workers.cast_round_trip, 2):
        assert error is not None
        assert "cast or move the model before shard_model" in error
        assert unchanged
        assert len(losses) == 2


def test_load_state_dict_with_assign_into_trained_sharded_params_is_refused():
    """torch would give the module new Parameters that no optimizer trains."""
    for message in run_ranks(workers.load_assign, 2):
        assert message is not None and "load without assign=True" in message


def test_load_state_dict_reports_a_size_mismatch_with_the_whole_shape():
    for message in run_ranks(workers.size_mismatch, 2):
        assert message is not None
        assert "size mismatch for model.norm.weight" in message
        assert "torch.Size([7])" in message and "torch.Size([32])" in message


def _eos_and_stop():
    """A token that the second prompt's greedy continuation makes early and
    the first one's never does."""
    model = workers.tiny_lm("llama").eval()
    first = workers.generate(model, workers.PROMPTS[0], None)[0, 5:].tolist()
    second = workers.generate(model, workers.PROMPTS[1], None)[0, 5:].tolist()
    for i, token in enumerate(second[:8]):
        if token not in first and token not in second[:i]:
            return token
    pytest.skip("no token ends one prompt and not the other")


@pytest.mark.parametrize("mode", ["unit", "budget", "full"])
def test_ranks_whose_sequences_end_apart_generate_as_one_process(mode):
    eos = _eos_and_stop()
    model = workers.tiny_lm("llama").eval()
    expected = [workers.generate(model, prompt, eos) for prompt in workers.PROMPTS]
    assert expected[0].shape[1] != expected[1].shape[1]
    outs = run_ranks(workers.uneven_generation, 2, eos, mode)
    for out, want in zip(outs, expected):
        assert torch.equal(out, want)
