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


def trainer_parity(stage, steps=3):
    """transformers' Trainer on a tiny Llama: ZeroAdamW at `stage` and DDP
    with torch.optim.AdamW on the same data, with gradient accumulation and
    clipping; the final params of each."""
    import contextlib
    import io
    import tempfile

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import rlhfz
    from rlhfz.integrations.trainer import ZeroTrainerMixin
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(4, 64, (32, 8), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    ZeroTrainer = type("ZeroTrainer", (ZeroTrainerMixin, Trainer), {})
    out = {}
    for kind in ("torch", "zero"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False))
        args = TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="rlhfz-trainer-"), per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=steps, learning_rate=1e-2,
            lr_scheduler_type="constant", max_grad_norm=1.0, report_to="none", use_cpu=True,
            save_strategy="no", seed=0, disable_tqdm=True, ddp_backend="gloo")
        if kind == "torch":
            opt, cls = torch.optim.AdamW(model.parameters(), lr=1e-2), Trainer
        else:
            opt, cls = rlhfz.ZeroAdamW(model, lr=1e-2, stage=stage), ZeroTrainer
        trainer = cls(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
        out[kind] = {n: t.clone() for n, t in rlhfz.iter_full_params(model)}
        if kind == "zero":
            opt.close()
    return out


def reward_model():
    """A tiny sequence classifier for GRPO's reward, built from a config."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    from examples.grpo_tiny import WORDS
    torch.manual_seed(5)
    return Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0))


def reference_sync(path, steps, alpha=0.3):
    """GRPO with a KL term at stage 3: TRL builds the reference model from
    the policy's folder and moves it toward the policy after every step
    (sync_ref_model); a reward model scores beside a reward function. The
    policy is read after each step, to fold TRL's rule by hand."""
    import tempfile

    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rlhfz
    from rlhfz.integrations.trainer import ZeroTrainerMixin
    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    policies = []

    class ReadPolicy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            policies.append({n: t.clone() for n, t in rlhfz.iter_full_params(model)})

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlhfz-trl-"),
                      per_device_train_batch_size=8 // world, num_generations=4,
                      max_completion_length=6, max_steps=steps, logging_steps=1, report_to="none",
                      bf16=False, fp16=False, use_cpu=True, save_strategy="no", beta=0.04,
                      sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=alpha,
                      learning_rate=1e-2, seed=0, ddp_backend="gloo" if world > 1 else None,
                      dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    opt = rlhfz.ZeroAdamW(model, lr=1e-2, weight_decay=0.0, stage=3,
                          param_persistence_threshold=64)
    cls = type("ZeroGRPOTrainer", (ZeroTrainerMixin, GRPOTrainer), {})
    trainer = cls(model=model, reward_funcs=[reward_model(), reward_even_words], args=args,
                  train_dataset=prompts(), processing_class=tokenizer(),
                  reward_processing_classes=[tokenizer(), None], optimizers=(opt, None),
                  callbacks=[ReadPolicy()])
    reference, scorer = trainer.ref_model, trainer.reward_funcs[0]
    local = {"reference": sum(p.numel() for p in reference.parameters()),
             "reward": sum(p.numel() for p in scorer.parameters())}
    trainer.train()
    expected = {n: t.detach().clone() for n, t in
                AutoModelForCausalLM.from_pretrained(path).named_parameters()}
    for policy in policies:
        for name, value in expected.items():
            value.mul_(1.0 - alpha).add_(policy[name], alpha=alpha)
    got = dict(rlhfz.iter_full_params(reference))
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    with torch.no_grad():
        scored, whole = scorer(input_ids=ids).logits, reward_model()(input_ids=ids).logits
    out = {"local": local,
           "whole": {"reference": sum(t.numel() for t in expected.values()),
                     "reward": sum(p.numel() for p in reward_model().parameters())},
           "syncs": len(policies),
           "bitwise": sorted(got) == sorted(expected) and
           all(torch.equal(got[n], expected[n]) for n in expected),
           "kl": [h["kl"] for h in trainer.state.log_history if "kl" in h],
           "reward_logits_equal": torch.equal(scored, whole)}
    opt.close()
    return out


def peft_reference(optimizer, steps):
    """GRPO with a KL term on a LoRA model: TRL copies the trained adapter
    into a frozen "ref" adapter at init, through p.data. optimizer: 'zero'
    (stage 3) or 'torch' (DDP with torch's AdamW)."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from trl import GRPOConfig, GRPOTrainer

    import rlhfz
    from rlhfz.integrations.trainer import ZeroTrainerMixin
    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = get_peft_model(policy(), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                target_modules=["q_proj", "v_proj"],
                                                init_lora_weights=False))
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlhfz-trl-"),
                      per_device_train_batch_size=8 // world, num_generations=4,
                      max_completion_length=6, max_steps=steps, logging_steps=1, report_to="none",
                      bf16=False, fp16=False, use_cpu=True, save_strategy="no", beta=0.04,
                      learning_rate=1e-2, seed=0, ddp_backend="gloo" if world > 1 else None,
                      dataloader_num_workers=0, disable_tqdm=True)
    if optimizer == "zero":
        opt = rlhfz.ZeroAdamW(model, lr=1e-2, weight_decay=0.0, stage=3,
                              param_persistence_threshold=64)
        cls = type("ZeroGRPOTrainer", (ZeroTrainerMixin, GRPOTrainer), {})
    else:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                weight_decay=0.0)
        cls = GRPOTrainer
    trainer = cls(model=model, reward_funcs=reward_even_words, args=args,
                  train_dataset=prompts(), processing_class=tokenizer(), optimizers=(opt, None))
    trainer.train()
    out = {"adapters": {n: t.clone() for n, t in rlhfz.iter_full_params(model) if "lora_" in n},
           "kl": [h["kl"] for h in trainer.state.log_history if "kl" in h]}
    if optimizer == "zero":
        opt.close()
    return out


def dpo(optimizer, path, steps):
    """TRL's DPOTrainer with the reference model it builds from the
    policy's folder, moved toward the policy after every step
    (sync_ref_model). optimizer: 'zero' (stage 3) or 'torch' (DDP with
    torch's AdamW). The policy's and the reference's final params."""
    import tempfile

    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    import rlhfz
    from rlhfz.integrations.trainer import ZeroTrainerMixin
    warnings.filterwarnings("ignore")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pairs = Dataset.from_dict({"prompt": [f"w{i} w{i + 1}" for i in range(16)],
                               "chosen": [f" w{2 * i % 60}" for i in range(16)],
                               "rejected": [f" w{(2 * i + 1) % 60}" for i in range(16)]})
    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="rlhfz-trl-"),
                     per_device_train_batch_size=8 // world, max_steps=steps, logging_steps=1,
                     report_to="none", bf16=False, fp16=False, use_cpu=True, save_strategy="no",
                     learning_rate=1e-2, seed=0, sync_ref_model=True, ref_model_sync_steps=1,
                     ddp_backend="gloo" if world > 1 else None, dataloader_num_workers=0,
                     disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    if optimizer == "zero":
        opt = rlhfz.ZeroAdamW(model, lr=1e-2, weight_decay=0.0, stage=3,
                              param_persistence_threshold=64)
        cls = type("ZeroDPOTrainer", (ZeroTrainerMixin, DPOTrainer), {})
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        cls = DPOTrainer
    trainer = cls(model=model, args=args, train_dataset=pairs, processing_class=tokenizer(),
                  optimizers=(opt, None))
    trainer.train()
    out = {"policy": {n: t.clone() for n, t in rlhfz.iter_full_params(model)},
           "reference": {n: t.clone() for n, t in rlhfz.iter_full_params(trainer.ref_model)},
           "reference_local": sum(p.numel() for p in trainer.ref_model.parameters()),
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if optimizer == "zero":
        opt.close()
    return out


if __name__ == "__main__":
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("RLHFZ_TEST_DUMP_AFTER", "240")),
                                      exit=True)
    out_path, kind, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if kind == "trainer-parity":
        result = trainer_parity(stage=int(mode), steps=steps)
    elif kind == "reference-sync":
        result = reference_sync(mode, steps)
    elif kind == "peft-reference":
        result = peft_reference(mode, steps)
    elif kind == "dpo":
        optimizer_kind, _, path = mode.partition(":")
        result = dpo(optimizer_kind, path, steps)
    else:
        result = train(kind, steps, "zero", gather=mode == "gather", stage=3, sleep=True)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(result, out_path)
