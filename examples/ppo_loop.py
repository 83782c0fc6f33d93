"""A hand-written generate -> score -> update loop on rlhfz (PPO-style clipped
policy gradient), on the CPU with a tiny Qwen2 built from a config.

    python examples/ppo_loop.py
    torchrun --nproc-per-node 2 examples/ppo_loop.py     # stage 3 on 2 gloo ranks

Each iteration:
  1. with the optimizer's state offloaded to host memory (`offloaded`), the
     policy generates inside `gather_for_generation` (whole model gathered
     under stage 3);
  2. completions are scored (reward: the share of even token ids), and the
     log-probs of the sampling policy are kept;
  3. a few clipped-ratio updates follow, with rlhfz's global-norm clip.
"""
import os
import time

import torch
import torch.distributed as dist

import rlhfz

VOCAB, PROMPT_LEN, NEW_TOKENS, BATCH = 64, 4, 8, 8


def policy():
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)          # every rank builds the same weights
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True))


def whole_params(model):
    """Copies of the params, whole (gathered under stage 3: a collective)."""
    with rlhfz.gather_for_generation(model):
        return [p.detach().clone() for p in model.parameters()]


def completion_logps(model, ids, prompt_len):
    logits = model(input_ids=ids).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)


def main(iterations=int(os.environ.get("PPO_ITERATIONS", "6")), epochs=2, clip=0.2):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    model = policy()
    opt = rlhfz.ZeroAdamW(model, lr=3e-3, weight_decay=0.0, stage=3 if world > 1 else 2,
                          param_persistence_threshold=64)
    gen = torch.Generator().manual_seed(100 + rank)
    initial = whole_params(model)
    start = time.perf_counter()
    for it in range(iterations):
        prompts = torch.randint(3, VOCAB, (BATCH, PROMPT_LEN), generator=gen)
        model.eval()
        with rlhfz.offloaded(model, opt, what=("optimizer", "grads")), \
                rlhfz.gather_for_generation(model, enabled=True), torch.no_grad():
            # top_k=0: from the whole distribution (transformers' default, 50,
            # would cut off part of what the policy gradient assumes is drawn)
            ids = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                 do_sample=True, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=0)
            old = completion_logps(model, ids, PROMPT_LEN)
        reward = (ids[:, PROMPT_LEN:] % 2 == 0).float().mean(1)
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
        model.train()
        for _ in range(epochs):
            opt.zero_grad()
            ratio = torch.exp(completion_logps(model, ids, PROMPT_LEN) - old)
            surrogate = torch.minimum(ratio * advantage[:, None],
                                      ratio.clamp(1 - clip, 1 + clip) * advantage[:, None])
            loss = -surrogate.mean()
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
        mean_reward = reward.mean().item()
        if world > 1:
            mean_reward = opt.comm.all_reduce_sum_host(mean_reward) / world
        if rank == 0:
            print(f"iteration {it}: reward {mean_reward:.3f} loss {loss.item():+.4f}", flush=True)
    moved = max(float((p - q).abs().max()) for p, q in zip(whole_params(model), initial))
    if rank == 0:
        print(f"ppo_loop: {iterations} iterations on {world} rank(s), stage {opt.stage}, "
              f"params moved by up to {moved:.3g}, {time.perf_counter() - start:.1f} s",
              flush=True)
    opt.close()            # its process groups, before the default one goes
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
