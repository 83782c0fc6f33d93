"""Weight sync where the two sides part ways: a sync cut off part way, and
adapters sent alone into a PEFT receiver with adapters of its own."""
import pytest

import sync_workers as workers
from rlhfz.launch import run_ranks


def test_a_receiver_cut_off_midway_says_its_model_is_partly_written():
    sender, receiver = run_ranks(workers.sync_cut_off_midway, 2, timeout=120)
    assert sender == "the sender stops here"
    assert 0 < receiver["changed"] < receiver["params"], receiver     # some buckets landed
    error = receiver["error"]
    assert error is not None and "weight-sync bucket" in error, error
    assert "partly written" in error and "receive_weights" in error, error
