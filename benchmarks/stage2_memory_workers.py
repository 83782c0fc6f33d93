"""Per-rank body of the stage 2 memory benchmark (importable by spawned ranks)."""
STEPS = 3
# rlhfz's defaults, given to DeepSpeed's AdamW as well; no clipping in either
HPARAMS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
MICRO_BATCH = 2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _peak_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(rank, world_size, impl, bucket_bytes):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    if impl == "deepspeed_zero2":
        import training_workers
        from peers import deepspeed_in_rank
        deepspeed_in_rank()       # imported here, so its footprint is in the baseline
    else:
        import rlhfz
    baseline = _rss_bytes()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=32000,
                                     n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # the peak so far after each phase: where the peak is reached
    peaks = {"model": _peak_rss()}
    if impl == "deepspeed_zero2":
        engine = training_workers.deepspeed_engine(model, 2, MICRO_BATCH, HPARAMS)
        opt = None
    else:
        opt = rlhfz.ZeroAdamW(model, stage=2, bucket_bytes=bucket_bytes, **HPARAMS)
    peaks["optimizer"] = _peak_rss()
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 32000, (MICRO_BATCH, 64), generator=gen)
        if opt is None:
            engine.zero_grad()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        else:
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        peaks.setdefault("first_step", _peak_rss())
    result = {"param_bytes": params, "largest_param": largest, "rss_after_imports": baseline,
              "peak_rss": _peak_rss(), "peak_rss_after": peaks}
    if opt is None:
        zero = engine.optimizer
        # the fp32 copy of this rank's partition, kept apart from the params
        # even in fp32, and the same size again for its reduced grads, which
        # DeepSpeed allocates for each backward (beside its reduce bucket)
        master = sum(t.numel() * t.element_size() for t in zero.single_partition_of_fp32_groups)
        result["master_partition_bytes"] = master
        result["grad_partition_bytes"] = master
        result["reduce_bucket_bytes"] = int(zero.reduce_bucket_size) * 4
    else:
        result["grads"] = sum(opt.memory_report()["grads"].values())
    return result
