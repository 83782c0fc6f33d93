"""Stage 3 across gloo ranks: sharded params gathered per unit, training
against one process of torch.optim.AdamW, and generation in every mode of
gather_for_generation on GPT-2 and Llama-style models built from configs."""
import pytest
import torch

import rlhfz
import stage3_workers as workers
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")


def _reference_training(kind, steps, checkpointing=False):
    model = workers.tiny_lm(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids in workers.batches(steps):
        opt.zero_grad()
        loss = workers.lm_loss(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters()), opt.state_dict()


@pytest.mark.parametrize("kind, world_size", [("gpt2", 2), ("gpt2", 3), ("llama", 2),
                                              ("llama", 3), ("llama-untied", 2)])
def test_generation_is_identical_in_every_mode(kind, world_size):
    reference = workers.greedy(workers.tiny_lm(kind).eval())
    results = run_ranks(workers.generation_modes, world_size, kind)
    for result in results:
        for mode in ("unit", "full", "budget1", "budget2", "budget3"):
            assert torch.equal(result[mode], reference), mode
            assert result[mode + "_after"] == 0, mode          # back to the shard
        units, total = result["units"], sum(result["units"])
        largest = sorted(units)[-2:]
        # peak gathered bytes, beside the shard every rank keeps
        assert result["unit_peak"] <= sum(largest)                        # two units
        assert result["full_peak"] == total                               # the whole model
        for q in (1, 2, 3):
            budget = total * q // 4
            # B + one unit, and never less than unit by unit
            assert result[f"budget{q}_peak"] <= max(budget + largest[-1], sum(largest)), q
        assert result["hooks_after"] == result["hooks"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generation_gathers_each_unit_once_per_token(kind):
    """Unit by unit, each unit is gathered once per forward, the root (used
    by the embedding, the final norm and the tied head) included, and the
    next unit ahead of its use; a budget that holds the root keeps it, so
    only the blocks are gathered; with grads the root goes after each use.
    More budget never gathers more bytes per token, and the root comes first."""
    reference = workers.greedy(workers.tiny_lm(kind).eval())
    results = run_ranks(workers.generation_gathers, 2, kind)
    for result in results:
        root, sizes = result["root"], result["sizes"]
        assert result["uses"][root] >= 2                     # what made it costly
        largest = sorted(sizes)[-2:]
        for mode in ("unit", "budget"):
            assert torch.equal(result[mode + "_tokens"], reference), mode
        unit = result["unit"]
        assert unit["gathers"] == {i: unit["forwards"] for i in range(len(sizes))}
        # ahead while the held root leaves room for it (two units at most)
        assert unit["ahead"] >= unit["forwards"]
        assert unit["peak"] <= sum(largest)
        budget = result["budget"]
        assert budget["gathers"].get(root) == 1              # once, when the context opens
        assert all(budget["gathers"][i] == budget["forwards"]
                   for i in range(len(sizes)) if i != root)
        assert budget["ahead"] > 0
        assert budget["peak"] <= sizes[root] + largest[-1]
        assert result["raised_gathered"] == 0
        assert result["train_root_gathers"] > 2              # forward uses and backward
        kept, moved = result["kept"], result["per_forward"]
        assert kept[0] == [] and kept[8] == list(range(len(sizes)))
        assert moved[0] == sum(sizes) and moved[8] == 0      # budget 0 is unit by unit
        for q in range(1, 9):                                # more budget never gathers more
            assert moved[q] <= moved[q - 1], (q, moved)
            if sum(sizes) * q // 8 >= sizes[root]:
                assert root in kept[q], q                    # the root first, once it fits


def test_peft_generation_gathers_each_unit_once_per_token():
    pytest.importorskip("peft")
    reference = workers.greedy(workers.lora_model().eval())
    for result in run_ranks(workers.lora_generation_gathers, 2):
        assert torch.equal(result["tokens"], reference)
        assert result["gathers"] == {i: result["forwards"] for i in range(result["units"])}
        assert result["order"] <= result["units"] + 2          # one forward's, the root's uses


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind, world_size, checkpointing, options", [
    ("gpt2", 2, False, None), ("llama", 3, True, None),
    ("gpt2", 2, False, {"offload": "cpu", "offload_ratio": 0.5}),
    ("llama", 3, True, {"bucket_bytes": 4096}), ("llama-untied", 2, False, None)],
    ids=["gpt2-2", "llama-3-checkpointing", "gpt2-2-host-state", "llama-3-pieces",
         "llama-untied-2"])
def test_training_matches_single_process_adamw(kind, world_size, checkpointing, options):
    """50 steps, tied embeddings, clipping; Llama with gradient checkpointing;
    with half of each shard's optimizer state on the host; and with a 4 KiB
    bucket cap, so every unit's grads are reduced in pieces."""
    steps = 50
    ref_losses, ref_params, _ = _reference_training(kind, steps, checkpointing)
    results = run_ranks(workers.train_parity, world_size, kind, steps, checkpointing, options)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        assert result["params"].keys() == ref_params.keys()
        # The whole model within 1e-5 relative. Per tensor the bound is looser:
        # an attention key bias gets grads of rounding size only, which Adam
        # scales up to lr-sized steps whose sign is noise.
        names = sorted(ref_params)
        mine = torch.cat([result["params"][n].reshape(-1) for n in names])
        theirs = torch.cat([ref_params[n].detach().reshape(-1) for n in names])
        assert _relative(mine, theirs) <= 1e-5
        for name in names:
            assert _relative(result["params"][name], ref_params[name].detach()) <= 1e-3, name
    for name, value in results[1]["params"].items():
        assert torch.equal(value, results[0]["params"][name])
    if options:
        assert all("offload after it closes" in r["refused"] for r in results)


@pytest.mark.parametrize("case, world_size", [("tied", 2), ("untied-dora", 2), ("tied", 3)])
def test_lora_and_dora_on_embeddings_and_heads_train_as_one_process(case, world_size):
    """PEFT's embedding layers read their adapters (held in ParameterDicts)
    and DoRA layers their base layer's weight in their own forward, not in
    a child's: each is gathered whole around it. The adapters alone train,
    with ZeroAdamW(model) and with shard_model, as torch.optim.AdamW does
    in one process; greedy tokens unit by unit are the reference's."""
    pytest.importorskip("peft")
    steps = 10
    model = workers.peft_layers(case)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    ref_losses = []
    for ids in workers.batches(steps):
        opt.zero_grad()
        loss = workers.lm_loss(model, ids)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    model.eval()
    tokens = workers.greedy(model)
    reference = model.state_dict()
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert any("lora_embedding_A" in n for n in names)
    for result in run_ranks(workers.peft_layers_parity, world_size, case, steps):
        for how, got in result.items():
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                                       rtol=1e-5, atol=0)
            assert torch.equal(got["tokens"], tokens), how
            state = got["state"]
            assert state.keys() == reference.keys(), how
            for name, value in reference.items():
                if name not in names:                       # frozen: as it was
                    assert torch.equal(state[name], value), (how, name)
            mine = torch.cat([state[n].reshape(-1) for n in names])
            theirs = torch.cat([reference[n].reshape(-1) for n in names])
            assert _relative(mine, theirs) <= 1e-5, how
            for name in names:
                assert _relative(state[name], reference[name]) <= 1e-3, (how, name)


def test_a_root_param_used_around_a_child_that_holds_another_stays_whole():
    """The model's own param is read after its embedding's forward, which
    ends inside the model's: the root unit stays whole until the outer
    forward ends, and training matches torch.optim.AdamW in one process."""
    steps = 5
    model = workers.OwnParamModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_losses = []
    for ids in workers.batches(steps):
        opt.zero_grad()
        loss = model(ids % 50)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    with torch.no_grad():
        evaluated = model(workers.PROMPT % 50)
    for result in run_ranks(workers.own_param_training, 2, steps):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(result["evaluated"], evaluated, rtol=1e-5, atol=1e-7)
        for name, value in model.state_dict().items():
            assert _relative(result["state"][name], value) <= 1e-5, name


def test_exceptions_inside_each_mode_leave_the_model_working():
    reference = workers.greedy(workers.tiny_lm("gpt2").eval())
    results = run_ranks(workers.exception_safety, 2, "gpt2")
    for result in results:
        assert result["errors"] == 3
        assert result["after"] == [0, 0, 0] and result["keep"] == [0, 0, 0]
        assert result["nested_gathered"] > 0 and result["nested_after"] == 0
        assert torch.equal(result["tokens"], reference)
        assert result["trained_after"] == 0
        assert result["hooks_after"] == result["hooks_before"]       # none added, none lost
        trl = result["trl"]
        for gather in (True, False):
            assert trl[f"is_model_{gather}"] and not trl[f"checkpointing_inside_{gather}"]
            assert trl[f"config_inside_{gather}"] == 4
        # the model has trained by then: both settings generate alike
        assert torch.equal(trl["tokens_True"], trl["tokens_False"])
        assert trl["checkpointing_after"] and trl["gathered_after"] == 0
        assert trl["config_after"] != 4
    for name, value in results[1]["params"].items():
        assert torch.equal(value, results[0]["params"][name])


def test_a_step_inside_a_gather_that_holds_units_is_refused():
    for result in run_ranks(workers.step_inside_a_gather, 2):
        first, unchanged, second, unchanged_too = result["refused"]
        assert "Step after the context closes" in first and "Step after" in second
        assert unchanged and unchanged_too and result["unit_by_unit"]


def test_a_submodule_run_alone_first_leaves_the_order_of_units_alone():
    for plain, after_alone in run_ranks(workers.order_after_a_submodule_forward, 2):
        assert after_alone == plain


def test_model_state_dict_after_one_that_raised_gives_whole_tensors():
    assert all(run_ranks(workers.state_dict_after_one_that_raised, 2))


def test_a_deepcopy_of_a_sharded_model_is_refused_with_what_to_do():
    for refused in run_ranks(workers.deepcopy_of_a_sharded_model, 2):
        assert "Copy the model before ZeroAdamW(stage=3) or shard_model" in refused


def test_the_trl_twin_has_trls_signature():
    trl = pytest.importorskip("trl.models.utils")
    import inspect

    from rlhfz.integrations.trl import unwrap_model_for_generation
    ours = inspect.signature(unwrap_model_for_generation).parameters
    theirs = inspect.signature(trl.unwrap_model_for_generation).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()][2:] == [p.default for p in theirs.values()][2:]


def test_the_trl_twin_unwraps_wrappers_not_a_models_own_child_named_module():
    from rlhfz.integrations.trl import unwrap_model_for_generation

    class ValueHead(torch.nn.Module):      # a user's model with a child called "module"
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 1)

    model = ValueHead()
    with unwrap_model_for_generation(model) as unwrapped:
        assert unwrapped is model
    with unwrap_model_for_generation(torch.nn.DataParallel(model)) as unwrapped:
        assert unwrapped is model


def test_a_rank_that_never_enters_makes_the_others_fail():
    results = run_ranks(workers.one_rank_skips, 2)
    assert results[1] == "skipped"
    assert results[0] != "no error" and "gather_for_generation" in results[0]


def test_ranks_that_ran_different_units_are_refused_at_the_step():
    for error in run_ranks(workers.one_rank_runs_a_unit_again, 2):
        assert error is not None and "stage-3 units gathered since the last step" in error


def test_loads_inside_a_gather_are_refused_and_a_part_gathers_its_model(tmp_path):
    for out in run_ranks(workers.loads_and_parts_inside_a_gather, 2, str(tmp_path)):
        assert len(out["refused"]) == 2
        assert all(e is not None and "gathered" in e for e in out["refused"]), out["refused"]
        assert out["inference_mode_equal"]
        assert out["part_gathered"] == out["whole_gathered"] > 0
        assert torch.equal(out["part_tokens"], out["plain_tokens"])


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32),
                                                              torch.nn.Linear(32, 16))
                                          for _ in range(3))
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight              # tied


def test_units_follow_blocks_sizes_or_classes():
    from rlhfz.stage3 import assign_params
    model = _Blocks()
    params = list(model.parameters())
    units, persistent = assign_params(model, None, 40, params)
    modules = [m for m, _ in units]
    assert modules == list(model.blocks) + [model]           # the root unit last
    root_params = dict(units)[model]
    assert [id(p) for p in root_params] == [id(model.embed.weight)]   # tied: one param, root
    assert all(p.numel() < 40 for p in persistent) and len(persistent) == 6   # the biases
    seen = [id(p) for _, ps in units for p in ps] + [id(p) for p in persistent]
    assert sorted(seen) == sorted(id(p) for p in params)      # every param once
    # by class
    units, _ = assign_params(model, [torch.nn.Linear], 0, params)
    assert sum(isinstance(m, torch.nn.Linear) for m, _ in units) == 6
    # by size, without blocks: no unit over an eighth of the model unless it cannot split
    mlp = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(10)])
    units, _ = assign_params(mlp, None, 0, list(mlp.parameters()))
    assert [m for m, _ in units] == list(mlp)
    with pytest.raises(ValueError, match="wrap must be a list of nn.Module classes"):
        assign_params(mlp, ["Linear"], 0, list(mlp.parameters()))


def test_an_untied_embedding_and_head_bigger_than_a_block_are_units():
    """Each in its registration place; tied, the weight stays in the root."""
    from rlhfz.stage3 import assign_params
    model = workers.tiny_lm("llama-untied")
    units, _ = assign_params(model, None, 64, list(model.parameters()))
    modules = [m for m, _ in units]
    inner = model.model
    assert modules == [inner.embed_tokens, *inner.layers, model.lm_head]
    assert [p for p in dict(units)[model.lm_head]] == [model.lm_head.weight]
    tied = workers.tiny_lm("llama-untied")
    tied.lm_head.weight = tied.model.embed_tokens.weight
    units, _ = assign_params(tied, None, 64, list(tied.parameters()))
    assert [m for m, _ in units] == [*tied.model.layers, tied]
    assert dict(units)[tied][0] is tied.lm_head.weight


def test_gather_for_generation_is_a_no_op_below_stage_3_and_checks_its_arguments():
    import rlhfz
    model = _Blocks()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for stage in (0, 2, 3):               # one process: nothing is sharded
        rlhfz.ZeroAdamW(list(model.parameters()) if stage < 3 else model, stage=stage)
        for options in (dict(enabled=True), dict(enabled=False), dict(budget_bytes=10)):
            with rlhfz.gather_for_generation(model, **options) as inside:
                assert inside is model
        names = [name for name, _ in rlhfz.iter_full_params(model, 1024)]
        assert names == [name for name, _ in model.named_parameters()]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for bad, error in ((dict(enabled="yes"), TypeError), (dict(budget_bytes=-1), ValueError),
                       (dict(budget_bytes=1.5), ValueError)):
        with pytest.raises(error):
            with rlhfz.gather_for_generation(model, **bad):
                pass
    with pytest.raises(ValueError, match="bucket_bytes must be an int > 0"):
        list(rlhfz.iter_full_params(model, 0))


def test_a_unit_called_alone_that_raised_is_let_go():
    """A raise inside a unit's module, called outside a forward of the model,
    leaves no count that would keep the unit whole at its next call."""
    for result in run_ranks(workers.block_that_raised, 2):
        assert result["after_raise"] == 0
        assert result["after_good"] == 0
        assert result["after_backward"] == 0
        assert result["error"] < 1e-6


def test_torch_optimizer_over_sharded_params_is_refused():
    """Between uses a stage-3 param is an empty placeholder whose grad no rank
    reduced for another optimizer: torch's optimizers are refused before
    they step (torch's own error would name only a size), while a plain
    model's still train."""
    for result in run_ranks(workers.torch_optimizer_on_placeholders, 2):
        for case in ("live", "closed", "shard_model", "added"):
            assert result[case] is not None, case
            assert "sharded at stage 3" in result[case], result[case]
            assert "ZeroAdamW" in result[case]
        assert result["stepped"] and result["plain_stepped"]


def test_torch_optimizer_over_a_one_process_sharded_model_trains():
    """With one process shard_model leaves the params whole: nothing to refuse."""
    model = workers.tiny_lm("gpt2")
    rlhfz.shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    model(workers.PROMPT).logits.sum().backward()
    opt.step()
    assert not torch.equal(before, model.transformer.h[0].mlp.c_fc.weight)


def test_a_unit_that_changes_its_input_in_place_trains_as_torch():
    """Stage 3 passes each unit's inputs through an autograd node of its
    own, to learn when backward is done with the unit; an in-place op on
    such an input was refused there (a view made inside a custom Function)."""
    for diff in run_ranks(workers.in_place_input_training, 2, 5):
        assert diff < 1e-6
    # where torch refuses it (tanh saved the tensor changed), the same error
    expected = workers.in_place_on_a_saved_input(False)
    assert expected is not None and "modified by an inplace operation" in expected
    assert run_ranks(workers.in_place_on_a_saved_input_sharded, 2) == [expected] * 2
