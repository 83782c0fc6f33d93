"""Per-rank bodies of the stage 3 tests (importable by spawned ranks)."""
import os
import warnings

import torch

import rlhfz

PROMPT = torch.tensor([[5, 17, 23, 42, 8], [9, 3, 77, 1, 60]])
NEW_TOKENS = 32
VOCAB = 97


def tiny_lm(kind: str, seed: int = 0):
    """A 4-block GPT-2 or Llama-style causal LM built from a config (no
    downloads), with tied input and output embeddings; "llama-untied": apart,
    and each bigger than a block (so each is a unit of its own)."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB,
                                         n_positions=64, bos_token_id=0, eos_token_id=0,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    untied = kind == "llama-untied"
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=320 if untied else VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=not untied,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def greedy(model):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              pad_token_id=0)


def batches(steps, seed=1, batch=12, length=10):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length), generator=gen) for _ in range(steps)]


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def generation_modes(rank, world_size, kind):
    """Greedy tokens and peak gathered bytes in each mode, and what is
    gathered after each context."""
    model = tiny_lm(kind).eval()
    opt = rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=64)
    stage3 = opt.stage3
    units = [stage3.unit_bytes(i) for i in range(len(stage3.units))]
    total = sum(units)
    shard = sum(b.storage.buffers["param"].nbytes for _, buckets in stage3.units for b in buckets)
    out = {"units": units, "shard": shard, "hooks": len(stage3.handles)}
    modes = [("unit", dict(enabled=False)), ("full", dict(enabled=True))]
    modes += [(f"budget{q}", dict(budget_bytes=total * q // 4)) for q in (1, 2, 3)]
    for mode, options in modes:
        stage3.peak_bytes = 0
        with rlhfz.gather_for_generation(model, **options):
            out[mode] = greedy(model)
        out[mode + "_peak"] = stage3.peak_bytes
        out[mode + "_after"] = stage3.gathered_bytes()
    out["hooks_after"] = len(stage3.handles)
    return out


def _raise(*_):
    raise KeyError("a forward that fails")


def generation_gathers(rank, world_size, kind):
    """Per mode: how many times each unit was gathered (and how many of those
    ahead of its use), and the forwards run; then what budgets keep."""
    model = tiny_lm(kind).eval()
    opt = rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=64)
    stage3 = opt.stage3
    root = next(i for i, (module, _) in enumerate(stage3.units) if module is model)
    sizes = [stage3.unit_bytes(i) for i in range(len(stage3.units))]
    gathers, ahead, forwards = {}, [0], [0]
    start = stage3._start

    def counted(index, async_op):
        gathers[index] = gathers.get(index, 0) + 1
        ahead[0] += bool(async_op)
        return start(index, async_op)
    stage3._start = counted
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    with torch.no_grad():
        model(PROMPT)                           # the order units run in
    out = {"sizes": sizes, "root": root, "uses": stage3.uses()}
    for mode, options in (("unit", dict(enabled=False)),
                          ("budget", dict(budget_bytes=sizes[root]))):
        gathers.clear()
        ahead[0] = forwards[0] = 0
        stage3.peak_bytes = 0
        with rlhfz.gather_for_generation(model, **options):
            out[mode + "_tokens"] = greedy(model)
        out[mode] = {"gathers": dict(gathers), "ahead": ahead[0], "forwards": forwards[0],
                     "peak": stage3.peak_bytes}
    # a no_grad forward that raises after the root's first use lets go of it
    blocks = model.transformer.h if kind == "gpt2" else model.model.layers
    handle = blocks[1].register_forward_pre_hook(_raise)
    try:
        with torch.no_grad():
            model(PROMPT)
    except KeyError:
        out["raised_gathered"] = stage3.gathered_bytes()
    handle.remove()
    # with grads, the root goes after each use
    gathers.clear()
    model(PROMPT).logits.sum().backward()
    out["train_root_gathers"] = gathers.get(root, 0)
    model.zero_grad(set_to_none=True)
    out["kept"], out["per_forward"] = {}, {}
    for q in range(9):
        budget = sum(sizes) * q // 8
        kept = stage3.units_within(budget)
        gathers.clear()
        forwards[0] = 0
        with rlhfz.gather_for_generation(model, budget_bytes=budget):
            greedy(model)
        moved = sum(n * sizes[i] for i, n in gathers.items()) - sum(sizes[i] for i in kept)
        out["kept"][q], out["per_forward"][q] = sorted(kept), moved / forwards[0]
    return out


def exception_safety(rank, world_size, kind):
    """An exception inside each mode leaves the model generating and training."""
    model = tiny_lm(kind)
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-3, param_persistence_threshold=64)
    stage3 = opt.stage3
    hooks = len(stage3.handles)
    out = {"errors": 0}
    for options in (dict(enabled=True), dict(enabled=False), dict(budget_bytes=1 << 16)):
        try:
            with rlhfz.gather_for_generation(model, **options):
                greedy(model)
                raise KeyError("generation failed")
        except KeyError:
            out["errors"] += 1
        out.setdefault("after", []).append(stage3.gathered_bytes())
        out.setdefault("keep", []).append(len(stage3.keep) + stage3.suspended)
    # nesting: full inside unit by unit inside full
    with rlhfz.gather_for_generation(model, enabled=False):
        with rlhfz.gather_for_generation(model):
            with rlhfz.gather_for_generation(model):
                pass
            out["nested_gathered"] = stage3.gathered_bytes()
    out["nested_after"] = stage3.gathered_bytes()
    model.eval()
    out["tokens"] = greedy(model)
    model.train()
    for ids in batches(3):
        opt.zero_grad()
        lm_loss(model, ids[rank::world_size]).backward()
        opt.step()
    out["trained_after"] = stage3.gathered_bytes()
    out["trl"] = trl_twin(model)
    out["hooks_before"], out["hooks_after"] = hooks, len(stage3.handles)
    out["params"] = {name: t.clone() for name, t in rlhfz.iter_full_params(model, 4096)}
    return out


class _Wrapper(torch.nn.Module):
    """What accelerate hands a trainer: the model inside a wrapper."""

    def __init__(self, module):
        super().__init__()
        self.module = module


class _Accelerator:
    @staticmethod
    def unwrap_model(model):
        return model.module


def trl_twin(model):
    """unwrap_model_for_generation in both settings, and after an exception."""
    from rlhfz.integrations.trl import unwrap_model_for_generation
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapped, out = _Wrapper(model), {}
    model.eval()
    for gather in (True, False):
        with unwrap_model_for_generation(wrapped, _Accelerator(), gather_deepspeed3_params=gather,
                                         generation_kwargs={"max_new_tokens": 4}) as unwrapped:
            out[f"is_model_{gather}"] = unwrapped is model
            out[f"checkpointing_inside_{gather}"] = unwrapped.is_gradient_checkpointing
            out[f"config_inside_{gather}"] = unwrapped.generation_config.max_new_tokens
            out[f"tokens_{gather}"] = greedy(unwrapped)
    try:
        with unwrap_model_for_generation(wrapped, _Accelerator(),
                                         generation_kwargs={"max_new_tokens": 4}):
            raise RuntimeError("inference engine crashed")
    except RuntimeError:
        pass
    out["checkpointing_after"] = model.is_gradient_checkpointing
    out["config_after"] = model.generation_config.max_new_tokens
    out["gathered_after"] = model._rlhfz_stage3.gathered_bytes()
    model.gradient_checkpointing_disable()
    model.train()
    return out


def train_parity(rank, world_size, kind, steps, checkpointing, options=None):
    """Stage 3 training; every rank takes its rows of each global batch.
    Returns the losses and the whole params (iter_full_params)."""
    model = tiny_lm(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-3, param_persistence_threshold=64,
                          **(options or {}))
    losses = []
    refused = None
    for step, ids in enumerate(batches(steps)):
        opt.zero_grad()
        loss = lm_loss(model, ids[rank::world_size])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        if options and step == 1:
            with rlhfz.gather_for_generation(model):
                try:
                    opt.offload()
                except RuntimeError as error:
                    refused = str(error)
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
    params = {name: t.clone() for name, t in rlhfz.iter_full_params(model, 8192)}
    return {"losses": losses, "params": params, "peak": opt.stage3.peak_bytes,
            "state_dict": opt.state_dict(), "refused": refused}


def one_rank_skips(rank, world_size):
    """Rank 1 never enters gather_for_generation: rank 0 must fail, not hang."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "5"
    model = tiny_lm("gpt2")
    rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=64)
    if rank == 1:
        return "skipped"
    try:
        with rlhfz.gather_for_generation(model):
            pass
    except Exception as error:        # noqa: BLE001 (the error is the result)
        return f"{type(error).__name__}: {error}"
    return "no error"


def step_inside_a_gather(rank, world_size):
    """A step inside a context that holds units whole would leave them with
    the weights from before it: refused, with nothing changed; unit by unit
    (enabled=False) every unit is gathered anew, so a step there is taken."""
    model = tiny_lm("llama")
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=0)
    ids = batches(1)[0][rank::world_size]
    refused = []
    for kwargs in (dict(enabled=True), dict(budget_bytes=40_000)):
        with rlhfz.gather_for_generation(model, **kwargs):
            lm_loss(model, ids).backward()
            before = rlhfz.full_state_dict(model, rank0_only=False)
            try:
                opt.step()
            except RuntimeError as error:
                refused.append(str(error))
        after = rlhfz.full_state_dict(model, rank0_only=False)
        refused.append(all(torch.equal(before[k], after[k]) for k in before))
        opt.zero_grad()
    with rlhfz.gather_for_generation(model, enabled=False):
        lm_loss(model, ids).backward()
        opt.step()
        with torch.no_grad():
            inside = model(ids).logits
    with torch.no_grad():
        outside = model(ids).logits
    return {"refused": refused, "unit_by_unit": torch.equal(inside, outside)}


def order_after_a_submodule_forward(rank, world_size):
    """A forward of a submodule alone (PEFT's generate runs the base model,
    not the wrapper rlhfz sharded) before the first forward of the whole
    model: the order of units is the whole model's, once each."""
    ids = batches(1)[0][rank::world_size]
    orders = []
    for first_alone in (False, True):
        model = tiny_lm("llama")
        opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=0)
        with torch.no_grad():
            if first_alone:
                for _ in range(3):
                    model.model(ids)
            model(ids)
        orders.append(list(opt.stage3.order))
    return orders


def state_dict_after_one_that_raised(rank, world_size):
    """model.state_dict() that raises midway (a failing module, an
    interrupt) leaves the next one whole tensors, never placeholders."""
    model = tiny_lm("llama")
    rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=0)
    layer = model.model.layers[1].mlp.down_proj

    def fail(*args, **kwargs):
        raise KeyboardInterrupt("interrupted")

    layer._save_to_state_dict = fail
    try:
        model.state_dict()
    except KeyboardInterrupt:
        pass
    del layer._save_to_state_dict
    state = model.state_dict()
    whole = rlhfz.full_state_dict(model, rank0_only=False)
    return all(torch.equal(state[k], whole[k]) for k in whole)


def lora_model(seed: int = 0):
    import peft
    model = tiny_lm("llama", seed)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def lora_generation_gathers(rank, world_size):
    """PEFT's generate runs the base model's forward, not the wrapper's
    that rlhfz sharded: unit by unit, each unit is still gathered once per
    token, the root included, and the order stays one forward's."""
    model = lora_model().eval()
    opt = rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=64)
    stage3 = opt.stage3
    with torch.no_grad():
        model(PROMPT)                           # the order units run in
    gathers, forwards = {}, [0]
    start = stage3._start

    def counted(index, async_op):
        gathers[index] = gathers.get(index, 0) + 1
        return start(index, async_op)
    stage3._start = counted
    model.get_base_model().register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    with rlhfz.gather_for_generation(model, enabled=False):
        tokens = greedy(model)
    return {"tokens": tokens, "gathers": gathers, "forwards": forwards[0],
            "units": len(stage3.units), "order": len(stage3.order)}


def deepcopy_of_a_sharded_model(rank, world_size):
    """copy.deepcopy of a stage-3 model (TRL's create_reference_model) would
    copy empty placeholders: refused, saying what to do instead."""
    import copy
    model = tiny_lm("llama")
    rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=0)
    try:
        copy.deepcopy(model)
    except TypeError as error:
        return str(error)
    return None


PEFT_LAYERS = {
    # LoRA on GPT-2's tied embedding (its adapters sit in ParameterDicts
    # of the root unit) and on its tied head
    "tied": ("gpt2", {"target_modules": ["wte", "c_fc", "lm_head"], "fan_in_fan_out": True}),
    # DoRA on an untied embedding and head each bigger than a block (whose
    # forwards read their base layer's weight beside the adapters)
    "untied-dora": ("llama-untied", {"target_modules": ["embed_tokens", "lm_head", "q_proj"],
                                     "use_dora": True}),
}


def peft_layers(case: str):
    """A PEFT model with adapters on embeddings and heads (PEFT_LAYERS)."""
    import peft
    kind, options = PEFT_LAYERS[case]
    model = tiny_lm(kind)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **options))


def peft_layers_parity(rank, world_size, case, steps):
    """Stage 3 training of peft_layers(case), the adapters alone trained:
    with ZeroAdamW(model), then with shard_model and the trained params.
    Each: the losses, the whole model, and greedy tokens unit by unit."""
    out = {}
    for how in ("optimizer", "shard_model"):
        model = peft_layers(case)
        if how == "optimizer":
            opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
        else:
            rlhfz.shard_model(model, param_persistence_threshold=64)
            opt = rlhfz.ZeroAdamW([p for p in model.parameters() if p.requires_grad],
                                  stage=3, lr=1e-2)
        losses = []
        for ids in batches(steps):
            opt.zero_grad()
            loss = lm_loss(model, ids[rank::world_size])
            loss.backward()
            opt.step()
            global_loss = loss.detach().clone()
            torch.distributed.all_reduce(global_loss)
            losses.append(global_loss.item() / world_size)
        model.eval()
        with rlhfz.gather_for_generation(model, enabled=False):
            tokens = greedy(model)
        out[how] = {"losses": losses, "tokens": tokens,
                    "state": rlhfz.full_state_dict(model, rank0_only=False)}
    return out


class OwnParamModel(torch.nn.Module):
    """A model that holds a param itself and uses it after its embedding,
    which holds another of the root unit's: the embedding's forward runs
    inside the model's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 100)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(100, 100) for _ in range(2)])
        self.scale = torch.nn.Parameter(torch.randn(100))

    def forward(self, ids):
        h = self.embed(ids) * self.scale
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h.pow(2).mean()


def own_param_training(rank, world_size, steps):
    """Stage 3 training of OwnParamModel; the losses, the whole params, and
    a no_grad forward's loss, unit by unit."""
    model = OwnParamModel()
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    losses = []
    for ids in batches(steps):
        opt.zero_grad()
        loss = model(ids[rank::world_size] % 50)
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
    with torch.no_grad(), rlhfz.gather_for_generation(model, enabled=False):
        evaluated = model(PROMPT % 50)
    return {"losses": losses, "evaluated": evaluated,
            "state": rlhfz.full_state_dict(model, rank0_only=False)}


def block_that_raised(rank, world_size):
    """A unit's module called alone (outside a forward of the model) with an
    input it refuses, then with a good one: whether each call leaves the
    unit whole, and the good call's output against the same block unsharded."""
    model = tiny_lm("gpt2").eval()
    block = model.transformer.h[1]
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = block(hidden)[0]
    opt = rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=64)
    stage3 = opt.stage3
    out = {}
    with torch.no_grad():
        try:
            block(hidden[..., :7])                   # the wrong width
        except RuntimeError:
            out["after_raise"] = stage3.gathered_bytes()
        got = block(hidden)[0]
        out["after_good"] = stage3.gathered_bytes()
        out["error"] = float((got - expected).abs().max())
    # and with grads: the unit goes once backward is done with it
    block(hidden.requires_grad_())[0].sum().backward()
    out["after_backward"] = stage3.gathered_bytes()
    return out


def torch_optimizer_on_placeholders(rank, world_size):
    """torch's AdamW over a stage-3 model's params: refused before it
    steps, with the optimizer built, after close(), and over a model
    sharded with shard_model; and what the refusal leaves."""
    out = {}
    model = tiny_lm("gpt2")
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(PROMPT).logits.sum().backward()
    for case in ("live", "closed"):
        try:
            other.step()
            out[case] = None
        except RuntimeError as error:
            out[case] = str(error)
        if case == "live":
            opt.step()                      # rlhfz's own still steps
            out["stepped"] = any(not torch.equal(before[k], v)
                                 for k, v in model.state_dict().items())
            opt.close()
    reference = tiny_lm("gpt2", seed=1)
    rlhfz.shard_model(reference, param_persistence_threshold=64)
    try:
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        out["shard_model"] = None
    except RuntimeError as error:
        out["shard_model"] = str(error)
    # a plain model beside them trains as ever
    plain = torch.nn.Linear(4, 4)
    plain(torch.ones(1, 4)).sum().backward()
    weight = plain.weight.detach().clone()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
    plain_opt.step()
    out["plain_stepped"] = not torch.equal(weight, plain.weight)
    # found clear once, then given sharded params: looked at again
    plain_opt.add_param_group({"params": list(reference.parameters())})
    try:
        plain_opt.step()
        out["added"] = None
    except RuntimeError as error:
        out["added"] = str(error)
    return out


class ScalesItsInputInPlace(torch.nn.Module):
    """A block that scales the hidden state it is given in place before
    using it (some models do so with their hidden states): torch allows it
    where the producer did not save that tensor, as a Linear does not."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(16, 16)
        self.outer = torch.nn.Linear(16, 16)

    def forward(self, x):
        x.mul_(0.5)
        return self.outer(torch.tanh(self.inner(x)))


def in_place_input_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), ScalesItsInputInPlace(),
                               ScalesItsInputInPlace(), torch.nn.Linear(16, 3))


def in_place_input_training(rank, world_size, steps):
    """Stage 3, every block a unit and every param sharded, against torch
    AdamW on the whole batch; the largest param difference."""
    model, plain = in_place_input_model(), in_place_input_model()
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-3, wrap=(ScalesItsInputInPlace,),
                          param_persistence_threshold=0)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(12, 8, generator=gen), torch.randn(12, 3, generator=gen)
        opt.zero_grad()
        ref.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        ref.step()
    ours = rlhfz.full_state_dict(model, rank0_only=False)
    opt.close()
    return max(float((ours[name] - value).abs().max())
               for name, value in plain.state_dict().items())


def in_place_on_a_saved_input(sharded: bool, rank: int = 0, world_size: int = 1):
    """A block that scales, in place, a tanh's output that tanh saved for
    its backward: what backward raises, under stage 3 or in plain torch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), ScalesItsInputInPlace(),
                                torch.nn.Linear(16, 3))
    if sharded:
        rlhfz.ZeroAdamW(model, stage=3, lr=1e-3, wrap=(ScalesItsInputInPlace,),
                        param_persistence_threshold=0)
    try:
        model(torch.randn(6, 8)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


def in_place_on_a_saved_input_sharded(rank, world_size):
    return in_place_on_a_saved_input(True, rank, world_size)


def one_rank_runs_a_unit_again(rank, world_size):
    """Every rank runs the whole model; rank 1 then runs its first unit again
    and takes its loss from that alone. The ranks' gathers and reductions
    pair across different units, and the step went on with the params off
    by 1e-2 and no error. The step now refuses, naming the units gathered."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = rlhfz.ZeroAdamW(model, lr=0.01, stage=3, param_persistence_threshold=0)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    opt.step()                                     # alike on both ranks
    opt.zero_grad()
    loss = model(x).square().mean()
    if rank == 1:
        loss = model[0](x).square().mean()
    loss.backward()
    try:
        opt.step()
    except rlhfz.comm.CollectiveMismatchError as error:
        return str(error)
    return None


class _PolicyAndValue(torch.nn.Module):
    """A policy and a value head under one wrapper, the optimizer built over
    the wrapper (as OpenRLHF and TRL's PPO hold them)."""

    def __init__(self):
        super().__init__()
        self.policy = tiny_lm("gpt2")
        self.value = torch.nn.Linear(32, 1)


def loads_and_parts_inside_a_gather(rank, world_size, tmp):
    """Inside gather_for_generation: a model-only load_checkpoint or
    load_pretrained went into the shards while the forward read the whole
    copies of before (logits 0.5 off the loaded model's), now refused; a
    context over the policy of a wrapper the optimizer was built over
    gathered nothing, and now gathers the model; generation under
    inference_mode made the gathered params inference tensors, and the
    logits were a rounding off the unsharded model's."""
    model = tiny_lm("gpt2").eval()
    rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=64)
    other = tiny_lm("gpt2", seed=9)
    ck, hf = os.path.join(tmp, "ck"), os.path.join(tmp, "hf")
    if rank == 0:
        rlhfz.save_checkpoint(ck, other)
        other.save_pretrained(hf)
    torch.distributed.barrier()
    out = {"refused": []}
    for load in (lambda: rlhfz.load_checkpoint(ck, model), lambda: rlhfz.load_pretrained(model, hf)):
        with rlhfz.gather_for_generation(model, budget_bytes=1 << 30):
            try:
                load()
                out["refused"].append(None)
            except RuntimeError as error:
                out["refused"].append(str(error))
    plain = tiny_lm("gpt2").eval()
    with torch.inference_mode():
        ours = model(PROMPT).logits[:, -1]
        theirs = plain(PROMPT).logits[:, -1]
    out["inference_mode_equal"] = bool(torch.equal(ours, theirs))
    wrapper = _PolicyAndValue().eval()
    opt = rlhfz.ZeroAdamW(wrapper, stage=3, param_persistence_threshold=64)
    with rlhfz.gather_for_generation(wrapper.policy):
        out["part_gathered"] = opt.stage3.gathered_bytes()
        out["part_tokens"] = greedy(wrapper.policy)
    with rlhfz.gather_for_generation(wrapper):
        out["whole_gathered"] = opt.stage3.gathered_bytes()
    out["plain_tokens"] = greedy(tiny_lm("gpt2").eval())
    return out
