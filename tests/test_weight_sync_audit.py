"""Weight sync where the two sides part ways: a sync cut off part way, and
adapters sent alone into a PEFT receiver with adapters of its own."""
import pytest
import torch

import sync_workers as workers
from rlhfz.launch import run_ranks


def test_a_receiver_cut_off_midway_says_its_model_is_partly_written():
    sender, receiver = run_ranks(workers.sync_cut_off_midway, 2, timeout=120)
    assert sender == "the sender stops here"
    assert 0 < receiver["changed"] < receiver["params"], receiver     # some buckets landed
    error = receiver["error"]
    assert error is not None and "weight-sync bucket" in error, error
    assert "partly written" in error and "receive_weights" in error, error


def test_adapters_alone_cover_every_active_adapter_of_both_sides():
    """A PEFT receiver with adapters the sender has none for is refused (they
    would stay as they were, and its outputs differ), and the sender sends an
    active adapter it froze."""
    pytest.importorskip("peft")
    sender, receiver = run_ranks(workers.sync_adapters_apart, 2, timeout=180)
    assert len(sender["errors"]) == 1 and len(receiver["errors"]) == 1, (sender, receiver)
    for error in sender["errors"] + receiver["errors"]:
        assert "in this model but not sent" in error and "c_fc.lora_A" in error, error
    assert receiver["untouched"]
    assert torch.equal(receiver["logits"], sender["logits"])


def test_dtype_casts_every_floating_tensor_as_torch_does():
    sender, receiver = run_ranks(workers.sync_cast_buffers, 2, timeout=120)
    assert isinstance(receiver, dict), receiver
    assert receiver.keys() == sender.keys()
    for name, value in sender.items():
        assert receiver[name].dtype == value.dtype and torch.equal(receiver[name], value), name
    assert receiver["fine"].dtype == torch.bfloat16 and receiver["count"].dtype == torch.int64
