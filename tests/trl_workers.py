"""GRPO and RLOO from TRL with ZeroAdamW, on a tiny Qwen2 built from a config
and a tokenizer built from an in-memory vocabulary (nothing is downloaded).

Run in the test process (one rank) or under torchrun (as a script):
    torchrun --nproc_per_node 2 tests/trl_workers.py OUT.pt grpo 3 gather
"""
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:     # under the test, PYTHONPATH has it, maybe after another build
    sys.path.insert(0, ROOT)
# The policy, tokenizer and reward the GRPO example trains with.
from examples.grpo_tiny import even_words as reward_even_words  # noqa: E402
from examples.grpo_tiny import policy, tokenizer  # noqa: E402,F401


def prompts(n=16):
    from datasets import Dataset
    return Dataset.from_dict({"prompt": [" ".join(f"w{(3 * i + j) % 60}" for j in range(4))
                                         for i in range(n)]})


def train(trainer_kind, steps, optimizer, gather=True, stage=2, sleep=False, output_dir=None,
          save_steps=None, resume_from=None):
    """Trains for `steps` and returns the final params, the logged losses and
    whether the params changed. optimizer: 'zero' or 'torch'."""
    import tempfile

    import rlhfz
    from rlhfz.integrations.trainer import ZeroTrainerMixin
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    warnings.filterwarnings("ignore")
    Config, Trainer = {"grpo": (GRPOConfig, GRPOTrainer),
                       "rloo": (RLOOConfig, RLOOTrainer)}[trainer_kind]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = Config(output_dir=output_dir or tempfile.mkdtemp(prefix="rlhfz-trl-"),
                  per_device_train_batch_size=8 // world, num_generations=4,
                  max_completion_length=6, max_steps=steps, logging_steps=1, report_to="none",
                  bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
                  save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                  beta=0.0, learning_rate=1e-3, seed=0,
                  ds3_gather_for_generation=gather, ddp_backend="gloo" if world > 1 else None,
                  dataloader_num_workers=0, disable_tqdm=True)
    model = policy()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if optimizer == "zero":
        opt = rlhfz.ZeroAdamW(model, lr=1e-3, weight_decay=0.0, stage=stage,
                              param_persistence_threshold=64)
        cls = type(f"Zero{Trainer.__name__}", (ZeroTrainerMixin, Trainer), {})
        extra = {"rlhfz_sleep": sleep}
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        cls, extra = Trainer, {}
    trainer = cls(model=model, reward_funcs=reward_even_words, args=args,
                  train_dataset=prompts(), processing_class=tokenizer(),
                  optimizers=(opt, None), **extra)
    trainer.train(resume_from_checkpoint=resume_from)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after = {n: t.clone() for n, t in rlhfz.iter_full_params(model)}
    changed = {n: not torch.equal(before[n], after[n]) for n in before}
    out = {"params": after, "losses": losses, "changed": changed,
           "wrapped": type(trainer.model_wrapped).__name__,
           "accelerator": type(trainer.accelerator).__name__}
    if optimizer == "zero":
        out["placement"] = opt.placement()
        out["steps"] = max(int(b.steps.max()) for b in opt.engine.buckets)
        opt.close()
    return out


if __name__ == "__main__":
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("RLHFZ_TEST_DUMP_AFTER", "240")),
                                      exit=True)
    out_path, kind, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    result = train(kind, steps, "zero", gather=mode == "gather", stage=3, sleep=True)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(result, out_path)
