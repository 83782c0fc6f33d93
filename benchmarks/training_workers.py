"""Per-rank bodies of the training-iteration benchmark (importable by spawned
ranks), and the DeepSpeed engine both DeepSpeed benchmarks build."""
import statistics
import time

# AdamW hyper-parameters, the same for rlhfz and DeepSpeed
HPARAMS = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
# GPT-2, 6 x 512 wide, 16k vocab tied to the head: 27.17M params
CONFIG = dict(n_layer=6, n_embd=512, n_head=8, vocab_size=16000, n_positions=128)
BATCH, SEQ = 4, 64


def deepspeed_config(stage: int, micro_batch: int, clip: float = 0.0) -> dict:
    """ZeRO at `stage`, fp32, DeepSpeed's own defaults for everything else:
    reduce and all-gather buckets of 5e8 elements, contiguous grads, overlap_comm
    off at stage 2 and on at stage 3, and at stage 3 a 5e7-element prefetch
    bucket and a 1e5-element persistence threshold (rlhfz's default too).
    clip: the max global grad norm (0: none)."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def deepspeed_engine(model, stage: int, micro_batch: int, hparams: dict, clip: float = 0.0):
    """A DeepSpeed engine on its CPU accelerator over the gloo group run_ranks
    set up, stepping DeepSpeedCPUAdam (its SIMD AdamW) on each rank's partition."""
    from peers import deepspeed_in_rank
    deepspeed = deepspeed_in_rank()
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    optimizer = DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **hparams)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_config(stage, micro_batch, clip))
    return engine


def make_model():
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)           # the same initial weights for every implementation
    config = transformers.GPT2Config(**CONFIG, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def run(rank, world_size, impl, steps, warmup, clip=0.0):
    """clip: the max global grad norm, as an RLHF loop clips (0: none)."""
    import torch
    torch.set_num_threads(1)
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    # each rank its own fixed batch, so the averaging across ranks matters
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ),
                        generator=torch.Generator().manual_seed(1000 + rank))
    stage = int(impl[-1])
    if impl.startswith("rlhfz"):
        import rlhfz
        rlhfz.set_num_threads(1)      # its kernels default to every CPU; one, as torch's
        opt = rlhfz.ZeroAdamW(model, stage=stage, **HPARAMS)

        def iteration():
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if clip:
                opt.clip_grad_norm_(clip)
            opt.step()
            return loss
    else:
        engine = deepspeed_engine(model, stage, BATCH, HPARAMS, clip)

        def iteration():
            engine.zero_grad()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss
    losses, times = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = iteration()
        end = time.perf_counter()
        losses.append(loss.item())
        if i >= warmup:
            times.append(end - start)
    return {"iter_median_s": statistics.median(times), "losses": losses, "numel": numel}
