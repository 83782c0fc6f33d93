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


@pytest.mark.parametrize("kind,targets", [("gpt2", ["c_attn", "c_fc", "wte"]),
                                          ("llama", ["q_proj", "v_proj", "embed_tokens"])])
def test_a_bf16_base_with_fp32_adapters_merges_as_merge_and_unload_does(kind, targets):
    """PEFT keeps the adapters of a bf16 base in fp32 (autocast_adapter_dtype).
    merge_and_unload adds a linear layer's fp32 delta to the bf16 weight,
    rounding once; an embedding's it rounds to bf16 first."""
    import copy
    import warnings
    peft = pytest.importorskip("peft")
    from rlhfz.lora_export import merged
    from rlhfz.pretrained import export_entries
    base = workers.tiny_lm(kind).to(torch.bfloat16)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=kind == "gpt2",
            init_lora_weights=False))
        expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    _, entries, _ = export_entries(None, model)
    assert sum(m is not None for _, _, _, m in entries) == 9
    for _, name, t, merge in entries:
        value = merged(t, *merge) if merge else t
        assert value.dtype == torch.bfloat16 and torch.equal(value, expected[name]), name
