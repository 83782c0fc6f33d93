"""TRL's GRPOTrainer with rlhfz's ZeroAdamW, on the CPU: a tiny Qwen2 built
from a config and a tokenizer from an in-memory vocabulary (no downloads).

    python examples/grpo_tiny.py                       # stage 2, one process
    torchrun --nproc-per-node 2 examples/grpo_tiny.py  # stage 3 on 2 gloo ranks

ZeroTrainerMixin keeps the model out of DDP (rlhfz reduces grads), gathers
the model for generation as ds3_gather_for_generation says, and with
rlhfz_sleep=True keeps the optimizer state in host memory while it generates.
The KL term (beta > 0) makes TRL build a reference model from the policy's
folder: under stage 3 it is sharded as the policy is, and sync_ref_model
moves it toward the policy shard by shard.
"""
import os
import tempfile
import warnings

import torch

import rlhfz
from rlhfz.integrations.trainer import ZeroTrainerMixin

WORDS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(60)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)},
                                      unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left")


def policy():
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)          # every rank builds the same weights
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True))


def whole_params(model):
    """Copies of the params, whole (gathered under stage 3: a collective)."""
    with rlhfz.gather_for_generation(model):
        return [p.detach().clone() for p in model.parameters()]


def even_words(completions, **kwargs):
    return [float(sum(1 for w in c.split() if w[1:].isdigit() and int(w[1:]) % 2 == 0))
            for c in completions]


def main():
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    warnings.filterwarnings("ignore")

    class ZeroGRPOTrainer(ZeroTrainerMixin, GRPOTrainer):
        pass

    world = int(os.environ.get("WORLD_SIZE", "1"))
    scratch = tempfile.TemporaryDirectory(prefix="grpo-tiny-")     # this rank's own
    # TRL builds the reference model from the policy's folder (a hub id
    # elsewhere). Saved before the config starts torch.distributed, since
    # save_pretrained then writes the config on the first rank only.
    folder = os.path.join(scratch.name, "policy")
    policy().save_pretrained(folder)
    args = GRPOConfig(
        output_dir=scratch.name, per_device_train_batch_size=8 // world,
        num_generations=4, max_completion_length=8, max_steps=int(os.environ.get("GRPO_STEPS", 6)),
        logging_steps=1, report_to="none", bf16=False, use_cpu=True, save_strategy="no",
        gradient_checkpointing=False, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2,
        learning_rate=1e-3, seed=0, ds3_gather_for_generation=True, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(folder)
    opt = rlhfz.ZeroAdamW(model, lr=1e-3, weight_decay=0.0, stage=3 if world > 1 else 2,
                          param_persistence_threshold=64)
    dataset = Dataset.from_dict({"prompt": [" ".join(f"w{(3 * i + j) % 60}" for j in range(4))
                                            for i in range(32)]})
    trainer = ZeroGRPOTrainer(model=model, reward_funcs=even_words, args=args,
                              train_dataset=dataset, processing_class=tokenizer(),
                              optimizers=(opt, None), rlhfz_sleep=True)
    initial = whole_params(model)
    result = trainer.train()
    moved = max(float((p - q).abs().max()) for p, q in zip(whole_params(model), initial))
    if trainer.args.process_index == 0:
        kl = [h["kl"] for h in trainer.state.log_history if "kl" in h]
        print(f"grpo_tiny: {result.global_step} steps on {world} rank(s), stage {opt.stage}, "
              f"loss {result.training_loss:.4g}, params moved by up to {moved:.3g}, "
              f"last KL to the reference {kl[-1]:.3g}, "
              f"{result.metrics['train_runtime']:.1f} s", flush=True)
    scratch.cleanup()
    # The process groups go before the interpreter does: torch's gloo threads
    # torn down during finalization can abort the process after a good run.
    opt.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
