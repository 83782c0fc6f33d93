"""Convergence with low-precision moments: a tiny GPT-2 trained from a config
for 500 steps on a fixed synthetic corpus, at lr 1e-3 and 3e-4, seeds 0-2,
with state_dtype fp32, bf16 and int8 (same seed, same batches, same init).

The loss averaged over the last 50 steps must be within 1% (bf16) and 2%
(int8) of the fp32-state run with the same lr and seed. The curves go to
benchmarks/state_dtype_convergence.png and the numbers to
benchmarks/state_dtype_convergence.json (RESULTS.md quotes them).

The corpus is a fixed random bigram process over 256 tokens, each token
followed by a few likely ones, so there is structure to learn but the loss
cannot go to zero. Nothing is downloaded: the model is built from a config.

Run: python -m pytest benchmarks/test_bench_state_dtype_convergence.py -q -s
"""
import json
import os
import time

import pytest
import torch

import rlhfz

transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, TAIL = 500, 50
LRS = (1e-3, 3e-4)
SEEDS = (0, 1, 2)
TARGETS = {"bf16": 0.01, "int8": 0.02}
VOCAB, SEQ, BATCH = 256, 64, 16


def corpus(tokens=200_000, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    # each token's next token: one of 8 followers, Zipf-weighted
    followers = torch.randint(0, VOCAB, (VOCAB, 8), generator=gen)
    weights = 1.0 / torch.arange(1, 9, dtype=torch.float64)
    picks = torch.multinomial(weights.float(), tokens, replacement=True, generator=gen)
    out = torch.empty(tokens, dtype=torch.long)
    out[0] = 0
    for i in range(1, tokens):
        out[i] = followers[out[i - 1], picks[i]]
    return out


def tiny_gpt2(seed):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def train(data, lr, seed, state_dtype):
    model = tiny_gpt2(seed)
    opt = rlhfz.ZeroAdamW(model.parameters(), lr=lr, weight_decay=0.01, stage=0,
                          state_dtype=state_dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, data.numel() - SEQ - 1, (BATCH,), generator=gen)
        batch = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the moments really are kept in state_dtype: their bytes per param
    report = opt.memory_report()
    moments = sum(sum(report[k].values()) for k in ("exp_avg", "exp_avg_sq"))
    return losses, moments / sum(p.numel() for p in model.parameters())


def _plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(LRS), figsize=(6 * len(LRS), 4), sharey=True)
    colors = {"fp32": "black", "bf16": "tab:blue", "int8": "tab:orange"}
    for ax, lr in zip(axes, LRS):
        for key, losses in runs.items():
            dtype, run_lr, seed = key.split("/")
            if float(run_lr) != lr:
                continue
            smooth = torch.tensor(losses).unfold(0, 10, 1).mean(dim=1)
            ax.plot(range(9, STEPS), smooth, color=colors[dtype], alpha=0.7, linewidth=1,
                    label=dtype if seed == "0" else None)
        ax.set_title(f"tiny GPT-2, lr {lr:g}, seeds {SEEDS}")
        ax.set_xlabel("step")
        ax.legend()
    axes[0].set_ylabel("training loss (10-step mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def test_low_precision_moments_converge_as_fp32_does():
    torch.set_num_threads(2)
    data = corpus()
    runs, tails, seconds, moment_bytes = {}, {}, {}, {}
    for lr in LRS:
        for seed in SEEDS:
            for state_dtype in ("fp32", "bf16", "int8"):
                key = f"{state_dtype}/{lr:g}/{seed}"
                start = time.perf_counter()
                runs[key], moment_bytes[state_dtype] = train(data, lr, seed, state_dtype)
                seconds[key] = round(time.perf_counter() - start, 1)
                tails[key] = sum(runs[key][-TAIL:]) / TAIL
    gaps = {}
    for key, tail in tails.items():
        state_dtype, lr, seed = key.split("/")
        if state_dtype != "fp32":
            gaps[key] = (tail - tails[f"fp32/{lr}/{seed}"]) / tails[f"fp32/{lr}/{seed}"]
    with open(os.path.join(HERE, "state_dtype_convergence.json"), "w") as f:
        json.dump({"steps": STEPS, "tail": TAIL, "tail_loss": tails, "relative_gap": gaps,
                   "seconds": seconds, "moment_bytes_per_param": moment_bytes,
                   "torch": torch.__version__}, f, indent=1)
    _plot(runs, os.path.join(HERE, "state_dtype_convergence.png"))
    for key, gap in gaps.items():
        print(f"{key}: last-{TAIL} mean {tails[key]:.4f}, {100 * gap:+.2f}% against fp32")
    for key, gap in gaps.items():
        assert abs(gap) <= TARGETS[key.split("/")[0]], (key, gap)
