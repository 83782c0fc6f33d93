"""A GRPO-style RLHF loop on a local Ray cluster, laid out as OpenRLHF lays
out PPO: actor groups pinned by placement groups, each group training or
serving its model over torch.distributed, and the policy's weights pushed to
a generation engine after every step. CPU only, tiny models from configs.

    python examples/ray_rlhf.py [--steps 3]

The groups (7 processes, one torch.distributed gloo job; each group forms a
process group of its own, and rlhfz works within it):
- policy, 2 ranks: ZeroAdamW at stage 3; its optimizer state and grads are
  offloaded to host memory while the generation engine runs;
- reference, 2 ranks: the initial policy, frozen, sharded with shard_model;
- reward, 2 ranks: a scalar-head model, frozen, sharded with shard_model;
- generation, 1 rank: a plain, unsharded copy of the policy (as a vLLM
  worker holds) that receives the weights with rlhfz.receive_weights over
  the model-update group (policy rank 0 and the engine) after each step.

Each step: sync the weights, offload the policy's optimizer, sample
SAMPLES completions per prompt, score them and take the reference's
log-probs (both groups at once), reload, and update the policy with
group-normalized advantages and a KL penalty. At the end the engine's
logits are checked against the policy's own.
"""
import argparse
import datetime
import os
import socket
import time

import torch

VOCAB, PROMPT_LEN, NEW_TOKENS, PROMPTS, SAMPLES = 64, 4, 8, 4, 4
GROUPS = {"policy": 2, "reference": 2, "reward": 2, "generation": 1}
KL_COEF, LR = 0.05, 3e-3


def ranks_of(layout=GROUPS) -> dict:
    """Global ranks of each group, in the order of the layout."""
    ranks, start = {}, 0
    for name, size in layout.items():
        ranks[name] = list(range(start, start + size))
        start += size
    return ranks


def tiny_policy(seed=0):
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True))


class RewardModel(torch.nn.Module):
    """A tiny transformer with a scalar head on the last token."""

    def __init__(self, seed=1):
        super().__init__()
        from transformers import Qwen2Config, Qwen2Model
        torch.manual_seed(seed)
        self.body = Qwen2Model(Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, ids):
        return self.head(self.body(input_ids=ids).last_hidden_state[:, -1]).squeeze(-1)


def completion_logps(model, ids):
    logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)


class GroupMember:
    """One process of the job: joins it, then makes every group (each rank
    makes every group, in one order, as torch.distributed asks)."""

    def __init__(self, role: str, rank: int, world: int, address: str):
        import torch.distributed as dist
        torch.set_num_threads(1)
        os.environ.setdefault("RLHFZ_COLLECTIVE_TIMEOUT", "120")
        # rlhfz waits on a group of some ranks under that group's own
        # timeout (torch's gloo default is 30 min): a stalled member then
        # fails the others in two minutes instead
        timeout = datetime.timedelta(seconds=float(os.environ["RLHFZ_COLLECTIVE_TIMEOUT"]))
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                                timeout=timeout)
        ranks = ranks_of()
        self.groups = {name: dist.new_group(members, timeout=timeout)
                       for name, members in ranks.items()}
        # the model-update group: the sending trainer and every engine
        self.sync_group = dist.new_group([ranks["policy"][0]] + ranks["generation"],
                                         timeout=timeout)
        self.src = ranks["policy"][0]
        self.role, self.rank = role, rank
        self.group = self.groups[role]
        self.group_rank = dist.get_rank(self.group)

    def ready(self) -> str:
        return f"{self.role} rank {self.group_rank} (global {self.rank}), pid {os.getpid()}"


class Policy(GroupMember):
    def __init__(self, *args):
        super().__init__(*args)
        import rlhfz
        self.model = tiny_policy()
        self.opt = rlhfz.ZeroAdamW(self.model, stage=3, lr=LR, weight_decay=0.0,
                                   process_group=self.group, param_persistence_threshold=64)

    def sync(self) -> dict:
        import rlhfz
        group = self.sync_group if self.rank == self.src else None
        return rlhfz.sync_weights(self.model, group, src=self.src, bucket_bytes=64 << 10,
                                  checksum=True)

    def offload(self) -> dict:
        self.opt.offload(what=("optimizer", "grads"))
        return self.opt.placement()

    def reload(self) -> None:
        self.opt.reload()

    def train(self, ids, advantages, ref_logps) -> dict:
        """One update on this rank's share: the policy-gradient term with
        group-normalized advantages, plus a k3 KL penalty to the reference."""
        self.model.train()
        self.opt.zero_grad()
        logps = completion_logps(self.model, ids)
        ratio = torch.exp(logps - logps.detach())
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1.0
        loss = (-(advantages[:, None] * ratio) + KL_COEF * kl).mean()
        loss.backward()
        norm = self.opt.clip_grad_norm_(1.0)
        self.opt.step()
        return {"loss": loss.item(), "kl": kl.mean().item(), "grad_norm": float(norm)}

    def logits(self, ids):
        import rlhfz
        self.model.eval()
        with rlhfz.gather_for_generation(self.model), torch.no_grad():
            return self.model(input_ids=ids).logits


class Frozen(GroupMember):
    """A frozen model sharded over its group: no optimizer, no grads, no state."""

    build = None

    def __init__(self, *args):
        super().__init__(*args)
        import rlhfz
        self.model = self.build().eval().requires_grad_(False)
        rlhfz.shard_model(self.model, process_group=self.group, param_persistence_threshold=64)


class Reference(Frozen):
    build = staticmethod(tiny_policy)        # the initial policy

    def logps(self, ids):
        with torch.no_grad():
            return completion_logps(self.model, ids)


class Reward(Frozen):
    build = RewardModel

    def score(self, ids):
        with torch.no_grad():
            return self.model(ids)


class Generation(GroupMember):
    def __init__(self, *args):
        super().__init__(*args)
        self.model = tiny_policy(seed=123).eval()      # its weights come from the policy

    def receive(self) -> dict:
        import rlhfz
        return rlhfz.receive_weights(self.model, self.sync_group, src=self.src)

    def generate(self, prompts, seed: int):
        torch.manual_seed(seed)
        with torch.no_grad():
            # top_k=0: from the whole distribution (transformers' default, 50,
            # would cut off part of what the policy gradient assumes is drawn)
            return self.model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                       do_sample=True, top_k=0, top_p=1.0,
                                       num_return_sequences=SAMPLES,
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       pad_token_id=0)

    def logits(self, ids):
        with torch.no_grad():
            return self.model(input_ids=ids).logits


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_groups(ray):
    """One placement group per actor group, its bundles packed; every actor
    joins the gloo job at a fresh local address."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    classes = {"policy": Policy, "reference": Reference, "reward": Reward,
               "generation": Generation}
    world, address = sum(GROUPS.values()), f"tcp://127.0.0.1:{_free_port()}"
    actors = {}
    for name, ranks in ranks_of().items():
        pg = placement_group([{"CPU": 0.25}] * len(ranks), strategy="PACK")
        ray.get(pg.ready())
        remote = ray.remote(num_cpus=0.25)(classes[name])
        actors[name] = [remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote(name, rank, world, address)
            for i, rank in enumerate(ranks)]
    return actors


def halves(t: torch.Tensor, n: int) -> list:
    return list(t.chunk(n))


def main(steps: int) -> None:
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", configure_logging=False)
    started = time.perf_counter()
    try:
        actors = start_groups(ray)
        members = [a for group in actors.values() for a in group]
        for line in ray.get([a.ready.remote() for a in members]):
            print(f"ray_rlhf: {line}")
        policy, reference, reward = actors["policy"], actors["reference"], actors["reward"]
        engine = actors["generation"][0]
        prompts_gen = torch.Generator().manual_seed(7)
        for step in range(steps):
            synced = ray.get([p.sync.remote() for p in policy] + [engine.receive.remote()])
            placement = ray.get([p.offload.remote() for p in policy])[0]
            prompts = torch.randint(3, VOCAB, (PROMPTS, PROMPT_LEN), generator=prompts_gen)
            ids = ray.get(engine.generate.remote(prompts, seed=step))
            ref_parts = [r.logps.remote(part) for r, part in zip(reference,
                                                                 halves(ids, len(reference)))]
            score_parts = [w.score.remote(part) for w, part in zip(reward,
                                                                   halves(ids, len(reward)))]
            ref_logps = torch.cat(ray.get(ref_parts))
            scores = torch.cat(ray.get(score_parts))
            grouped = scores.view(PROMPTS, SAMPLES)
            advantages = ((grouped - grouped.mean(1, keepdim=True))
                          / (grouped.std(1, keepdim=True) + 1e-6)).reshape(-1)
            ray.get([p.reload.remote() for p in policy])
            stats = ray.get([p.train.remote(i, a, r) for p, i, a, r in zip(
                policy, halves(ids, len(policy)), halves(advantages, len(policy)),
                halves(ref_logps, len(policy)))])
            print(f"ray_rlhf: step {step}: reward {scores.mean():+.4f}, loss "
                  f"{sum(s['loss'] for s in stats) / len(stats):+.4f}, kl "
                  f"{sum(s['kl'] for s in stats) / len(stats):.5f}, synced "
                  f"{synced[-1]['bytes']} bytes in {synced[-1]['buckets']} buckets, optimizer "
                  f"on {placement['exp_avg']} during generation")
        ray.get([p.sync.remote() for p in policy] + [engine.receive.remote()])
        probe = torch.randint(3, VOCAB, (2, 12), generator=prompts_gen)
        theirs = ray.get(engine.logits.remote(probe))
        mine = ray.get([p.logits.remote(probe) for p in policy])[0]
        diff = float((theirs - mine).abs().max())
        if not diff <= 1e-6:               # a NaN fails too
            raise SystemExit(f"ray_rlhf: the engine's logits differ from the policy's by {diff}")
        print(f"ray_rlhf: after the last sync the generation engine's logits match the "
              f"policy's (max difference {diff:.3g}); {steps} steps on "
              f"{sum(GROUPS.values())} processes in {time.perf_counter() - started:.1f} s")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    main(parser.parse_args().steps)
