"""Per-rank bodies of the stage 3 generation benchmark (importable by spawned ranks)."""
import statistics
import time
import warnings

import torch

LAYERS, WIDTH, HEADS, VOCAB = 12, 128, 4, 512
PROMPT_LEN, NEW_TOKENS, BATCH = 16, 64, 16


def make_model():
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB,
                                     n_positions=128, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def _generate(model, prompt):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              pad_token_id=0)


def run(rank, world_size, rounds):
    """Tokens/s and peak gathered bytes per mode; the unsharded model runs in
    the same processes, in turn with the others, so all see the same load."""
    import rlhfz
    torch.set_num_threads(1)
    prompt = torch.randint(1, VOCAB, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    unsharded = make_model()
    model = make_model()
    opt = rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=1000)
    stage3 = opt.stage3
    total = sum(stage3.unit_bytes(i) for i in range(len(stage3.units)))
    shard = sum(b.storage.buffers["param"].nbytes for _, buckets in stage3.units for b in buckets)
    modes = {"unit_by_unit": dict(enabled=False), "full": dict(enabled=True)}
    for q in (25, 50, 75):
        modes[f"budget_{q}"] = dict(budget_bytes=total * q // 100)
    times = {name: [] for name in ["unsharded", *modes]}
    peaks = {}
    _generate(unsharded, prompt)
    for _ in range(rounds):
        start = time.perf_counter()
        reference = _generate(unsharded, prompt)
        times["unsharded"].append(time.perf_counter() - start)
        for name, options in modes.items():
            stage3.peak_bytes = 0
            start = time.perf_counter()
            with rlhfz.gather_for_generation(model, **options):
                tokens = _generate(model, prompt)
            times[name].append(time.perf_counter() - start)
            peaks[name] = stage3.peak_bytes
            assert torch.equal(tokens, reference), name
    # weight export
    start = time.perf_counter()
    exported = sum(t.numel() * t.element_size()
                   for _, t in rlhfz.iter_full_params(model, bucket_bytes=total // 4))
    export_s = time.perf_counter() - start
    tokens = BATCH * NEW_TOKENS
    return {"tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
            "peak_bytes": peaks, "model_bytes": total, "shard_bytes": shard,
            "unit_bytes": max(stage3.unit_bytes(i) for i in range(len(stage3.units))),
            "export_gbps": exported / export_s / 1e9, "export_bytes": exported}
