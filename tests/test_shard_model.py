"""shard_model: stage-3 sharding apart from the optimizer, frozen params
included. Reference models with no optimizer, Hugging Face's two param
groups at stage 3, LoRA on a sharded base, whole state dicts and
checkpoints, each across gloo ranks against one process of torch."""
import pytest
import torch

import sharding_workers as workers
import stage3_workers
import rlhfz
from rlhfz.launch import run_ranks

pytest.importorskip("transformers")


def _relative(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("world_size", [2, 3])
def test_two_param_groups_at_stage_3_train_like_torch_adamw(world_size):
    steps = 50
    ref_losses, ref_state = workers.reference_training(workers.hf_groups, steps)
    results = run_ranks(workers.two_groups, world_size, steps)
    first = results[0]
    assert first["groups"] == 2 and first["decay"] == [workers.DECAY, 0.0]
    # a block's weights and biases sit in two groups, in one unit gathered together
    assert first["gathers_per_unit"] == 2
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    full = first["full"]
    assert full.keys() == ref_state.keys()
    names = sorted(ref_state)
    mine = torch.cat([full[n].reshape(-1) for n in names])
    theirs = torch.cat([ref_state[n].reshape(-1) for n in names])
    assert _relative(mine, theirs) <= 1e-5
    assert all(r["full"] == {} for r in results[1:])          # rank0_only


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_frozen_reference_model_is_sharded_with_no_optimizer(world_size):
    results = run_ranks(workers.frozen_model, world_size)
    for r in results:
        padded = sum(n * size for n, size in r["buckets"])
        assert r["held"] * world_size == padded                 # an equal shard each
        # the padding: each param aligned to 64 bytes, each bucket to 64 bytes per rank
        assert padded - r["total"] <= 64 * len(r["numels"]) + 64 * world_size * len(r["buckets"])
        assert r["whole_after"] == 0                            # placeholders between uses
        for key in ("logits_equal", "tokens_equal", "unit_tokens_equal", "params_equal",
                    "state_dict_equal", "keep_vars_placeholders", "full_equal", "tied",
                    "logits_after_reload"):
            assert r[key] is True, key
        assert r["gathered_after_forward"] == 0
        assert r["placement_offloaded"] == ["host"]


def _reference_lora(steps):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(stage3_workers.tiny_lm("gpt2"),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                      target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in stage3_workers.batches(steps):
        opt.zero_grad()
        loss = stage3_workers.lm_loss(model, ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_at_stage_3_shards_the_base_and_keeps_state_for_the_adapters_only():
    pytest.importorskip("peft")
    steps, world_size = 20, 2
    ref_losses, ref_adapters = _reference_lora(steps)
    results = run_ranks(workers.lora, world_size, steps)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        assert r["adapters"].keys() == ref_adapters.keys()
        for name, value in ref_adapters.items():
            assert _relative(r["adapters"][name], value) <= 1e-4, name
        # moments for the adapters' shard only (fp32, two of them), a little padding
        assert r["state_bytes"] <= 8 * r["trainable"] / world_size + 8 * 64 * 16
        # the frozen base: half of it per rank, padding aside
        assert r["frozen_held"] <= r["frozen_total"] / world_size + 64 * 64
        assert r["frozen_held"] >= 0.45 * r["frozen_total"]     # params under 64 stay whole
        assert r["gathered_after_backward"] == [0] * steps     # released after backward


def test_a_sharded_model_refuses_what_would_train_or_shard_it_wrong():
    result = run_ranks(workers.refusals, 2)[0]
    assert "sharded already" in result["twice"]
    assert "stage=3, not stage=2" in result["stage2"]
    assert "wrap=" in result["wrap"] and "leave it out" in result["wrap"]
    assert "frozen" in result["frozen"] and "(97, 32)" in result["frozen"]
    assert "more than one model" in result["mixed"]
    assert "shard_model" in result["plain"]
    assert "meta device" in result["meta"] and "buffers are real" in result["meta"]
    assert "resize the model before shard_model" in result["resize"]
    assert "cast or move the model before shard_model" in result["cast"]
    assert result["late_state"] is True


def test_checkpoints_keep_frozen_shards_and_load_weights_alone(tmp_path):
    for r in run_ranks(workers.checkpoint_frozen, 2, str(tmp_path)):
        assert r == {"policy_equal": True, "reference_equal": True, "weights_equal": True}


def test_in_one_process_shard_model_keeps_params_whole_and_groups_train_at_stage_3():
    model = stage3_workers.tiny_lm("gpt2")
    twin = stage3_workers.tiny_lm("gpt2")
    assert rlhfz.shard_model(model) is model
    assert all(p.numel() > 0 for p in model.parameters())
    opt = rlhfz.ZeroAdamW(workers.hf_groups(model), stage=3, lr=1e-3)
    ref = torch.optim.AdamW(workers.hf_groups(twin), lr=1e-3)
    for ids in stage3_workers.batches(5):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            stage3_workers.lm_loss(m, ids).backward()
            o.step()
    # the whole model: a key bias's grads are rounding noise, which Adam scales up
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    theirs = torch.cat([p.detach().reshape(-1) for p in twin.parameters()])
    assert _relative(mine, theirs) <= 1e-5
    full = rlhfz.full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())


def test_shard_model_checks_its_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        rlhfz.shard_model([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="param_persistence_threshold"):
        rlhfz.shard_model(torch.nn.Linear(2, 2), param_persistence_threshold=-1)
    with pytest.raises(TypeError, match="float32, bfloat16 and float16"):
        rlhfz.shard_model(torch.nn.Linear(2, 2).double())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_save_pretrained_writes_what_transformers_loads_bit_exactly(tmp_path, kind):
    import transformers
    results = run_ranks(workers.pretrained_round_trip, 2, str(tmp_path), kind)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(name.endswith(".safetensors") for name in files) > 1     # max_shard_size
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    state = auto.state_dict()
    whole = results[0]["whole"]
    for name, value in whole.items():
        assert torch.equal(state[name], value), name
    # tied weights stored once
    from safetensors import safe_open
    stored = set()
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / name), framework="pt") as f:
                stored |= set(f.keys())
    assert "lm_head.weight" not in stored
    with torch.no_grad():
        ids = torch.tensor([[5, 17, 23, 42, 8, 9]])
        assert torch.equal(auto(ids).logits, results[0]["logits"])
    for r in results:
        assert r["loaded_equal"] and r["fresh_logits_equal"]
        assert 0 < r["save_peak"] <= r["largest_unit"]       # one unit at a time


def test_save_pretrained_over_an_earlier_save_leaves_only_its_own_files(tmp_path):
    seen = run_ranks(workers.pretrained_saved_over, 2, str(tmp_path), "gpt2")[0]
    pieces, whole, pieces_again = (s["files"] for s in seen)
    assert all(s["equal"] for s in seen)
    assert "model.safetensors.index.json" in pieces and "model.safetensors" not in pieces
    assert whole == ["model.safetensors"]
    assert pieces_again == pieces


def test_load_pretrained_reads_the_single_file_before_a_stale_index(tmp_path):
    """transformers' own save of a whole model leaves an earlier save's
    index; like from_pretrained, load_pretrained reads model.safetensors."""
    model = stage3_workers.tiny_lm("gpt2")
    rlhfz.save_pretrained(model, tmp_path, max_shard_size="100KB")
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)
    rlhfz.save_pretrained(model, tmp_path)
    twin = stage3_workers.tiny_lm("gpt2", seed=4)
    rlhfz.load_pretrained(twin, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(),
                                                  model.state_dict().values()))


def test_load_pretrained_checks_everything_before_writing(tmp_path):
    model = stage3_workers.tiny_lm("gpt2")
    model.save_pretrained(tmp_path)
    other = stage3_workers.tiny_lm("llama")
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="does not hold this model"):
        rlhfz.load_pretrained(other, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        rlhfz.load_pretrained(other, tmp_path / "nowhere")
    twin = stage3_workers.tiny_lm("gpt2", seed=4)
    rlhfz.load_pretrained(twin, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(),
                                                  model.state_dict().values()))


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_consolidate_writes_the_full_state_dict_as_a_transformers_model(tmp_path, dtype):
    import subprocess
    import sys

    import transformers
    from safetensors.torch import load_file
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    full = run_ranks(workers.checkpoint_for_export, 3, str(ckpt))[0]
    command = [sys.executable, "-m", "rlhfz", "consolidate", str(ckpt), str(out)]
    done = subprocess.run(command + (["--dtype", dtype] if dtype else []), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tensors" in done.stdout
    exported = load_file(str(out / "model.safetensors"))
    cast = torch.bfloat16 if dtype == "bf16" else torch.float32
    for name, value in full.items():
        if name in exported:
            assert torch.equal(exported[name], value.to(cast)), name
        else:
            assert name == "lm_head.weight"                     # tied: stored once
    auto = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=cast)
    for name, value in auto.state_dict().items():
        assert torch.equal(value, full[name].to(cast)), name


def test_consolidate_replaces_an_earlier_model_in_its_folder(tmp_path):
    """As transformers' save_pretrained does: the old shards and index go (a
    load following the index read the old weights), and the old config.json
    where this export writes none."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from rlhfz.checkpoint.export import consolidate
    out = tmp_path / "out"
    out.mkdir()
    shards = [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    for k, shard in enumerate(shards):
        save_file({f"{k}.weight": torch.zeros(8, 8)}, str(out / shard))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"0.weight": shards[0], "1.weight": shards[1]}}))
    (out / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (out / "notes.txt").write_text("not a model file")
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    rlhfz.save_checkpoint(tmp_path / "ckpt", plain, rlhfz.ZeroAdamW(plain.parameters()))
    consolidate(tmp_path / "ckpt", out)
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]
    exported = load_file(str(out / "model.safetensors"))
    for name, value in plain.state_dict().items():
        assert torch.equal(exported[name], value), name


def test_consolidate_writes_the_generation_config_and_drops_another_models(tmp_path):
    """transformers' generate reads generation_config.json beside the
    weights: the export writes the saved model's, and a folder's earlier one
    goes when the saved model had none."""
    import os

    import transformers

    from rlhfz.checkpoint.export import consolidate
    model = stage3_workers.tiny_lm("gpt2", seed=1)
    model.generation_config.max_new_tokens = 7
    model.generation_config.do_sample = True
    rlhfz.save_checkpoint(tmp_path / "ckpt", model, rlhfz.ZeroAdamW(model.parameters()))
    out = tmp_path / "out"
    consolidate(tmp_path / "ckpt", out)
    loaded = transformers.GenerationConfig.from_pretrained(out)
    assert loaded.max_new_tokens == 7 and loaded.do_sample is True

    plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
    rlhfz.save_checkpoint(tmp_path / "plain", plain)
    consolidate(tmp_path / "plain", out)
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_consolidate_refuses_what_it_cannot_export(tmp_path):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "rlhfz", "consolidate", str(tmp_path / "none"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "error:" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "rlhfz", "consolidate", "a", "b", "--dtype",
                           "int8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_a_state_dict_asked_of_one_rank_alone_fails_fast_saying_what_to_call():
    result = run_ranks(workers.state_dict_on_one_rank, 2)[0]
    assert "every rank must call it" in result["error"]
    assert "rlhfz.full_state_dict" in result["error"]
    assert "RLHFZ_STATE_DICT_TIMEOUT" in result["error"]
    assert result["seconds"] < 30


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_model_built_on_the_meta_device_is_sharded_then_filled(tmp_path, world_size):
    """Filled by load_pretrained, each rank reading the rows of its shards
    (3 ranks cut tensors mid-row)."""
    pytest.importorskip("accelerate")
    for r in run_ranks(workers.meta_model, world_size, str(tmp_path)):
        assert r["held"] <= r["total"] / world_size + 64 * 64   # only this rank's shards
        assert "meta device" in r["refused"] and "load_pretrained" in r["refused"]
        assert r["logits_equal"] is True


def test_lora_saves_merged_and_adapters_only_as_peft_and_transformers_load_them(tmp_path):
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel
    steps = 3
    full = run_ranks(workers.lora_saved, 2, str(tmp_path), steps)[0]
    # the same training in one process, merged by PEFT itself
    twin = workers.lora_model()
    twin.load_state_dict(full)
    with torch.no_grad():
        ids = torch.tensor([[5, 17, 23, 42, 8, 9]])
        expected = twin(ids).logits
        reference = twin.merge_and_unload().state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for name, value in merged.state_dict().items():
        assert torch.equal(value, reference[name]), name
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-6)
    assert (tmp_path / "adapters" / "adapter_config.json").exists()
    base = stage3_workers.tiny_lm("gpt2")
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapters")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


def _adapter_files(directory) -> dict:
    """{relative path: {key: tensor}} of every safetensors file PEFT wrote."""
    from safetensors.torch import load_file
    return {str(f.relative_to(directory)): load_file(f)
            for f in sorted(directory.rglob("*.safetensors"))}


def _assert_same_files(ours, theirs):
    assert ours.keys() == theirs.keys()
    for file, tensors in theirs.items():
        assert ours[file].keys() == tensors.keys(), file
        for key, value in tensors.items():
            assert torch.equal(ours[file][key], value), (file, key)


@pytest.mark.parametrize("case", workers.ADAPTER_CASES)
def test_adapters_only_writes_what_peft_writes_not_just_what_trains(tmp_path, case):
    """Frozen parts of the active adapter, other adapters (in their own
    folders), the base embedding PEFT adds: PEFT's own files, key for key."""
    pytest.importorskip("peft")
    model = workers.adapter_case(case)
    model.save_pretrained(tmp_path / "peft")
    rlhfz.save_pretrained(model, tmp_path / "ours", adapters="only")
    _assert_same_files(_adapter_files(tmp_path / "ours"), _adapter_files(tmp_path / "peft"))


def test_adapters_only_at_stage_3_writes_what_peft_writes(tmp_path):
    pytest.importorskip("peft")
    run_ranks(workers.adapters_saved, 2, str(tmp_path / "ours"))
    for case in workers.ADAPTER_CASES:
        workers.adapter_case(case).save_pretrained(tmp_path / "peft" / case)
        _assert_same_files(_adapter_files(tmp_path / "ours" / case),
                           _adapter_files(tmp_path / "peft" / case))


def test_lora_in_one_process_saves_merged_without_changing_the_model(tmp_path):
    pytest.importorskip("peft")
    import transformers
    model = workers.lora_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()                      # a delta that changes the weights
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rlhfz.save_pretrained(model, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    reference = model.merge_and_unload().state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in merged.state_dict().items():
        assert torch.equal(value, reference[name]), name
    with pytest.raises(ValueError, match="max_shard_size"):
        rlhfz.save_pretrained(model, tmp_path, max_shard_size="lots")
    with pytest.raises(TypeError, match="transformers or PEFT model"):
        rlhfz.save_pretrained(torch.nn.Linear(2, 2), tmp_path)


@pytest.mark.parametrize("case", ["embedding", "modules_to_save"])
def test_lora_on_embeddings_and_modules_to_save_saves_as_peft_does(tmp_path, case):
    """Merged: what merge_and_unload leaves, under its names; adapters only:
    PEFT's own files, which load back into the same model."""
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file
    import sync_workers
    model, kind = sync_workers.lora_variant(case)
    rlhfz.save_pretrained(model, tmp_path / "merged")
    rlhfz.save_pretrained(model, tmp_path / "adapters", adapters="only")
    model.save_pretrained(tmp_path / "peft")
    reference = model.merge_and_unload().state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.state_dict().keys() == reference.keys()
    for name, value in merged.state_dict().items():
        assert torch.equal(value, reference[name]), name
    ours, peft_own = (load_file(tmp_path / d / "adapter_model.safetensors")
                      for d in ("adapters", "peft"))
    assert ours.keys() == peft_own.keys()
    assert all(torch.equal(ours[k], peft_own[k]) for k in ours)
    again, _ = sync_workers.lora_variant(case)
    loaded = PeftModel.from_pretrained(stage3_workers.tiny_lm(kind), tmp_path / "adapters")
    with torch.no_grad():
        assert torch.equal(loaded(stage3_workers.PROMPT).logits,
                           again(stage3_workers.PROMPT).logits)


def test_adapters_only_of_tensors_peft_derives_is_refused_at_stage_3(tmp_path):
    """AdaLoRA with a rank pattern: PEFT saves rows it indexes out of the
    adapters, which stage 3 holds as shards. Every rank refuses, says what to
    do, and writes nothing; doing what it says writes PEFT's own files."""
    pytest.importorskip("peft")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = workers.adalora_model()
        model.save_pretrained(tmp_path / "peft")        # one process: PEFT's own
        rlhfz.save_pretrained(model, tmp_path / "ours", adapters="only")
    peft_files = _adapter_files(tmp_path / "peft")
    _assert_same_files(_adapter_files(tmp_path / "ours"), peft_files)
    sharded = tmp_path / "sharded"
    for result in run_ranks(workers.adalora_saved, 2, str(sharded)):
        assert "gather_for_generation" in result["errors"]["only"]
        assert "SVDLinear" in result["errors"]["merged"]     # not merged as PEFT does
        assert result["written"] == []
    _assert_same_files(_adapter_files(sharded / "remedy"), peft_files)


# a threshold of 0 shards every param; 64 keeps norms whole; the two
# differ in units, so the models are read in different orders. Alike, or
# with the policy whole, each rank blends its own shard and sends nothing.
BLEND_LAYOUTS = {
    "both sharded alike": {"policy": 0, "reference": 0, "local": True},
    "both sharded apart": {"policy": 0, "reference": 64, "local": False},
    "reference whole": {"policy": 64, "reference": None, "local": False},
    "policy whole": {"policy": None, "reference": 0, "local": True},
    "a bf16 policy into an fp32 reference": {"policy": 0, "reference": 0, "local": None,
                                             "policy_dtype": torch.bfloat16},
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("layout", sorted(BLEND_LAYOUTS))
def test_blend_params_moves_a_reference_model_as_trl_does_on_whole_copies(world_size, layout):
    pytest.importorskip("trl")
    for r in run_ranks(workers.blend, world_size, BLEND_LAYOUTS[layout], 0.3):
        assert r["bitwise"] and r["changed"]
        if BLEND_LAYOUTS[layout]["local"] is not None:
            assert (r["sent"] == 0) == BLEND_LAYOUTS[layout]["local"], r["sent"]
        if BLEND_LAYOUTS[layout]["reference"] == 0:
            assert r["local"] == 0         # placeholders alone: every param sharded
        assert len(r["errors"]) == 4, r["errors"]
        assert "lm_head.weight" in r["errors"][0] and "Nothing was changed" in r["errors"][0]
        assert "differ in shape" in r["errors"][0]          # the untied vocab
        assert "alpha" in r["errors"][2] and "alpha" in r["errors"][3]
        assert r["unchanged_by_errors"]
        assert r["trained_target"]


def test_accelerate_shards_a_model_prepared_for_evaluation_beside_a_stage3_optimizer():
    pytest.importorskip("accelerate")
    for r in run_ranks(workers.accelerate_reference, 2):
        assert r["local"] == 0 and r["logits_equal"]      # placeholders alone, whole logits
        assert r["blend_bitwise"] and r["blend_sent"] == 0
        assert r["kept_whole"] and r["shared_left"]
