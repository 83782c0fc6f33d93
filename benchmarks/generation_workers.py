"""Per-rank bodies of the stage 3 generation benchmark (importable by spawned ranks)."""
import statistics
import time
import warnings

import torch

# the small 12-block model of the first runs, and the two of the user's setup:
# a 35M GPT-2 with a 32k tied vocabulary, and a Llama-style model without ties
MODELS = {
    "gpt2-small": dict(kind="gpt2", layers=12, width=128, heads=4, vocab=512,
                       batch=16, prompt=16, new_tokens=64),
    "gpt2-35m-tied": dict(kind="gpt2", layers=6, width=512, heads=8, vocab=32000,
                          batch=4, prompt=16, new_tokens=24),
    "llama-untied": dict(kind="llama", layers=6, width=512, heads=8, vocab=32000,
                         batch=4, prompt=16, new_tokens=24),
}
BUDGETS = (0, 25, 50, 75, 100)
# fp32 and no optimizer: DeepSpeed then builds only ZeRO-3's param partitioning
# and its gather hooks. The threshold is rlhfz's below; both count elements.
DEEPSPEED_CONFIG = {"train_micro_batch_size_per_gpu": 1,
                    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}


def make_model(name):
    import transformers
    transformers.logging.set_verbosity_error()
    spec = MODELS[name]
    torch.manual_seed(0)
    if spec["kind"] == "gpt2":
        config = transformers.GPT2Config(
            n_layer=spec["layers"], n_embd=spec["width"], n_head=spec["heads"],
            vocab_size=spec["vocab"], n_positions=128, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        hidden_size=spec["width"], intermediate_size=spec["width"] * 8 // 3,
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"], vocab_size=spec["vocab"],
        max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def _generate(model, prompt, new_tokens):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)


def deepspeed_zero3(name, rank):
    """The model in a DeepSpeed ZeRO-3 engine on the CPU accelerator, over the
    gloo group run_ranks made; returns the module, its params partitioned."""
    from peers import deepspeed_in_rank
    deepspeed = deepspeed_in_rank()
    engine, *_ = deepspeed.initialize(model=make_model(name), config=DEEPSPEED_CONFIG)
    return engine.module


def run(rank, world_size, rounds, name="gpt2-small", budgets=(25, 50, 75), deepspeed=False):
    """Tokens/s and peak gathered bytes per mode; the unsharded model runs in
    the same processes, in turn with the others, so all see the same load.
    With deepspeed, DeepSpeed ZeRO-3 generates too, in the same rounds."""
    import rlhfz
    torch.set_num_threads(1)
    spec = MODELS[name]
    prompt = torch.randint(1, spec["vocab"], (spec["batch"], spec["prompt"]),
                           generator=torch.Generator().manual_seed(3))
    unsharded = make_model(name)
    model = make_model(name)
    opt = rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=1000)
    stage3 = opt.stage3
    sizes = [stage3.unit_bytes(i) for i in range(len(stage3.units))]
    total = sum(sizes)
    # an untied model may have no root unit: its embedding and head are units
    root = next((i for i, (module, _) in enumerate(stage3.units) if module is model), None)
    shard = sum(b.storage.buffers["param"].nbytes for _, buckets in stage3.units for b in buckets)
    modes = {"unit_by_unit": dict(enabled=False), "full": dict(enabled=True)}
    for q in budgets:
        modes[f"budget_{q}"] = dict(budget_bytes=total * q // 100)
    ds_model = deepspeed_zero3(name, rank) if deepspeed else None
    times = {mode: [] for mode in ["unsharded", *modes]}
    if ds_model is not None:
        times["deepspeed_zero3"] = []
    peaks = {}
    new_tokens = spec["new_tokens"]
    _generate(unsharded, prompt, new_tokens)
    with rlhfz.gather_for_generation(model, enabled=False):
        _generate(model, prompt, 1)         # the first forward records the unit order
    if ds_model is not None:
        _generate(ds_model, prompt, 1)      # DeepSpeed too traces its module order first
    for _ in range(rounds):
        start = time.perf_counter()
        reference = _generate(unsharded, prompt, new_tokens)
        times["unsharded"].append(time.perf_counter() - start)
        for mode, options in modes.items():
            stage3.peak_bytes = 0
            start = time.perf_counter()
            with rlhfz.gather_for_generation(model, **options):
                tokens = _generate(model, prompt, new_tokens)
            times[mode].append(time.perf_counter() - start)
            peaks[mode] = stage3.peak_bytes
            assert torch.equal(tokens, reference), mode
        if ds_model is not None:
            start = time.perf_counter()
            tokens = _generate(ds_model, prompt, new_tokens)
            times["deepspeed_zero3"].append(time.perf_counter() - start)
            assert torch.equal(tokens, reference), "deepspeed_zero3"
    # weight export
    start = time.perf_counter()
    exported = sum(t.numel() * t.element_size()
                   for _, t in rlhfz.iter_full_params(model, bucket_bytes=total // 4))
    export_s = time.perf_counter() - start
    tokens = spec["batch"] * new_tokens
    return {"tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
            "peak_bytes": peaks, "model_bytes": total, "shard_bytes": shard,
            "unit_bytes": max(sizes), "root_bytes": 0 if root is None else sizes[root],
            "export_gbps": exported / export_s / 1e9, "export_bytes": exported}
