"""ZeroAdamW inside transformers.Trainer and TRL's trainers.

    class ZeroGRPOTrainer(ZeroTrainerMixin, GRPOTrainer): pass
    trainer = ZeroGRPOTrainer(model=model, ..., optimizers=(ZeroAdamW(model, stage=3), None))

The mixin goes first among the bases. It:
- installs ZeroAccelerator's behaviour on the trainer's accelerator, so the
  model is not wrapped in DistributedDataParallel (rlhfz reduces grads) and
  clipping goes to the optimizer;
- runs the generation phase (TRL's _generate_and_score_completions) inside
  gather_for_generation, gathering the whole model when the trainer's
  ds3_gather_for_generation is true and unit by unit when it is false;
- with rlhfz_sleep=True, offloads the optimizer state (and grads) to host
  memory for the generation phase and reloads it before the update;
- under stage 3 across ranks, shards the reference and reward models the
  trainer prepares as the policy is sharded (rlhfz_shard_frozen=False keeps
  them whole on every rank), and moves a sharded reference model toward the
  policy (TRL's sync_ref_model) shard by shard, as TRL's callback would on
  whole models; a LoRA model is whole for the rest of the trainer's init
  once TRL adds a "ref" adapter to it, which it fills through p.data;
- saves and loads the optimizer with rlhfz's sharded checkpoints on every
  rank (the Trainer's own path calls state_dict() on one rank only), and the
  model's whole weights under stage 3.

Without a ZeroAdamW among the trainer's optimizers it changes nothing.
"""
from __future__ import annotations

import contextlib
import os
import weakref

from ..generation import gather_for_generation, stage3_of
from .accelerate import zero_accelerator_class, zero_optimizer
from .trl import zero_sync_callbacks

CHECKPOINT_DIR = "rlhfz_optimizer"
SLEEP_KINDS = ("optimizer", "grads")


@contextlib.contextmanager
def sleeping(optimizer, what=SLEEP_KINDS, to="cpu", path=None):
    """The optimizer's state (by default: moments, master weights and grads)
    in host memory, or files under `path`, for the block; back where it
    trains afterwards, also when the block raises. Params stay, so the model
    can generate."""
    opt = zero_optimizer(optimizer)
    if opt is None:
        yield
        return
    opt.offload(what=what, to=to, path=path)
    try:
        yield
    finally:
        opt.reload()


@contextlib.contextmanager
def _whole_once_adapters_are_added(model):
    """Within it, the model is gathered whole from the moment something adds
    an adapter to it: TRL's init adds a frozen "ref" adapter to a PEFT model
    (GRPO with a KL term, RLOO, DPO) and copies the trained one into it
    through p.data, an empty placeholder under stage 3. The copies land in
    the new, whole adapter; leaving releases the rest as it was. A model
    that gets no adapter is never gathered."""
    if stage3_of(model) is None or not callable(getattr(model, "add_adapter", None)) or \
            not hasattr(model, "peft_config"):
        yield
        return
    original = model.add_adapter
    gathered = []
    with contextlib.ExitStack() as whole:
        def add_adapter(*args, **kwargs):
            result = original(*args, **kwargs)
            if not gathered:
                gathered.append(whole.enter_context(gather_for_generation(model)))
            return result
        model.add_adapter = add_adapter        # shadows the method for the init
        try:
            yield
        finally:
            del model.add_adapter


class ZeroTrainerMixin:
    def __init__(self, *args, rlhfz_sleep: bool = False, rlhfz_sleep_to: str = "cpu",
                 rlhfz_sleep_path: str | None = None, rlhfz_shard_frozen: bool = True,
                 **kwargs):
        self.rlhfz_sleep = bool(rlhfz_sleep)
        self.rlhfz_sleep_to = rlhfz_sleep_to
        self.rlhfz_sleep_path = rlhfz_sleep_path
        self.rlhfz_shard_frozen = bool(rlhfz_shard_frozen)
        model = kwargs.get("model", args[0] if args else None)
        with _whole_once_adapters_are_added(model):
            super().__init__(*args, **kwargs)
        zero_sync_callbacks(self.callback_handler)

    # ---- the accelerator ----------------------------------------------------------------

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.__class__ = zero_accelerator_class(type(self.accelerator))
        # the reference and reward models are prepared once the optimizer is
        # known; weak, so the accelerator keeps no cycle through the trainer
        trainer = weakref.ref(self)

        def shard_like():
            owner = trainer()
            return owner.rlhfz_optimizer if owner is not None and owner.rlhfz_shard_frozen \
                else None
        self.accelerator.rlhfz_shard_like = shard_like

    @property
    def rlhfz_optimizer(self):
        return zero_optimizer(getattr(self, "optimizer", None))

    # ---- generation ---------------------------------------------------------------------

    def _generate_and_score_completions(self, *args, **kwargs):
        opt = self.rlhfz_optimizer
        if opt is None:
            return super()._generate_and_score_completions(*args, **kwargs)
        gather = bool(getattr(self.args, "ds3_gather_for_generation", True))
        sleep = (sleeping(opt, to=self.rlhfz_sleep_to, path=self.rlhfz_sleep_path)
                 if self.rlhfz_sleep else contextlib.nullcontext())
        with sleep, gather_for_generation(self.model, enabled=gather):
            return super()._generate_and_score_completions(*args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir):
        opt = self.rlhfz_optimizer
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        from ..checkpoint import save_checkpoint
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.model, opt)
        if self.args.should_save and self.lr_scheduler is not None:
            import torch
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint):
        opt = self.rlhfz_optimizer
        path = os.path.join(checkpoint, CHECKPOINT_DIR) if checkpoint else None
        if opt is None or path is None or not os.path.isdir(path):
            return super()._load_optimizer_and_scheduler(checkpoint)
        from ..checkpoint import load_checkpoint
        load_checkpoint(path, self.model, opt)
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            import torch
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def save_model(self, output_dir=None, _internal_call=False):
        if stage3_of(self.model) is None:
            return super().save_model(output_dir, _internal_call)
        # Stage 3: the whole weights are gathered by every rank; one writes them.
        from ..checkpoint import full_model_state_dict
        state_dict = full_model_state_dict(self.model)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
