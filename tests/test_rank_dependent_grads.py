"""Ranks whose forwards differ: a param that gets a grad on some ranks only
(a branch, an expert, a layer one rank's batch skips), and grads that come
after their bucket was reduced. Every stage matches torch.optim.AdamW in one
process on the mean of the ranks' losses, as DDP averages, and every rank
issues the same collectives in the same order."""
import pytest
import torch

import branch_workers as workers
from rlhfz.launch import run_ranks


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def _check(kind, world_size, stage, extra_of, steps=4, options=None):
    expected = workers.reference(kind, world_size, steps, extra_of)
    results = run_ranks(workers.train, world_size, kind, stage, steps, extra_of, options)
    for result in results:
        assert result["params"].keys() == expected.keys()
        # per tensor, relative: an embedding row with a grad of rounding
        # size gets an lr-sized Adam step whose sign is noise
        for name, value in expected.items():
            assert _relative(result["params"][name], value) <= 1e-5, name
        assert result["per_backward"] == results[0]["per_backward"]
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_branch_taken_on_some_ranks_only(stage, world_size):
    """Rank 0 takes the last block's branch, rank 2 the middle one's too,
    rank 1 none: at stage 3, rank 0 completed the last unit's bucket during
    backward and rank 1 only at its end, so their gathers and reductions
    interleaved differently and every rank failed after the collective
    timeout (a CollectiveError that suggested a dead rank). The branch's
    bias (below the persistence threshold) rides in a whole-param bucket."""
    results = _check("branch", world_size, stage, {0: (2,), 2: (1, 2)})
    if stage == 3:       # reductions still overlap backward's gathers
        assert all(count > 0 for r in results for count in r["overlapped"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_branch_on_some_ranks_of_a_hybrid_mesh(stage):
    """2 replicas of 2 shard ranks; ranks 0 and 3 (one in each replica, in
    different shard positions) take branches the others skip."""
    _check("branch", 4, stage, {0: (2,), 3: (0, 1)}, options={"mesh": True})


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("extra_of", [{}, {1: (1,)}], ids=["both", "one-rank"])
def test_a_module_shared_by_two_reentrant_checkpoints(stage, extra_of):
    """The shared module's grads come in two nested backwards. Its small
    buckets were complete after the first and launched, and the second
    grads were added into staging memory that the launched reduce-scatter
    still read: a silently wrong grad. Now each bucket is reduced again when
    backward ends. "one-rank": rank 1 skips the module's branch in the
    first segment, whose layer has a param group (a bucket) of its own, so
    only rank 0 has grads for that bucket after it went, and rank 1 adds
    zeros to match."""
    options = {"bucket_bytes": 4096, "branch_group": bool(extra_of)}
    results = _check("shared", 2, stage, extra_of, options=options)
    for r in results:
        assert r["shared_reductions"] == [[2] * len(r["shared_reductions"][0])] * 4
        assert len(r["shared_reductions"][0]) == 2


def test_a_backward_without_an_optimizers_params_reduces_nothing_for_it():
    """Two optimizers on one sharded model, the second over an auxiliary
    head (a unit of its own) whose loss odd steps leave out on every rank.
    Backward told each optimizer of each unit it was done with; the second
    opened a round for units holding none of its params, and reduce-
    scattered zeros for its head when backward ended."""
    steps = 4
    expected = workers.two_optimizers_reference(2, steps)
    for result in run_ranks(workers.two_optimizers, 2, steps):
        for name, value in expected.items():
            assert _relative(result["params"][name], value) <= 1e-5, name
        rest, branch = zip(*result["per_step"])
        assert all(n > 0 for n in rest) and all(n > 0 for n in branch[0::2])
        assert list(branch[1::2]) == [0, 0]




def test_ranks_that_run_different_units_are_told_where_with_the_check_on():
    """Rank 0 skips block 1 and rank 1 block 2: with RLHFZ_CHECK_UNITS=1
    every rank fails at the first gather where they part, naming each
    one's unit, before any of its data moved, and nothing steps. Without
    the check, gloo aborted a rank's process there."""
    for result in run_ranks(workers.units_skipped, 2, True):
        assert not result["stepped"]
        assert result["error"].startswith("CollectiveMismatchError: ranks disagree")
        assert "a stage-3 gather" in result["error"]
        assert result["error"].count("(Block)") == 2


def test_a_gather_that_times_out_at_stage_3_says_how_to_find_where_ranks_part():
    """Rank 1 runs two blocks the other way round: a gather times out (its
    prefetches differ), and the error names the check to turn on."""
    for result in run_ranks(workers.units_skipped, 2, False):
        assert not result["stepped"]
        assert result["error"].startswith("CollectiveError")
        assert "RLHFZ_CHECK_UNITS=1" in result["error"] and "wrap=[...]" in result["error"]


def test_an_optimizer_that_gets_grads_on_some_ranks_only_fails_saying_why():
    """Two optimizers at stage 2, the second's params reached by rank 0's
    loss alone: it reduces on rank 0 alone. Every rank fails (nothing can
    tell the others in time), and the error says what to do; doing it (0 *
    the loss elsewhere) trains as torch AdamW on the mean of the losses."""
    for result in run_ranks(workers.aux_on_rank_0, 2, 2, False):
        assert result["error"] is not None
        assert "more than one ZeroAdamW" in result["error"], result["error"]
        assert "0 * the term" in result["error"]
    expected = workers.aux_on_rank_0_reference(2, 3)
    for result in run_ranks(workers.aux_on_rank_0, 2, 3, True):
        assert result["error"] is None
        for name, value in expected.items():
            assert _relative(result["params"][name], value) <= 1e-5, name
