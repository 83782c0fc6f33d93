"""Per-rank body of the stage 2 memory benchmark (importable by spawned ranks)."""
STEPS = 3


def train(rank, world_size, bucket_bytes):
    import resource

    import torch
    import transformers

    import rlhfz
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=32000,
                                     n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    opt = rlhfz.ZeroAdamW(model, stage=2, bucket_bytes=bucket_bytes)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 32000, (2, 64), generator=gen)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"grads": sum(opt.memory_report()["grads"].values()), "param_bytes": params,
            "largest_param": max(p.numel() * p.element_size() for p in model.parameters()),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
