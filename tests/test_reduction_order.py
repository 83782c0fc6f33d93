"""Stage 2 launches each bucket's reduce-scatter as backward completes it,
whatever its param group, in one order that every rank follows."""
import torch

import order_workers as workers
from rlhfz.launch import run_ranks


def test_param_groups_as_trainers_make_them_overlap_backward():
    """A group of biases and norm weights (what transformers' Trainer
    exempts from weight decay) completes only at the first block. Its
    buckets had the highest indices, so every bucket of the weights waited
    for them: the first reduce-scatter was issued after 23 of 24 grads. From
    the second backward on, the buckets follow the order the first one
    completed them in, and the first is issued with a quarter of the grads."""
    steps = 5
    expected = workers.reference(2, steps)
    results = run_ranks(workers.train, 2, steps)
    for result in results:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
        for at, total in result["grads_at"][1:]:
            assert at == sorted(at) and len(at) >= 6
            assert at[0] <= total // 4, (at, total)
            assert at[len(at) // 2] < total * 3 // 4, (at, total)
    assert results[0]["grads_at"] == results[1]["grads_at"]
