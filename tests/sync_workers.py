"""Per-rank bodies of the weight-sync tests (importable by spawned ranks):
ranks 0 and 1 train at stage 3, ranks 2 and 3 hold plain models and
receive; the sync group holds rank 0 (src) and the receivers."""
import copy
import os
import time

import torch
import torch.distributed as dist

import rlhfz
from stage3_workers import PROMPT, batches, lm_loss, tiny_lm

TRAINERS, RECEIVERS, SRC = [0, 1], [2, 3], 0


def groups():
    """Every rank makes every group, in one order, as torch asks."""
    train = dist.new_group(TRAINERS)
    sync = dist.new_group([SRC] + RECEIVERS)
    return train, sync


def _trained(train_group, steps=3, kind="gpt2", options=None):
    model = tiny_lm(kind)
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, process_group=train_group,
                          param_persistence_threshold=64, **(options or {}))
    rank = dist.get_rank(train_group)
    for ids in batches(steps):
        opt.zero_grad()
        lm_loss(model, ids[rank::2]).backward()
        opt.step()
    return model, opt


def _logits(model):
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


def _whole(model):
    return {name: t.detach().clone() for name, t in rlhfz.iter_full_params(model, 1 << 14)}


def sync_exact(rank, world_size):
    """Bit-exact syncs: fp32 in small buckets (tensors cut in chunks) with a
    checksum, then bf16 to bf16 receivers; logits match the policy's."""
    train, sync = groups()
    out = {}
    if rank in TRAINERS:
        model, opt = _trained(train)
        model.eval()
        out["whole"] = _whole(model)
        out["report"] = rlhfz.sync_weights(model, sync if rank == SRC else None, src=SRC,
                                           bucket_bytes=4096, checksum=True)
        out["logits"] = _logits(model)
        out["bf16_report"] = rlhfz.sync_weights(model, sync if rank == SRC else None, src=SRC,
                                                dtype=torch.bfloat16, bucket_bytes=1 << 14)
        out["gathered_after"] = opt.stage3.gathered_bytes()
        return out
    receiver = tiny_lm("gpt2", seed=rank).eval()          # other values to begin with
    ids = {id(t) for t in receiver.state_dict(keep_vars=True).values()}
    out["report"] = rlhfz.receive_weights(receiver, sync, src=SRC)
    out["whole"] = {name: t.detach().clone() for name, t in receiver.named_parameters()}
    out["logits"] = _logits(receiver)
    out["same_tensors"] = ids == {id(t) for t in receiver.state_dict(keep_vars=True).values()}
    low = tiny_lm("gpt2", seed=rank).to(torch.bfloat16).eval()
    rlhfz.receive_weights(low, sync, src=SRC)
    out["bf16"] = {name: t.detach().clone() for name, t in low.named_parameters()}
    return out


def sync_refused(rank, world_size):
    """A receiver whose model differs (another vocabulary), then one that
    loads fp32 where bf16 is sent: every rank raises, nothing is written.
    Then a manifest of another format (another rlhfz's), refused by both."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "20"
    train, sync = groups()
    errors = []
    if rank in TRAINERS:
        model, _ = _trained(train, steps=1)
        for dtype in (None, torch.bfloat16):
            try:
                rlhfz.sync_weights(model, sync if rank == SRC else None, src=SRC, dtype=dtype)
            except rlhfz.WeightSyncError as error:
                errors.append(str(error))
        verdict = None
        if rank == SRC:
            from rlhfz.comm.channel import BroadcastChannel
            channel = BroadcastChannel(sync, SRC)
            channel.object({"format": "rlhfz.weight_sync.v1", "tensors": []})
            verdict = channel.verdict(None)
        return {"errors": errors, "format_verdict": verdict}
    kinds = {2: "gpt2", 3: "llama"}
    receiver = tiny_lm(kinds[rank], seed=rank)
    before = {n: t.clone() for n, t in receiver.state_dict().items()}
    for _ in range(3):
        try:
            rlhfz.receive_weights(receiver, sync, src=SRC)
        except rlhfz.WeightSyncError as error:
            errors.append(str(error))
    after = receiver.state_dict()
    return {"errors": errors, "untouched": all(torch.equal(before[n], after[n]) for n in after)}


def sync_corrupted(rank, world_size):
    """A sync with a checksum where receiver 3's copy is changed after it
    lands (as a bit flipped in flight would): every rank raises. Then one
    more sync, which finds every rank back in step and fixes the copy."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "20"
    train, sync = groups()
    errors = []
    if rank in TRAINERS:
        model, _ = _trained(train, steps=1)
        for _ in range(2):
            try:
                rlhfz.sync_weights(model, sync if rank == SRC else None, src=SRC,
                                   bucket_bytes=1 << 13, checksum=True)
            except rlhfz.WeightSyncError as error:
                errors.append(str(error))
        return {"errors": errors, "whole": _whole(model)}
    import rlhfz.weight_sync as weight_sync
    receive = weight_sync._receive_buckets

    def flipped(buckets, specs, targets, channel):
        receive(buckets, specs, targets, channel)
        with torch.no_grad():
            targets[-1].view(-1)[0] += 1
    receiver = tiny_lm("gpt2", seed=rank)
    for corrupt in (rank == 3, False):
        weight_sync._receive_buckets = flipped if corrupt else receive
        try:
            rlhfz.receive_weights(receiver, sync, src=SRC)
        except rlhfz.WeightSyncError as error:
            errors.append(str(error))
    return {"errors": errors,
            "whole": {n: t.detach().clone() for n, t in receiver.named_parameters()}}


def _lora_model(seed):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    return get_peft_model(tiny_lm("gpt2", seed=seed),
                          LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                     target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))


def sync_lora(rank, world_size):
    """A PEFT LoRA policy at stage 3 (the base sharded without state): merged
    into a plain base model, and the adapters alone into a PEFT receiver."""
    train, sync = groups()
    if rank in TRAINERS:
        model = _lora_model(0)
        opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, param_persistence_threshold=64,
                              process_group=train)
        for ids in batches(2):
            opt.zero_grad()
            lm_loss(model, ids[rank::2]).backward()
            opt.step()
        group = sync if rank == SRC else None
        rlhfz.sync_weights(model, group, src=SRC, bucket_bytes=1 << 13)
        rlhfz.sync_weights(model, group, src=SRC, adapters="only", checksum=True)
        model.eval()
        with rlhfz.gather_for_generation(model):
            logits = _logits(model)
        adapters = {n: t for n, t in rlhfz.full_state_dict(model, rank0_only=False).items()
                    if "lora_" in n}
        return {"logits": logits, "adapters": adapters}
    base = tiny_lm("gpt2", seed=rank).eval()
    rlhfz.receive_weights(base, sync, src=SRC)
    peft_receiver = _lora_model(rank)
    rlhfz.receive_weights(peft_receiver, sync, src=SRC)
    adapters = {n: t.detach().clone() for n, t in peft_receiver.state_dict().items()
                if "lora_" in n}
    return {"logits": _logits(base), "adapters": adapters}


def lora_variant(case: str, seed: int = 0):
    """(a PEFT LoRA model whose adapters change its weights, the kind of its
    base): "embedding", LoRA on GPT-2's tied token embedding and its MLPs;
    "modules_to_save", a Llama whose LM head trains whole, as a copy PEFT
    keeps beside the original."""
    from peft import LoraConfig, get_peft_model
    if case == "embedding":
        kind, config = "gpt2", {"target_modules": ["wte", "c_fc"], "fan_in_fan_out": True}
    else:
        kind, config = "llama-untied", {"target_modules": ["q_proj", "v_proj"],
                                        "modules_to_save": ["lm_head"]}
    base = tiny_lm(kind, seed)
    torch.manual_seed(seed + 1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(1.0)                  # the trained copy, apart from the original
    return model, kind


def _trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def sync_lora_layers(rank, world_size):
    """Rank 0 sends PEFT models with LoRA on an embedding, and with a
    modules_to_save head, merged into plain base models on rank 1, then
    their adapters alone into PEFT models; rank 0 also keeps what
    merge_and_unload leaves."""
    sync = dist.new_group([0, 1])
    out = {}
    for case in ("embedding", "modules_to_save"):
        if rank == 0:
            model, _ = lora_variant(case)
            out[case] = copy.deepcopy(model).merge_and_unload().state_dict()
            out[case + " adapters"] = _trainable(model)
            rlhfz.sync_weights(model, sync, src=0, bucket_bytes=1 << 13, checksum=True)
            rlhfz.sync_weights(model, sync, src=0, adapters="only", checksum=True)
            continue
        model, kind = lora_variant(case, seed=rank)
        base = tiny_lm(kind, seed=rank)
        rlhfz.receive_weights(base, sync, src=0)
        out[case] = {n: t.detach().clone() for n, t in base.state_dict().items()}
        rlhfz.receive_weights(model, sync, src=0)
        out[case + " adapters"] = _trainable(model)
    return out


def _attempt(errors: list, fn, *args, **kwargs):
    """fn's result, or None with its WeightSyncError's text kept."""
    try:
        return fn(*args, **kwargs)
    except rlhfz.WeightSyncError as error:
        errors.append(str(error))
        return None


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sync_into_unwritable(rank, world_size):
    """Rank 0 sends to ranks 1 and 2, whose models cannot be written (on
    the meta device, made under inference_mode, sharded between them), each
    refused before a byte moves; then plain ones, which the same group loads."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "20"
    sync = dist.new_group([0, 1, 2])
    receivers = dist.new_group([1, 2])
    cases = ("meta", "inference", "sharded", "plain")
    errors = []
    if rank == 0:
        model = tiny_lm("gpt2")
        for _ in cases:
            _attempt(errors, rlhfz.sync_weights, model, sync, src=0, bucket_bytes=1 << 12,
                     checksum=True)
        return {"errors": errors, "whole": _params(model)}
    for case in cases:
        if case == "meta":
            with torch.device("meta"):
                receiver = tiny_lm("gpt2", seed=1)
        elif case == "inference":
            with torch.inference_mode():
                receiver = tiny_lm("gpt2", seed=1)
        else:
            receiver = tiny_lm("gpt2", seed=1)
            if case == "sharded":
                rlhfz.shard_model(receiver, process_group=receivers,
                                  param_persistence_threshold=64)
        before = _params(receiver) if case == "inference" else None
        _attempt(errors, rlhfz.receive_weights, receiver, sync, src=0)
        if before is not None:
            untouched = all(torch.equal(before[n], p) for n, p in _params(receiver).items())
    return {"errors": errors, "whole": _params(receiver), "untouched": untouched}


def sync_refused_by_the_sender(rank, world_size):
    """Ranks 0 and 1 train at stage 3 (rank 0 sends), rank 2 receives. Syncs
    the trainers refuse (buckets too small for a piece, adapters='only' of
    a model with none) fail on every rank at once; then one goes through."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "30"
    train = dist.new_group([0, 1])
    sync = dist.new_group([0, 2])
    model = tiny_lm("gpt2", seed=rank)
    if rank != 2:
        rlhfz.shard_model(model, process_group=train, param_persistence_threshold=64)
    errors, seconds = [], []
    for ask in ({"bucket_bytes": 8}, {"adapters": "only"}, {}):
        started = time.perf_counter()
        if rank == 2:
            _attempt(errors, rlhfz.receive_weights, model, sync, src=0)
        else:
            _attempt(errors, rlhfz.sync_weights, model, sync if rank == 0 else None, src=0,
                     **ask)
        seconds.append(time.perf_counter() - started)
    whole = _params(model) if rank == 2 else _whole(model)
    # the other trainer in the sync group too: refused there, and every rank
    # hears of it at once, the trainers still in step after
    everyone = dist.new_group([0, 1, 2])
    started = time.perf_counter()
    try:
        if rank == 2:
            rlhfz.receive_weights(model, everyone, src=0)
        else:
            rlhfz.sync_weights(model, everyone, src=0)
    except Exception as error:      # noqa: BLE001 - its text is the result
        errors.append(f"{type(error).__name__}: {error}")
    seconds.append(time.perf_counter() - started)
    if rank == 2:
        rlhfz.receive_weights(model, sync, src=0)
    else:
        rlhfz.sync_weights(model, sync if rank == 0 else None, src=0)
    return {"errors": errors, "seconds": seconds, "whole": whole}


def sync_beside_an_absent_side(rank, world_size):
    """A side that fails before the channel where nothing can be agreed (src
    given as a string) and stays alive: the other side raises CollectiveError
    within RLHFZ_COLLECTIVE_TIMEOUT, the receiver waiting for the manifest,
    then the sender for the verdict."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "4"
    from rlhfz.comm import CollectiveError
    model = tiny_lm("gpt2", seed=rank)
    call = rlhfz.sync_weights if rank == 0 else rlhfz.receive_weights
    out = {}
    for absent in (0, 1):
        sync = dist.new_group([0, 1])         # a group of its own for each: one is left broken
        if rank == absent:
            try:
                call(model, sync, src="0")
            except ValueError:
                time.sleep(10)                # alive, as a trainer or an engine goes on
            continue
        started = time.perf_counter()
        try:
            call(model, sync, src=0)
        except CollectiveError as error:
            out[absent] = (str(error), time.perf_counter() - started)
    return out


def sync_at_stages_1_and_2(rank, world_size):
    """Ranks 0 and 1 train at stage 1, then 2 (rank 0 sends); rank 2 holds
    another model: every rank raises."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "20"
    train = dist.new_group([0, 1])
    sync = dist.new_group([0, 2])
    errors = []
    for stage in (1, 2):
        if rank == 2:
            _attempt(errors, rlhfz.receive_weights, tiny_lm("llama", seed=2), sync, src=0)
            continue
        model = tiny_lm("gpt2")
        optimizer = rlhfz.ZeroAdamW(model, stage=stage, process_group=train)
        _attempt(errors, rlhfz.sync_weights, model, sync if rank == 0 else None, src=0)
        del optimizer                           # alive through the sync, as a trainer's is
    return errors


def sync_under_a_graph(rank, world_size):
    """A receiver's graph saved its weight before a sync wrote it: a large
    one straight into its memory, a small one through a buffer. Backward
    then refuses, as after load_state_dict."""
    sync = dist.new_group([0, 1])
    out = []
    for n in (64, 8):
        torch.manual_seed(rank)
        model = torch.nn.Linear(n, n)
        if rank == 0:
            rlhfz.sync_weights(model, sync, src=0, bucket_bytes=1 << 12)
            continue
        x = torch.randn(2, n, requires_grad=True)
        loss = model(x).sum()
        rlhfz.receive_weights(model, sync, src=0)
        try:
            loss.backward()
            out.append(None)
        except RuntimeError as error:
            out.append(str(error))
    return out


def sync_compiled(rank, world_size):
    """torch.compile'd models (their names under _orig_mod): a plain sender
    and a one-rank stage-1 one into a plain receiver, and a plain sender
    into a compiled receiver."""
    sync = dist.new_group([0, 1])
    alone = dist.new_group([0])
    out, optimizers = [], []
    for stage, sender_compiled in ((None, True), (1, True), (None, False)):
        model = tiny_lm("gpt2", seed=rank)
        if rank == 0:
            if stage is not None:               # its params become views of its buckets
                optimizers.append(rlhfz.ZeroAdamW(model, stage=stage, process_group=alone))
            rlhfz.sync_weights(torch.compile(model) if sender_compiled else model, sync, src=0)
            out.append(_params(model))
            continue
        rlhfz.receive_weights(model if sender_compiled else torch.compile(model), sync, src=0)
        out.append(_params(model))
    return out


def hybrid_sender(rank, world_size):
    """Ranks 0-3 train at stage 3 on a 2x2 mesh (2 replicas of 2 shard ranks)
    inside a job of 5; rank 4 receives from rank 0. Only rank 0's shard
    group gathers for the sync. Then a stage-2 policy on the mesh sends to
    another model, and every rank raises."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    sync = dist.new_group([0, 4])
    errors = []
    if rank == 4:
        receiver = tiny_lm("gpt2", seed=9)
        rlhfz.receive_weights(receiver, sync, src=0)
        _attempt(errors, rlhfz.receive_weights, tiny_lm("llama", seed=9), sync, src=0)
        return {"whole": {n: p.detach().clone() for n, p in receiver.named_parameters()},
                "errors": errors}
    model = tiny_lm("gpt2")
    opt = rlhfz.ZeroAdamW(model, stage=3, lr=1e-2, device_mesh=mesh,
                          param_persistence_threshold=64)
    for ids in batches(2):
        opt.zero_grad()
        lm_loss(model, ids[rank::4]).backward()
        opt.step()
    before = opt.comm.traffic_by_dimension()
    rlhfz.sync_weights(model, sync if rank == 0 else None, src=0, checksum=True)
    after = opt.comm.traffic_by_dimension()
    sent = {dim: {c: after[dim][c] - before[dim][c] for c in after[dim]} for dim in after}
    # a stage-2 policy on the mesh whose sync the receiver refuses: every trainer raises
    other = tiny_lm("gpt2")
    other_opt = rlhfz.ZeroAdamW(other, stage=2, device_mesh=mesh)
    _attempt(errors, rlhfz.sync_weights, other, sync if rank == 0 else None, src=0)
    del other_opt                               # alive through the sync, as a trainer's is
    return {"whole": _whole(model), "sync_sent": sent, "shard_bytes": _shard_bytes(opt),
            "coords": (opt.comm.replica, opt.rank), "errors": errors}


def _shard_bytes(opt) -> int:
    """This rank's shard of every stage-3 unit, padding included: what it
    sends to gather the whole model onto another rank."""
    return sum(b.flat_param_shard.numel() * b.itemsize
               for _, buckets in opt.stage3.units for b in buckets)


def _sent_to_others(opt) -> bool:
    """Whether a bucket is left counted as gathered while this rank only
    sent its shard (a sync that left the ranks unalike)."""
    return any(b.gathered is not None and b.gathered[1] is None
               for _, buckets in opt.stage3.units for b in buckets)


def sync_in_generation(rank, world_size):
    """Syncs inside each generation mode: gathered onto src alone, the
    units gathered for the sync go everywhere after it and those the mode
    holds stay held, so both trainers go on alike. Outside generation
    nothing is all-gathered, and the other trainer sends its shards only."""
    train, sync = groups()
    modes = [{}, {"enabled": False}, {"budget_bytes": 1 << 14}]
    if rank not in TRAINERS:
        out = []
        for _ in range(len(modes) + 1):
            receiver = tiny_lm("gpt2", seed=rank).eval()
            rlhfz.receive_weights(receiver, sync, src=SRC)
            out.append(_logits(receiver))
        return {"logits": out}
    model, opt = _trained(train)
    model.eval()
    group = sync if rank == SRC else None
    before = dict(opt.comm.traffic)
    rlhfz.sync_weights(model, group, src=SRC, bucket_bytes=1 << 13)
    sent = {c: opt.comm.traffic[c] - before[c] for c in before}
    out = {"sent": sent, "logits": [_logits(model)], "left": [_sent_to_others(opt)],
           "shard_bytes": _shard_bytes(opt)}
    for mode in modes:
        with rlhfz.gather_for_generation(model, **mode):
            held = opt.stage3.gathered_bytes()
            rlhfz.sync_weights(model, group, src=SRC, bucket_bytes=1 << 13, checksum=True)
            out.setdefault("held_after_sync", []).append(opt.stage3.gathered_bytes() == held)
            out["left"].append(_sent_to_others(opt))
            out["logits"].append(_logits(model))
    out["gathered_after"] = opt.stage3.gathered_bytes()
    return out


def _record_sends(events: list) -> None:
    """This rank's sync steps in order: each bucket's send posted and
    waited for, each unit's gather started, the receivers' verdict."""
    from rlhfz.comm import channel
    from rlhfz.stage3 import Stage3
    posted, waited = channel.BroadcastChannel.bytes, channel._Sent.wait
    verdict, prefetch = channel.BroadcastChannel.verdict, Stage3.prefetch

    def bytes_(self, flat, what, **kwargs):
        events.append(("post", int(what.split()[-1])))
        sent = posted(self, flat, what, **kwargs)
        sent.bucket = events[-1][1]
        return sent

    def wait(self):
        waited(self)
        events.append(("done", getattr(self, "bucket", None)))

    def verdict_(self, message):
        events.append(("verdict", None))
        return verdict(self, message)

    def prefetch_(self, index):
        events.append(("gather", index))
        return prefetch(self, index)
    channel.BroadcastChannel.bytes, channel._Sent.wait = bytes_, wait
    channel.BroadcastChannel.verdict, Stage3.prefetch = verdict_, prefetch_


def sync_back_to_back(rank, world_size):
    """A stage-3 sync from units' memory, in ranges of it: src's steps
    in order, its peak of gathered bytes, and what the receivers got."""
    train, sync = groups()
    if rank not in TRAINERS:
        receiver = tiny_lm("gpt2", seed=rank)
        rlhfz.receive_weights(receiver, sync, src=SRC)
        return {"whole": {n: t.detach().clone() for n, t in receiver.named_parameters()}}
    model, opt = _trained(train)
    from rlhfz.weight_sync import _Sender
    sender = _Sender(model, "merged", None, 1 << 14)      # each block in ranges of it
    # (sent from the memory that holds it, the units it lies in), bucket by bucket
    sources = [(b.source is not None, sorted(sender.units_of(b.pieces))) for b in sender.buckets]
    units = sorted(opt.stage3.unit_bytes(i) for i in range(len(opt.stage3.units)))
    events = []
    _record_sends(events)
    opt.stage3.peak_bytes = opt.stage3.gathered_bytes()
    rlhfz.sync_weights(model, sync if rank == SRC else None, src=SRC, bucket_bytes=1 << 14)
    return {"events": events, "sources": sources, "peak": opt.stage3.peak_bytes,
            "two_units": sum(units[-2:]), "whole": _whole(model)}


def laid_back_to_front(model):
    """The model's params moved into one tensor, the last param first."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    end = flat.numel()
    with torch.no_grad():
        for p in params:
            end -= p.numel()
            view = flat[end:end + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
    return model


def sync_whole_params(rank, world_size):
    """Senders whose params are whole: a stage-2 ZeroAdamW policy (its
    bucket memory sent as it lies), the same after one param was given
    memory of its own, and a plain model whose params lie in one tensor
    back to front. The other trainer has nothing to do."""
    train, sync = groups()
    senders = 3
    if rank not in TRAINERS:
        out = []
        for _ in range(senders):
            receiver = tiny_lm("gpt2", seed=rank)
            rlhfz.receive_weights(receiver, sync, src=SRC)
            out.append({n: p.detach().clone() for n, p in receiver.named_parameters()})
        return {"whole": out}
    model = tiny_lm("gpt2")
    opt = rlhfz.ZeroAdamW(model, stage=2, lr=1e-2, process_group=train)
    for ids in batches(2):
        opt.zero_grad()
        lm_loss(model, ids[rank::2]).backward()
        opt.step()
    group = sync if rank == SRC else None
    out = {"whole": [], "reports": []}

    def send(sender):
        out["whole"].append({n: p.detach().clone() for n, p in sender.named_parameters()})
        out["reports"].append(rlhfz.sync_weights(sender, group, src=SRC, bucket_bytes=1 << 13,
                                                 checksum=True))

    send(model)
    moved = model.transformer.h[0].mlp.c_fc.weight
    with torch.no_grad():
        moved.data = moved.detach().clone() + 1.0
    send(model)
    send(laid_back_to_front(tiny_lm("gpt2", seed=7)))
    return out


def frame_values(frame_bytes: int) -> list:
    """Values for the channel's frame: none, a small one, encodings that fill
    the frame after its 8-byte length to the last byte, overflow it by one,
    and span several frames."""
    def encoded_to(n):              # a JSON string: its n - 2 characters and two quotes
        return "x" * (n - 2)

    room = frame_bytes - 8
    return [None, {"tensors": [["w", [2, 3], "float32"]], "checksum": False, "crc": 2**32 - 1},
            encoded_to(room), encoded_to(room + 1), encoded_to(3 * frame_bytes + 5)]


# more bytes than a verdict carries, in two-byte characters
LONG_MESSAGE = "\u00e9" * 3000


def channel_round_trips(rank, world_size):
    """The channel's values from src (rank 1 here) and its verdicts: none,
    one rank's, every rank's; and the collectives each took."""
    from rlhfz.comm.channel import FRAME_BYTES, BroadcastChannel
    channel = BroadcastChannel(dist.new_group([0, 1, 2]), 1)
    calls = []

    def counted(name):
        real = getattr(dist, name)

        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    def collectives(fn):
        del calls[:]
        return fn(), list(calls)

    names = ("broadcast", "all_reduce", "all_gather")
    real = {name: getattr(dist, name) for name in names}
    for name in names:
        setattr(dist, name, counted(name))
    try:
        got = [collectives(lambda: channel.object(value if rank == 1 else None))
               for value in frame_values(FRAME_BYTES)]
        verdicts = [collectives(lambda: channel.verdict(None)),
                    collectives(lambda: channel.verdict("bad here" if rank == 2 else None)),
                    collectives(lambda: channel.verdict(f"rank {rank} says no")),
                    collectives(lambda: channel.verdict(LONG_MESSAGE if rank == 0 else None))]
    finally:
        for name in names:
            setattr(dist, name, real[name])
    # a frame that announces more than any manifest: refused, not allocated
    from rlhfz.comm.channel import MAX_OBJECT_BYTES
    from rlhfz.comm.control import CollectiveError
    refused = None
    if rank == 1:
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:8] = torch.tensor(list((MAX_OBJECT_BYTES + 1).to_bytes(8, "little")),
                                 dtype=torch.uint8)
        dist.broadcast(frame, src=1, group=channel.group)
    else:
        try:
            channel.object()
        except CollectiveError as error:
            refused = str(error)
    return {"got": got, "verdicts": verdicts, "refused": refused}


def sync_cut_off_midway(rank, world_size):
    """Rank 0 fails after its third bucket went out; rank 1 has taken some
    of the buckets into its model when the sync stops: its error says so."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "5"
    sync = dist.new_group([0, 1])
    if rank == 0:
        from rlhfz.comm import channel
        send, sent = channel.BroadcastChannel.bytes, []

        def bytes_(self, flat, what, **kwargs):
            if len(sent) == 3:
                raise RuntimeError("the sender stops here")
            sent.append(what)
            return send(self, flat, what, **kwargs)
        channel.BroadcastChannel.bytes = bytes_
        try:
            rlhfz.sync_weights(tiny_lm("gpt2"), sync, src=0, bucket_bytes=4096)
        except RuntimeError as error:
            return str(error)
        return None
    receiver = tiny_lm("gpt2", seed=3)
    before = _params(receiver)
    error = None
    try:
        rlhfz.receive_weights(receiver, sync, src=0)
    except rlhfz.comm.CollectiveError as caught:
        error = str(caught)
    changed = sum(not torch.equal(before[n], p) for n, p in _params(receiver).items())
    return {"error": error, "changed": changed, "params": len(before)}


def _logits_of(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROMPT).logits


def sync_adapters_apart(rank, world_size):
    """adapters='only' from rank 0 to rank 1 where the sides' adapters part
    ways: the receiver holds LoRA on a layer the sender has none on (its
    adapters there would stay as they were: refused); then the sender has
    frozen the LoRA of one of its layers (still active, so still sent)."""
    from peft import LoraConfig, get_peft_model
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "20"
    sync = dist.new_group([0, 1])

    def lora(seed, targets):
        base = tiny_lm("gpt2")                  # one base: only the adapters differ
        torch.manual_seed(seed + 1)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                               fan_in_fan_out=True, init_lora_weights=False))
    errors = []
    if rank == 0:
        _attempt(errors, rlhfz.sync_weights, lora(0, ["c_attn"]), sync, src=0, adapters="only",
                 checksum=True)
        model = lora(0, ["c_attn", "c_fc"])
        for name, p in model.named_parameters():
            if "c_fc.lora_" in name:
                p.requires_grad_(False)
        _attempt(errors, rlhfz.sync_weights, model, sync, src=0, adapters="only",
                 checksum=True)
        return {"errors": errors, "logits": _logits_of(model)}
    receiver = lora(5, ["c_attn", "c_fc"])
    before = _params(receiver)
    _attempt(errors, rlhfz.receive_weights, receiver, sync, src=0)
    untouched = all(torch.equal(before[n], p) for n, p in _params(receiver).items())
    _attempt(errors, rlhfz.receive_weights, receiver, sync, src=0)
    return {"errors": errors, "untouched": untouched, "logits": _logits_of(receiver)}


class _WithBuffers(torch.nn.Module):
    """A linear layer beside integer, bool and float64 buffers."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.randint(0, 100, (3,)))
        self.register_buffer("mask", torch.rand(3) > 0.5)
        self.register_buffer("fine", torch.rand(3, dtype=torch.float64))


def sync_cast_buffers(rank, world_size):
    """dtype=bfloat16 from rank 0 to a receiver that torch's .to(bfloat16)
    made: every floating tensor is cast, float64 too; the others go as
    they are."""
    sync = dist.new_group([0, 1])
    if rank == 0:
        model = _WithBuffers(0)
        rlhfz.sync_weights(model, sync, src=0, dtype=torch.bfloat16, checksum=True)
        return model.to(torch.bfloat16).state_dict()
    receiver = _WithBuffers(1).to(torch.bfloat16)
    try:
        rlhfz.receive_weights(receiver, sync, src=0)
    except rlhfz.WeightSyncError as error:
        return str(error)
    return receiver.state_dict()


def _record_sent(sent: list) -> None:
    """Every point-to-point send and broadcast this rank makes: (kind, peer
    or src, bytes)."""
    isend, broadcast = dist.isend, dist.broadcast

    def isend_(tensor, dst=None, *args, **kwargs):
        sent.append(("isend", dst, tensor.numel() * tensor.element_size()))
        return isend(tensor, dst, *args, **kwargs)

    def broadcast_(tensor, src=None, *args, **kwargs):
        sent.append(("broadcast", src, tensor.numel() * tensor.element_size()))
        return broadcast(tensor, src, *args, **kwargs)
    dist.isend, dist.broadcast = isend_, broadcast_


def sync_down_the_chain(rank, world_size):
    """Rank 0 sends a whole model to ranks 1 and 2 over gloo, in buckets of
    several pieces: what each rank sent, and what the receivers got."""
    from rlhfz import weight_sync
    from rlhfz.comm import channel
    channel.CHAIN_PIECE_BYTES = 12 << 10          # tensors in several pieces, an odd last one
    weight_sync.CHAIN_DIRECT_BYTES = 8 << 10      # some straight into their tensors
    sync = dist.new_group([0, 1, 2])
    model = tiny_lm("gpt2", seed=rank)
    sent, cuts = [], []
    _record_sent(sent)
    cut = weight_sync.chain_cuts

    def chain_cuts(bucket, specs):
        cuts.extend(cut(bucket, specs))
        return cuts[len(cuts) - len(cut(bucket, specs)):]
    weight_sync.chain_cuts = chain_cuts
    if rank == 0:
        report = rlhfz.sync_weights(model, sync, src=0, bucket_bytes=1 << 18, checksum=True)
        report.update(rlhfz.sync_weights(model, sync, src=0, bucket_bytes=1 << 18))
    else:
        report = rlhfz.receive_weights(model, sync, src=0)
        report.update(rlhfz.receive_weights(model, sync, src=0))
    return {"sent": sent, "report": report, "whole": _params(model),
            "straight": sum(place is not None for _, _, place in cuts),
            "through_a_buffer": sum(place is None for _, _, place in cuts)}


def sync_last_receiver_stops(rank, world_size, where):
    """The last receiver down the chain stops (where="midway": at its third
    bucket; "at_the_end": once every bucket came in) and stays alive: the
    sender and the other receiver must raise, not return as if every
    receiver held the weights."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "5"
    sync = dist.new_group([0, 1, 2])
    model = tiny_lm("gpt2", seed=rank)

    def stop(*args):
        raise RuntimeError("the last receiver stops here")
    if rank == 2 and where == "midway":
        from rlhfz.comm import channel
        inner, calls = channel._Chained._finish, []

        def third(self):
            if len(calls) == 2:
                stop()
            calls.append(self)
            inner(self)
        channel._Chained._finish = third
    elif rank == 2:
        # the last step of a receive, after the last bucket's unpacking
        torch.autograd.graph.increment_version = stop
    started, error = time.perf_counter(), None
    try:
        if rank == 0:
            rlhfz.sync_weights(model, sync, src=0, bucket_bytes=1 << 16)
        else:
            rlhfz.receive_weights(model, sync, src=0)
    except Exception as raised:                 # noqa: BLE001 - each rank says what it raised
        error = f"{type(raised).__name__}: {raised}"
    seconds, again = time.perf_counter() - started, None
    if where == "midway" and rank == 1:         # its receives may still be posted
        try:
            rlhfz.receive_weights(model, sync, src=0)
        except Exception as raised:             # noqa: BLE001
            again = f"{type(raised).__name__}: {raised}"
    if rank == 2:
        time.sleep(12)                          # alive past the others' timeouts
    return {"error": error, "seconds": seconds, "again": again}


class _Scaled(torch.nn.Module):
    """A layer with extra state beside its weights (as fp8 modules keep their
    scales), and a complex weight."""

    def __init__(self, seed: int, amax, conj: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)
        weight = torch.randn(3, dtype=torch.complex64)
        # a conjugate view reads other values than its memory holds
        self.phase = torch.nn.Parameter(weight.conj() if conj else weight)
        self.amax = amax

    def get_extra_state(self):
        return torch.tensor([self.amax]) if isinstance(self.amax, float) else self.amax

    def set_extra_state(self, state):
        self.amax = float(state[0])

    def forward(self, x):
        return self.lin(x) * self.amax + self.phase.real.sum()


def sync_unusual_tensors(rank, world_size):
    """Rank 0 sends a plain model to rank 1. A module's extra state goes in
    through set_extra_state and complex weights with torch's conjugate bit
    (on either side) read as sent; a sender holding what it cannot send (a
    sparse buffer, a param on the meta device, extra state that is not a
    tensor) is refused on both sides before a byte moves, and the next sync
    over the same group goes through."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "20"
    sync = dist.new_group([0, 1])
    out = {"errors": []}
    model = _Scaled(rank, 7.0 if rank == 0 else 1.0, conj=rank == 0)
    for checksum in (False, True):
        call = rlhfz.sync_weights if rank == 0 else rlhfz.receive_weights
        call(model, sync, src=0, **({"checksum": checksum} if rank == 0 else {}))
    out["amax"] = model.amax
    out["phase"] = model.phase.detach().resolve_conj().clone()
    out["logits"] = model(torch.ones(2, 4)).detach()
    receiver = _Scaled(5, 1.0, conj=True)      # its memory holds the conjugates
    if rank == 0:
        rlhfz.sync_weights(model, sync, src=0, bucket_bytes=16)
    else:
        rlhfz.receive_weights(receiver, sync, src=0)
        out["into_conj"] = receiver.phase.detach().resolve_conj().clone()
    for spoil in ("sparse", "meta", "extra"):
        sender = _Scaled(0, 7.0)
        if spoil == "sparse":
            sender.register_buffer("mask", torch.eye(4).to_sparse())
        elif spoil == "meta":
            sender.lin.weight = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
        else:
            sender.amax = {"amax": 7.0}
        if rank == 0:
            _attempt(out["errors"], rlhfz.sync_weights, sender, sync, src=0)
        else:
            before = _params(model)
            _attempt(out["errors"], rlhfz.receive_weights, model, sync, src=0)
            assert all(torch.equal(before[n], p) for n, p in _params(model).items())
    call = rlhfz.sync_weights if rank == 0 else rlhfz.receive_weights
    call(model, sync, src=0)                          # the group goes on
    return out


def sync_after_the_optimizer_closed(rank, world_size):
    """Ranks 0 and 1 train over a group of their own at stage 3, then stage 2,
    and close the optimizer; rank 2 receives. A closed optimizer's groups
    were set to None, which torch reads as the whole world's: the sharded
    model's forward, state dict and sync then failed, and a closed
    optimizer still counted as the params' owner."""
    os.environ["RLHFZ_COLLECTIVE_TIMEOUT"] = "20"
    train = dist.new_group([0, 1])
    sync = dist.new_group([0, 2])
    out = {}
    for stage in (3, 2):
        model = tiny_lm("gpt2")
        if rank == 2:
            rlhfz.receive_weights(model, sync, src=0)
            out[stage] = _logits(model)
            continue
        opt = rlhfz.ZeroAdamW(model if stage == 3 else model.parameters(), stage=stage,
                              lr=1e-2, process_group=train, param_persistence_threshold=64)
        for ids in batches(2):
            opt.zero_grad()
            lm_loss(model, ids[rank::2]).backward()
            opt.step()
        opt.close()
        if stage == 2:
            torch.optim.AdamW(model.parameters())     # whatever comes next
        rlhfz.sync_weights(model, sync if rank == 0 else None, src=0)
        out[stage] = _logits(model)
        out[f"{stage} state_dict"] = len(model.state_dict())
        try:
            opt.step()
        except Exception as error:      # noqa: BLE001 - its kind and text are the result
            out[f"{stage} step"] = f"{type(error).__name__}: {error}"
    return out
