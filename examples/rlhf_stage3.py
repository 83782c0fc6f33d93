"""A GRPO-style RLHF loop at stage 3, on the CPU, with tiny models built from configs:

    torchrun --nproc-per-node 2 examples/rlhf_stage3.py
    python examples/rlhf_stage3.py                  # one process: nothing to shard

- the policy is sharded with shard_model and trained at stage 3 with Hugging
  Face's two param groups (weight decay, and none for biases and norms);
- a frozen reference model and a reward model are sharded with shard_model,
  with no optimizer: no grads, no state;
- each iteration generates under gather_for_generation with the optimizer's
  state offloaded, scores the completions with the reward model, and takes a
  policy step on group-normalized advantages with a KL penalty to the
  reference;
- at the end save_pretrained writes the policy in the Hugging Face layout, and
  transformers reads it back with the same logits.
"""
import os
import tempfile
import time

import torch
import torch.distributed as dist

import rlhfz

VOCAB, PROMPT_LEN, NEW_TOKENS, PROMPTS, GROUP = 64, 4, 8, 2, 4
KL_COEF = 0.05


def causal_lm(seed):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)       # every rank builds the same weights
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True))


def reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(7)
    # It scores the last token that is not its pad token: an id past the
    # policy's vocabulary, which no completion can end in (with the policy's
    # pad id 0, a completion ending in a sampled 0 would be scored early).
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=VOCAB, num_labels=1))


def hf_groups(model, weight_decay=0.01):
    decay = [p for n, p in model.named_parameters() if p.requires_grad
             and not (n.endswith("bias") or "norm" in n)]
    rest = [p for n, p in model.named_parameters() if p.requires_grad
            and (n.endswith("bias") or "norm" in n)]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def token_logps(model, ids):
    logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)


def main(iterations=int(os.environ.get("RLHF_ITERATIONS", "4"))):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    policy = rlhfz.shard_model(causal_lm(0), param_persistence_threshold=64)
    reference = rlhfz.shard_model(causal_lm(0).requires_grad_(False).eval(),
                                  param_persistence_threshold=64)
    scorer = rlhfz.shard_model(reward_model().requires_grad_(False).eval(),
                               param_persistence_threshold=64)
    opt = rlhfz.ZeroAdamW(hf_groups(policy), lr=3e-3, stage=3)
    gen = torch.Generator().manual_seed(100 + rank)
    initial = whole_params(policy)
    start = time.perf_counter()
    for it in range(iterations):
        prompts = torch.randint(3, VOCAB, (PROMPTS, PROMPT_LEN), generator=gen)
        prompts = prompts.repeat_interleave(GROUP, 0)
        policy.eval()
        with rlhfz.offloaded(policy, opt, what=("optimizer", "grads")), \
                rlhfz.gather_for_generation(policy, enabled=True), torch.no_grad():
            # top_k=0: from the whole distribution (transformers' default, 50,
            # would cut off part of what the policy gradient assumes is drawn)
            ids = policy.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  do_sample=True, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, pad_token_id=0)
        with torch.no_grad():
            reward = scorer(input_ids=ids).logits.squeeze(-1)
            ref_logps = token_logps(reference, ids)      # gathered unit by unit
        grouped = reward.view(PROMPTS, GROUP)
        advantage = ((grouped - grouped.mean(1, keepdim=True))
                     / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        policy.train()
        opt.zero_grad()
        logps = token_logps(policy, ids)
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1    # k3 estimator
        loss = (-(logps * advantage[:, None]) + KL_COEF * kl).mean()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        mean_reward = reward.mean().item()
        if world > 1:
            mean_reward = opt.comm.all_reduce_sum_host(mean_reward) / world
        if rank == 0:
            print(f"iteration {it}: reward {mean_reward:+.4f} loss {loss.item():+.4f} "
                  f"kl {kl.mean().item():.5f}", flush=True)
    check_saved(policy, rank, world)
    moved = max(float((p - q).abs().max()) for p, q in zip(whole_params(policy), initial))
    if rank == 0:
        print(f"rlhf_stage3: {iterations} iterations on {world} rank(s), stage {opt.stage}, "
              f"params moved by up to {moved:.3g}, {time.perf_counter() - start:.1f} s",
              flush=True)
    opt.close()            # its process groups, before the default one goes
    if world > 1:
        dist.destroy_process_group()


def whole_params(model):
    """Copies of the params, whole (gathered: a collective)."""
    with rlhfz.gather_for_generation(model):
        return [p.detach().clone() for p in model.parameters()]


def check_saved(policy, rank, world):
    """save_pretrained, then transformers' own loader: the same logits."""
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([[5, 9, 33, 12, 40, 7]])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits
    scratch = tempfile.TemporaryDirectory(prefix="rlhf-stage3-") if rank == 0 else None
    box = [scratch.name if scratch else None]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    rlhfz.save_pretrained(policy, box[0])
    if rank == 0:
        with scratch:
            loaded = AutoModelForCausalLM.from_pretrained(box[0])
            with torch.no_grad():
                same = torch.equal(loaded(input_ids=ids).logits, logits)
        if not same:
            raise SystemExit("rlhf_stage3: the saved policy gives other logits")
        print("saved with save_pretrained; transformers reads it back with the same logits",
              flush=True)


if __name__ == "__main__":
    main()
