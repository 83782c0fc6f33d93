"""Per-rank bodies of the shard_model tests (importable by spawned ranks):
frozen models sharded without an optimizer, Hugging Face's two param
groups at stage 3, LoRA on a sharded base, and whole state dicts."""
import os

import torch

import rlhfz
from stage3_workers import batches, greedy, lm_loss, tiny_lm

DECAY = 0.1


def hf_groups(model):
    """transformers' split: weight decay for weights, none for biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith("bias") or "ln" in name or "norm" in name
         else decay).append(p)
    return [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def reference_training(groups, steps, clip=True):
    """One process of torch.optim.AdamW on the tiny GPT-2 with the param
    groups groups(model) gives: (losses, state dict)."""
    model = tiny_lm("gpt2")
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    losses = []
    for ids in batches(steps):
        opt.zero_grad()
        loss = lm_loss(model, ids)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def train(model, opt, rank, world_size, steps, clip=True, after_backward=None):
    """Steps on this rank's rows of each global batch; the mean loss over
    all ranks at each step."""
    losses = []
    for ids in batches(steps):
        opt.zero_grad()
        loss = lm_loss(model, ids[rank::world_size])
        loss.backward()
        if after_backward is not None:
            after_backward()
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step()
        total = loss.detach().clone()
        if world_size > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def two_groups(rank, world_size, steps):
    """shard_model, then ZeroAdamW over HF's two groups at stage 3."""
    model = rlhfz.shard_model(tiny_lm("gpt2"), param_persistence_threshold=64)
    opt = rlhfz.ZeroAdamW(hf_groups(model), stage=3, lr=1e-3)
    losses = train(model, opt, rank, world_size, steps)
    units = len(opt.stage3.units)
    gathers_per_unit = max(len(buckets) for _, buckets in opt.stage3.units)
    full = rlhfz.full_state_dict(model)
    return {"losses": losses, "full": full, "units": units, "groups": len(opt.param_groups),
            "gathers_per_unit": gathers_per_unit,
            "decay": [g["weight_decay"] for g in opt.param_groups]}


def frozen_model(rank, world_size):
    """A reference model sharded with no optimizer: bytes held, generation,
    logits, iter_full_params, state dicts, offload and reload."""
    reference = tiny_lm("llama", seed=3).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    numels = [p.numel() for p in reference.parameters()]
    ids = torch.tensor([[5, 17, 23, 42, 8, 9]])
    with torch.no_grad():
        logits = reference(ids).logits
    tokens = greedy(reference)
    model = rlhfz.shard_model(reference, param_persistence_threshold=0)
    record = model._rlhfz_sharding
    held = sum(b.storage.buffers["param"].nbytes for b in record.engine.buckets)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())   # placeholders: 0
    out = {"total": total, "held": held, "whole_after": whole, "numels": numels,
           "buckets": [(b.layout.padded_numel, b.itemsize) for b in record.engine.buckets]}
    with torch.no_grad():
        out["logits_equal"] = torch.equal(model(ids).logits, logits)
    out["gathered_after_forward"] = record.stage3.gathered_bytes()
    out["tokens_equal"] = torch.equal(greedy(model), tokens)
    with rlhfz.gather_for_generation(model, enabled=False):
        out["unit_tokens_equal"] = torch.equal(greedy(model), tokens)
    out["params_equal"] = all(torch.equal(t, dict(tiny_lm("llama", seed=3).named_parameters())
                                          [name].detach())
                              for name, t in rlhfz.iter_full_params(model))
    state = model.state_dict()
    out["state_dict_equal"] = all(torch.equal(state[k], v)
                                  for k, v in tiny_lm("llama", seed=3).state_dict().items())
    out["keep_vars_placeholders"] = all(t.numel() == 0 for t in
                                        model.state_dict(keep_vars=True).values()
                                        if isinstance(t, torch.nn.Parameter))
    full = rlhfz.full_state_dict(model)
    out["full_keys"] = sorted(full)
    out["full_equal"] = rank != 0 or all(torch.equal(full[k], v) for k, v in
                                         tiny_lm("llama", seed=3).state_dict().items())
    out["tied"] = rank != 0 or full["lm_head.weight"] is full["model.embed_tokens.weight"]
    rlhfz.offload(model)
    out["placement_offloaded"] = sorted({b.storage.buffers["param"].tier
                                         for b in record.engine.buckets})
    rlhfz.reload(model)
    with torch.no_grad():
        out["logits_after_reload"] = torch.equal(model(ids).logits, logits)
    return out


def lora(rank, world_size, steps):
    """LoRA on a tiny GPT-2 at stage 3: the base sharded without state, the
    adapters trained; losses and adapters to compare with one process."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_lm("gpt2"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                        target_modules=["c_attn", "c_fc"],
                                                        fan_in_fan_out=True))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_total = sum(p.numel() * p.element_size() for p in model.parameters()
                       if not p.requires_grad)
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    record = model._rlhfz_sharding
    frozen_held = sum(b.storage.buffers["param"].nbytes for b in record.engine.buckets)
    report = opt.memory_report()
    gathered_after_backward = []
    losses = train(model, opt, rank, world_size, steps, clip=False, after_backward=lambda:
                   gathered_after_backward.append(record.stage3.gathered_bytes()))
    adapters = {name: t.clone() for name, t in rlhfz.iter_full_params(model) if "lora_" in name}
    return {"losses": losses, "adapters": adapters, "trainable": trainable,
            "state_bytes": sum(report["exp_avg"].values()) + sum(report["exp_avg_sq"].values()),
            "frozen_held": frozen_held, "frozen_total": frozen_total,
            "gathered_after_backward": gathered_after_backward}


def refusals(rank, world_size):
    """What a sharded model refuses, each with the words that say why."""
    model = rlhfz.shard_model(tiny_lm("gpt2"), param_persistence_threshold=64)
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "no error"
        except (ValueError, TypeError, NotImplementedError) as error:
            out[key] = str(error)
    attempt("twice", lambda: rlhfz.shard_model(model))
    attempt("stage2", lambda: rlhfz.ZeroAdamW(model.parameters(), stage=2))
    attempt("wrap", lambda: rlhfz.ZeroAdamW(model.parameters(), stage=3,
                                            wrap=[torch.nn.Linear]))
    model.transformer.wte.weight.requires_grad_(False)
    attempt("frozen", lambda: rlhfz.ZeroAdamW(list(model.parameters()), stage=3))
    model.transformer.wte.weight.requires_grad_(True)
    plain = tiny_lm("gpt2")
    attempt("mixed", lambda: rlhfz.ZeroAdamW(list(model.parameters())
                                             + list(plain.parameters()), stage=3))
    attempt("plain", lambda: rlhfz.ZeroAdamW(plain.parameters(), stage=3))
    with torch.device("meta"):
        meta = torch.nn.BatchNorm1d(4)              # its running stats on meta too
    attempt("meta", lambda: rlhfz.shard_model(meta))
    attempt("resize", lambda: model.resize_token_embeddings(120))
    cast = rlhfz.shard_model(tiny_lm("llama"), param_persistence_threshold=64)
    try:
        cast.half()
        out["cast"] = "no error"
    except RuntimeError as error:
        out["cast"] = str(error)
    # after refusals the model still trains: unfreezing through add_param_group
    opt = rlhfz.ZeroAdamW([p for n, p in model.named_parameters() if "h.0." not in n], stage=3)
    late = [p for n, p in model.named_parameters() if "h.0." in n]
    opt.add_param_group({"params": late, "weight_decay": 0.0})
    ids = batches(1)[0][rank::world_size]
    opt.zero_grad()
    lm_loss(model, ids).backward()
    opt.step()
    out["late_state"] = all(p in opt.state for p in late)
    return out


def checkpoint_frozen(rank, world_size, directory):
    """A stage-3 policy with a frozen part, saved and loaded; a frozen
    reference model saved and loaded alone."""
    model = tiny_lm("gpt2")
    model.transformer.h[0].requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-3, param_persistence_threshold=64)
    for ids in batches(3):
        opt.zero_grad()
        lm_loss(model, ids[rank::world_size]).backward()
        opt.step()
    before = rlhfz.full_state_dict(model, rank0_only=False)
    policy_dir = os.path.join(directory, "policy")
    rlhfz.save_checkpoint(policy_dir, model, opt)
    fresh = tiny_lm("gpt2", seed=7)
    fresh.transformer.h[0].requires_grad_(False)
    fresh.transformer.wpe.requires_grad_(False)
    opt2 = rlhfz.ZeroAdamW(fresh, stage=3, lr=1e-3, param_persistence_threshold=64)
    rlhfz.load_checkpoint(policy_dir, fresh, opt2)
    after = rlhfz.full_state_dict(fresh, rank0_only=False)
    out = {"policy_equal": all(torch.equal(before[k], after[k]) for k in before)}
    ref = rlhfz.shard_model(tiny_lm("gpt2", seed=5).requires_grad_(False),
                            param_persistence_threshold=0)
    ref_dir = os.path.join(directory, "reference")
    rlhfz.save_checkpoint(ref_dir, ref)
    ref_before = rlhfz.full_state_dict(ref, rank0_only=False)
    other = rlhfz.shard_model(tiny_lm("gpt2", seed=6).requires_grad_(False),
                              param_persistence_threshold=0)
    rlhfz.load_checkpoint(ref_dir, other)
    ref_after = rlhfz.full_state_dict(other, rank0_only=False)
    out["reference_equal"] = all(torch.equal(ref_before[k], ref_after[k]) for k in ref_before)
    # the policy's weights alone, into a model sharded with no optimizer
    weights = rlhfz.shard_model(tiny_lm("gpt2", seed=8), param_persistence_threshold=0)
    rlhfz.load_checkpoint(policy_dir, weights)
    loaded = rlhfz.full_state_dict(weights, rank0_only=False)
    out["weights_equal"] = all(torch.equal(before[k], loaded[k]) for k in before)
    return out


def pretrained_round_trip(rank, world_size, directory, kind):
    """A stage-3 policy trained a little, written with save_pretrained;
    transformers reads it, and load_pretrained reads it into a fresh
    sharded model."""
    model = tiny_lm(kind)
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    for ids in batches(2):
        opt.zero_grad()
        lm_loss(model, ids[rank::world_size]).backward()
        opt.step()
    whole = rlhfz.full_state_dict(model, rank0_only=False)
    ids = torch.tensor([[5, 17, 23, 42, 8, 9]])
    with torch.no_grad():
        logits = model(ids).logits
    stage3 = opt.stage3
    largest_unit = max(stage3.unit_bytes(i) for i in range(len(stage3.units)))
    stage3.peak_bytes = 0
    rlhfz.save_pretrained(model, directory, max_shard_size="100KB")
    save_peak = stage3.peak_bytes
    fresh = rlhfz.shard_model(tiny_lm(kind, seed=9), param_persistence_threshold=0)
    rlhfz.load_pretrained(fresh, directory)
    loaded = rlhfz.full_state_dict(fresh, rank0_only=False)
    with torch.no_grad():
        fresh_logits = fresh(ids).logits
    return {"whole": whole, "logits": logits, "save_peak": save_peak,
            "largest_unit": largest_unit, "loaded_equal":
            all(torch.equal(whole[k], loaded[k]) for k in whole),
            "fresh_logits_equal": torch.equal(fresh_logits, logits)}


def compiled_training(rank, world_size, stage, steps, backend):
    """torch.compile of a model trained by ZeroAdamW: losses, and the whole
    params at the end."""
    model = tiny_lm("gpt2")
    opt = rlhfz.ZeroAdamW(model, stage=stage, lr=1e-3, param_persistence_threshold=64)
    losses = train(torch.compile(model, backend=backend), opt, rank, world_size, steps)
    return {"losses": losses, "full": rlhfz.full_state_dict(model)}


def checkpoint_for_export(rank, world_size, directory):
    """A stage-3 policy with a frozen block, trained a little and saved;
    its whole state dict to compare the export with."""
    model = tiny_lm("gpt2")
    model.transformer.h[1].requires_grad_(False)
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    for ids in batches(2):
        opt.zero_grad()
        lm_loss(model, ids[rank::world_size]).backward()
        opt.step()
    rlhfz.save_checkpoint(directory, model, opt)
    return rlhfz.full_state_dict(model)


def state_dict_on_one_rank(rank, world_size):
    """Rank 0 asks for model.state_dict() alone: it fails within the
    state-dict timeout, saying what to call instead."""
    os.environ["RLHFZ_STATE_DICT_TIMEOUT"] = "5"
    model = rlhfz.shard_model(tiny_lm("gpt2"), param_persistence_threshold=64)
    out = {}
    if rank == 0:
        import time
        start = time.monotonic()
        try:
            model.state_dict()
            out["error"] = "no error"
        except RuntimeError as error:
            out["error"] = str(error)
        out["seconds"] = time.monotonic() - start
    else:
        import time
        time.sleep(15)          # alive, elsewhere: rank 0 waits out the timeout
    return out


def meta_model(rank, world_size, directory):
    """A model built with accelerate.init_empty_weights, sharded: each rank
    allocates only its shards; it refuses to run until load_pretrained
    fills it, then matches the real model."""
    import transformers
    from accelerate import init_empty_weights
    real = tiny_lm("llama", seed=11)
    if rank == 0:
        real.save_pretrained(directory)
    torch.distributed.barrier()
    with init_empty_weights():
        empty = transformers.LlamaForCausalLM(real.config)
    empty.tie_weights()            # as from_pretrained does
    model = rlhfz.shard_model(empty, param_persistence_threshold=0)
    record = model._rlhfz_sharding
    out = {"held": sum(b.storage.buffers["param"].nbytes for b in record.engine.buckets),
           "total": sum(p.numel() * p.element_size() for p in real.parameters())}
    ids = torch.tensor([[5, 17, 23, 42, 8, 9]])
    try:
        model(ids)
        out["refused"] = "no error"
    except RuntimeError as error:
        out["refused"] = str(error)
    rlhfz.load_pretrained(model, directory)
    with torch.no_grad():
        out["logits_equal"] = torch.equal(model(ids).logits, real(ids).logits)
    return out


def lora_model():
    from peft import LoraConfig, get_peft_model
    return get_peft_model(tiny_lm("gpt2"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["c_attn", "c_fc"],
                                                      fan_in_fan_out=True))


def lora_saved(rank, world_size, directory, steps):
    """LoRA at stage 3 trained a little, then saved merged and adapters only."""
    model = lora_model()
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    for ids in batches(steps):
        opt.zero_grad()
        lm_loss(model, ids[rank::world_size]).backward()
        opt.step()
    rlhfz.save_pretrained(model, os.path.join(directory, "merged"), max_shard_size="200KB")
    rlhfz.save_pretrained(model, os.path.join(directory, "adapters"), adapters="only")
    return rlhfz.full_state_dict(model)


def pretrained_saved_over(rank, world_size, directory, kind):
    """save_pretrained into a directory an earlier save wrote, in pieces
    and then whole and then in pieces again: each time load_pretrained
    reads what the last save wrote, and no file of the earlier one is left."""
    model = tiny_lm(kind)
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    seen = []
    for step, limit in enumerate(["100KB", "5GB", "100KB"]):
        opt.zero_grad()
        lm_loss(model, batches(1, seed=step)[0][rank::world_size]).backward()
        opt.step()
        rlhfz.save_pretrained(model, directory, max_shard_size=limit)
        whole = rlhfz.full_state_dict(model, rank0_only=False)
        fresh = rlhfz.shard_model(tiny_lm(kind, seed=9), param_persistence_threshold=0)
        rlhfz.load_pretrained(fresh, directory)
        loaded = rlhfz.full_state_dict(fresh, rank0_only=False)
        torch.distributed.barrier()
        seen.append({"files": sorted(f for f in os.listdir(directory) if "safetensors" in f),
                     "equal": all(torch.equal(whole[k], loaded[k]) for k in whole)})
        torch.distributed.barrier()        # every rank has read before the next save
    return seen


ADAPTER_CASES = ("frozen-part", "inactive", "embed_tokens", "all-frozen")


def adapter_case(case: str):
    """PEFT models whose adapter files hold more than the params that train:
    an active adapter partly frozen, a second adapter that is not active,
    LoRA on embed_tokens (PEFT saves the base embedding too), and a frozen
    model with a modules_to_save head."""
    import warnings
    from peft import LoraConfig, get_peft_model
    kinds = {"frozen-part": ("gpt2", {"target_modules": ["wte", "c_fc"], "fan_in_fan_out": True}),
             "inactive": ("gpt2", {"target_modules": ["c_fc"], "fan_in_fan_out": True}),
             "embed_tokens": ("llama", {"target_modules": ["embed_tokens", "q_proj"]}),
             "all-frozen": ("llama-untied", {"target_modules": ["q_proj"],
                                             "modules_to_save": ["lm_head"]})}
    kind, options = kinds[case]
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_lm(kind), LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **options))
        if case == "inactive":
            model.add_adapter("other", LoraConfig(r=2, target_modules=["c_fc"],
                                                  fan_in_fan_out=True, init_lora_weights=False))
    if case == "frozen-part":
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.requires_grad_(False)
    if case == "all-frozen":
        model.requires_grad_(False)
    return model


def adapters_saved(rank, world_size, directory):
    """Each adapter_case at stage 3 (what trains by ZeroAdamW(model), the
    frozen model by shard_model), saved with adapters='only'."""
    for case in ADAPTER_CASES:
        model = adapter_case(case)
        if any(p.requires_grad for p in model.parameters()):
            rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=16)
        else:
            rlhfz.shard_model(model, param_persistence_threshold=16)
        rlhfz.save_pretrained(model, os.path.join(directory, case), adapters="only")


def adalora_model():
    """AdaLoRA on a tiny GPT-2, with the rank pattern its allocator would set
    (half of each adapter's ranks kept): PEFT's adapter state dict then
    holds tensors it indexes out of the params, not the params."""
    from peft import AdaLoraConfig, get_peft_model
    model = get_peft_model(tiny_lm("gpt2"), AdaLoraConfig(
        target_modules=["c_attn"], init_r=4, target_r=2, total_step=10, tinit=1, tfinal=1))
    names = [n for n, _ in model.named_parameters() if "lora_E" in n]
    model.peft_config["default"].rank_pattern = {
        n.removeprefix("base_model.model.").removesuffix(".default"): [True, False, True, False]
        for n in names}
    return model


def adalora_saved(rank, world_size, directory):
    """save_pretrained of the AdaLoRA model at stage 3, adapters 'only' and
    merged: the error each rank gets and whether anything was written; then
    what the error says to do, PEFT's own save inside gather_for_generation."""
    import warnings
    warnings.simplefilter("ignore")
    model = adalora_model()
    rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=16)
    errors = {}
    for adapters in ("only", "merged"):
        try:
            rlhfz.save_pretrained(model, os.path.join(directory, adapters), adapters=adapters)
            errors[adapters] = None
        except NotImplementedError as caught:
            errors[adapters] = str(caught)
    written = [a for a in errors if os.path.exists(os.path.join(directory, a))
               and os.listdir(os.path.join(directory, a))]
    with rlhfz.gather_for_generation(model):
        if rank == 0:
            model.save_pretrained(os.path.join(directory, "remedy"))
    return {"errors": errors, "written": written}


def _trl_blend(target_state, source_state, alpha):
    """TRL's SyncRefModelCallback mixing whole copies (state dicts)."""
    from trl.trainer.callbacks import SyncRefModelCallback
    target = tiny_lm("llama")
    source = tiny_lm("llama").to(next(iter(source_state.values())).dtype)
    target.load_state_dict(target_state)
    source.load_state_dict(source_state)
    SyncRefModelCallback._sync_target_model(source, target, alpha)
    return target.state_dict()


def blend(rank, world_size, layout, alpha):
    """blend_params into a reference model from a trained policy, each of
    them sharded or whole as layout says, against TRL's blend of whole
    copies; then a blend between unlike models, refused."""
    from rlhfz.model_state import blend_params
    policy, reference = tiny_lm("llama", seed=1), tiny_lm("llama", seed=2)
    if layout.get("policy_dtype") is not None:
        policy = policy.to(layout["policy_dtype"])     # add_ casts it, as torch's does
    if layout["policy"] is not None:
        opt = rlhfz.ZeroAdamW(policy, stage=3, lr=1e-2,
                              param_persistence_threshold=layout["policy"])
    else:
        opt = rlhfz.ZeroAdamW(policy, stage=2, lr=1e-2)
    train(policy, opt, rank, world_size, 2, clip=False)
    if layout["reference"] is not None:
        rlhfz.shard_model(reference, param_persistence_threshold=layout["reference"])
    before = rlhfz.full_state_dict(reference, rank0_only=False)
    expected = _trl_blend(before, rlhfz.full_state_dict(policy, rank0_only=False), alpha)
    comms = [opt.comm] + ([rlhfz.sharding.sharding_of_model(reference).comm]
                          if layout["reference"] is not None else [])
    sent = sum(sum(c.traffic.values()) for c in comms)
    blend_params(reference, policy, alpha, bucket_bytes=4096)
    sent = sum(sum(c.traffic.values()) for c in comms) - sent
    after = rlhfz.full_state_dict(reference, rank0_only=False)
    out = {"bitwise": sorted(after) == sorted(expected) and
           all(torch.equal(after[k], expected[k]) for k in expected),
           "changed": not all(torch.equal(after[k], before[k]) for k in before),
           "local": sum(p.numel() for p in reference.parameters()), "sent": sent,
           "whole": sum(t.numel() for k, t in after.items() if k != "lm_head.weight")}
    errors = []
    for other in ("llama-untied", "gpt2"):
        try:
            blend_params(reference, tiny_lm(other), alpha)
        except ValueError as error:
            errors.append(str(error))
    for bad in (1.5, float("nan")):
        try:
            blend_params(reference, policy, bad)
        except ValueError as error:
            errors.append(str(error))
    out["errors"] = errors
    again = rlhfz.full_state_dict(reference, rank0_only=False)
    out["unchanged_by_errors"] = all(torch.equal(again[k], after[k]) for k in after)
    opt.close()
    # into a trained bf16 model: its optimizer steps from the blended
    # values (its fp32 master follows them), as torch's would
    trained = tiny_lm("llama", seed=1).to(torch.bfloat16)
    frozen = tiny_lm("llama", seed=2).to(torch.bfloat16)
    if layout["policy"] is not None:
        opt = rlhfz.ZeroAdamW(trained, stage=3, lr=0.0,    # a step reads the master back
                              param_persistence_threshold=layout["policy"])
    else:
        opt = rlhfz.ZeroAdamW(trained, stage=2, lr=0.0)
    if layout["reference"] is not None:
        rlhfz.shard_model(frozen, param_persistence_threshold=layout["reference"])
    blend_params(trained, frozen, 0.5)
    blended = rlhfz.full_state_dict(trained, rank0_only=False)
    train(trained, opt, rank, world_size, 1, clip=False)
    stepped = rlhfz.full_state_dict(trained, rank0_only=False)
    out["trained_target"] = all(torch.equal(stepped[k], v) for k, v in blended.items())
    opt.close()
    return out


def accelerate_reference(rank, world_size):
    """A hand-written accelerate loop: a model prepared in evaluation mode
    beside a stage-3 ZeroAdamW is sharded as the policy is, and runs as
    the whole model does."""
    from rlhfz.integrations.accelerate import ZeroAccelerator
    accelerator = ZeroAccelerator(cpu=True)
    policy = tiny_lm("llama", seed=1)
    opt = rlhfz.ZeroAdamW(policy, stage=3, lr=1e-2, param_persistence_threshold=0)
    policy, _ = accelerator.prepare(policy, opt)
    reference = accelerator.prepare_model(tiny_lm("llama", seed=2), evaluation_mode=True)
    ids = torch.tensor([[5, 17, 23, 42, 8, 9]])
    with torch.no_grad():
        same = torch.equal(reference(ids).logits, tiny_lm("llama", seed=2)(ids).logits)
    out = {"local": sum(p.numel() for p in reference.parameters()), "logits_equal": same}
    # a model that shares a param with the sharded reference is left as it is
    class Beside(torch.nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.shared = shared
            self.own = torch.nn.Linear(4, 4)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        beside = accelerator.prepare_model(Beside(reference.model.embed_tokens),
                                             evaluation_mode=True)
    out["shared_left"] = (rlhfz.sharding.sharding_of_model(beside) is None and
                          any("shares params" in str(w.message) for w in caught))
    # what ZeroTrainerMixin(rlhfz_shard_frozen=False) sets: whole on every rank
    accelerator.rlhfz_shard_like = lambda: None
    kept = accelerator.prepare_model(tiny_lm("llama", seed=3), evaluation_mode=True)
    out["kept_whole"] = sum(p.numel() for p in kept.parameters()) == \
        sum(p.numel() for p in tiny_lm("llama", seed=3).parameters())
    # sharded alike, so TRL's sync blends each rank's shard with nothing sent
    train(policy, opt, rank, world_size, 1, clip=False)
    expected = _trl_blend(rlhfz.full_state_dict(reference, rank0_only=False),
                          rlhfz.full_state_dict(policy, rank0_only=False), 0.6)
    sent = sum(opt.comm.traffic.values())
    from rlhfz.model_state import blend_params
    blend_params(reference, policy, 0.6)
    out["blend_sent"] = sum(opt.comm.traffic.values()) - sent
    after = rlhfz.full_state_dict(reference, rank0_only=False)
    out["blend_bitwise"] = all(torch.equal(after[k], v) for k, v in expected.items())
    opt.close()
    return out
