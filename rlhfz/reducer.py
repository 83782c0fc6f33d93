"""Stage 2: grads are reduce-scattered while backward is still running.

A post-accumulate-grad hook copies each param's grad into one of two
reusable staging buffers (per reduce dtype, so 16-bit grads may be summed
in fp32) and drops the param's own grad, so no
full-size grad outlives its bucket. When every param of a bucket has its
grad, the bucket's reduce-scatter starts asynchronously, overlapping the rest
of backward, and leaves the averaged grad in the bucket's shard. Later
micro-batches add into that shard: accumulation needs no full-size memory.

Staging is two slots of at most the bucket cap (bucket_bytes), whatever the
largest bucket: a bucket above the cap (a param larger than it: a big
embedding; a stage 3 unit) keeps its params' grads as autograd made them
until its turn, then reduce-scatters them in pieces through the slots. A
later micro-batch reduces in place (this rank's range of the staged grads
receives the mean, NCCL's in-place form) and adds that into the shard, so
the reducer's memory is two slots: at most two caps.

Every rank must issue the same collectives in the same order, whatever order
its grads arrive in, so buckets are launched in one agreed order; a bucket
that completes early waits for those before it. The first backward uses
descending index; at its end the ranks take the leading rank's order of
completion, which the later ones follow. Descending index is the order
backward completes a single param group's buckets, but not several groups':
a group of biases and norm weights (what transformers' Trainer exempts from
weight decay) completes at the first block, last, and would hold back every
bucket of the other groups until then. At the end of backward (an autograd
engine callback) the rest are launched, complete or not: a param without a
grad contributes zeros.

Stage 3 gathers units during backward, so a reduction must be launched at
the same point among those gathers on every rank, and a bucket's last grad
is no such point: a param that gets a grad on some ranks only (a branch
taken on one rank) would complete its bucket on some ranks and not others.
There, a unit's buckets launch when backward is done with the unit
(unit_done, told by stage 3 from the unit's inputs' grads, the same event
on every rank), and the rest when backward ends.

A grad that comes after its bucket was launched (a weight shared by two
reentrant checkpointed segments, whose nested backwards each end a use)
reopens the bucket, to be reduced again when backward ends. That may happen
on one rank alone, so at the end of each backward the ranks agree, in one
small MAX all-reduce, which buckets to reduce again; a rank without such
grads adds zeros.
"""
from __future__ import annotations

import torch

from .engine import (DTYPE_NAMES, Bucket, after_outer_node, check_grad_dtype, rank_range,
                     stage2_bucket_bytes, torch_view)


class _Progress:
    """One bucket's part in the current backward."""

    def __init__(self, bucket: Bucket):
        count = len(bucket.params)
        self.gaps = bucket.layout.gaps()
        self.arrived = [False] * count      # a grad came since zero(), in any micro-batch
        self.accumulated = False            # the grad shard holds a reduced grad already
        self.generation = 0                 # reduce-scatters launched so far
        self.staged = None                  # (staging slot or None, flat) this round
        self.staged_params = [False] * count
        self.arrived_now = 0                # distinct params staged this round
        self.launched = False
        self.launches = 0                   # reduce-scatters launched this round
        self.held: dict[int, torch.Tensor] = {}   # above the cap: grads until launch

    def open(self, count: int) -> None:
        self.launches = 0
        self.reopen(count)

    def reopen(self, count: int) -> None:
        """Stages anew: grads that came after the bucket was launched."""
        self.staged = None
        self.staged_params = [False] * count
        self.arrived_now = 0
        self.launched = False
        self.held = {}


class GradReducer:
    def __init__(self, buckets: list[Bucket], comm, backend, bucket_bytes: int | None = None):
        self.buckets = buckets            # the engine's list; it grows with add_param_group
        self.comm = comm
        self.backend = backend
        self._progress: dict[Bucket, _Progress] = {}
        self._staging: dict[torch.dtype, list[torch.Tensor]] = {}
        self._staging_buffers: dict[torch.dtype, list] = {}   # the memory behind them
        self._slot_work: dict[tuple, object] = {}
        self._slot_owner: dict[tuple, Bucket] = {}
        self._pending = []                # (work, tensor kept alive until it is done)
        self._round_open = False
        self._scanned_task = None         # the backward before_grad last looked at
        self._sequence: list[Bucket] = []   # the launch order
        self._learned = False             # the ranks agreed on it
        self._completed: list[Bucket] = []  # this round, as its buckets completed
        self._next = 0                    # the next in _sequence to launch
        self.bucket_bytes = bucket_bytes  # ZeroAdamW's option (None: the default cap)
        # stage 3: buckets launch when stage 3 says their unit is done
        # (unit_done) or when backward ends, never on their last grad
        self.launch_when_staged = True
        # stage 3: told when backward is over
        self.after_flush = None
        self.round_ended = None
        # the engine: a clip not yet applied goes into the grads before more come
        self.before_new_grads = None

    def _of(self, bucket: Bucket) -> _Progress:
        progress = self._progress.get(bucket)
        if progress is None:
            progress = self._progress[bucket] = _Progress(bucket)
        return progress

    # ---- what the step and stage 3 ask -----------------------------------------------

    def arrived(self, bucket: Bucket) -> list[bool]:
        """Which params got a grad since zero()."""
        return list(self._of(bucket).arrived)

    def version(self, bucket: Bucket) -> int:
        """Changes whenever the bucket's grad shard gets another reduced grad."""
        return self._of(bucket).generation

    # ---- memory -------------------------------------------------------------------

    def reserve(self) -> None:
        """Sizes the staging slots for the largest bucket of each dtype, up
        to the cap (called when buckets are added); buckets above it go in
        pieces of a slot each."""
        for dtype in DTYPE_NAMES:
            members = [b for b in self.buckets if b.reduce_dtype == dtype]
            if not members:
                continue
            self._learned = False     # buckets came: the order is learned anew
            numel = self._slot_numel(dtype)
            have = self._staging.get(dtype)
            if have is not None and have[0].numel() >= numel:
                continue
            self.wait_all()
            itemsize = torch.empty((), dtype=dtype).element_size()
            buffers = [self.backend.buffer(numel * itemsize) for _ in range(2)]
            self._staging_buffers[dtype] = buffers      # the smaller ones are freed
            self._staging[dtype] = [torch_view(b.view(DTYPE_NAMES[dtype])) for b in buffers]

    def _slot_numel(self, dtype: torch.dtype) -> int:
        """A staging slot: the largest bucket of the dtype, at most the cap
        (and at least one element per rank, so a piece is never empty)."""
        members = [b for b in self.buckets if b.reduce_dtype == dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        largest = max(b.layout.padded_numel for b in members)
        cap = stage2_bucket_bytes(sum(b.layout.padded_numel for b in members) * itemsize,
                                  self.bucket_bytes)
        return min(largest, max(cap // itemsize, members[0].world_size))

    def _pieced(self, bucket: Bucket) -> bool:
        """Above the cap: reduced in pieces from its held grads."""
        staging = self._staging.get(bucket.reduce_dtype)
        return staging is not None and bucket.layout.padded_numel > staging[0].numel()

    def release(self) -> None:
        """Frees the staging memory (it holds nothing between backwards);
        reserve() makes it again."""
        self.flush()
        self._staging.clear()
        self._staging_buffers.clear()
        self._slot_owner.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._staging.values() for t in ts)

    # ---- backward -------------------------------------------------------------------

    def _open_round(self) -> None:
        if self._round_open:
            return
        if not self._staging and self.buckets:
            raise RuntimeError("backward needs the optimizer's grads where it trains, but they "
                               "are offloaded (offload(what=(..., 'grads'))): call reload() "
                               "before the next backward")
        if self.before_new_grads is not None:
            self.before_new_grads()
        self._round_open = True
        if not self._learned or len(self._sequence) != len(self.buckets):
            self._sequence = list(reversed(self.buckets))
            self._learned = False
        self._completed = []
        self._next = 0
        for bucket in self.buckets:
            self._of(bucket).open(len(bucket.params))
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
        except RuntimeError:
            pass    # not inside backward (a grad set by hand): step() flushes

    def unit_done(self, buckets) -> None:
        """Backward is done with a stage-3 unit: those of its buckets that
        are this reducer's, and not launched yet this round, launch now (in
        descending index, on every rank at the same event). A unit with
        none of them (another optimizer's) opens no round here."""
        theirs = {id(b) for b in buckets}
        mine = [b for b in reversed(self.buckets) if id(b) in theirs and b.trainable]
        if not mine:
            return
        self._open_round()
        for bucket in mine:
            if self._of(bucket).launches == 0:
                self._launch(bucket)

    def _backward_ends(self) -> None:
        """The backward that opened the round ended. A reentrant backward
        (activation checkpointing with use_reentrant=True) runs inside a node
        of an outer one, which goes on after it: the round stays open, so
        the outer backward's grads join it, and ends with the outermost.
        Flushing here would launch every bucket once per checkpointed
        segment (zeros where no grad came) and, at stage 3, release units
        whose params the outer backward still reads."""
        if not after_outer_node(lambda: torch.autograd.Variable._execution_engine
                                .queue_callback(self._backward_ends)):
            self.flush()

    def _stage(self, bucket: Bucket) -> torch.Tensor:
        """The staging tensor that holds this bucket's grads in this round."""
        progress = self._of(bucket)
        if progress.staged is None:
            slot = (bucket.reduce_dtype, bucket.index % 2)
            owner = self._slot_owner.get(slot)
            theirs = self._of(owner) if owner is not None else None
            if owner is not None and owner is not bucket and theirs.staged is not None \
                    and not theirs.launched:
                # Grads of three buckets interleave (rare: e.g. a tied weight
                # far from its bucket): this one gets its own staging memory
                # rather than take a slot that still fills.
                flat = self.backend.empty(bucket.layout.padded_numel, bucket.reduce_dtype)
                flat.zero_()
                progress.staged = (None, flat)
                return flat
            work = self._slot_work.pop(slot, None)
            if work is not None:
                work.wait()
            flat = self._staging[bucket.reduce_dtype][slot[1]][:bucket.layout.padded_numel]
            # Each param's first grad is copied in, and params that send
            # none are zeroed at launch: only the gaps are zeroed here.
            for start, stop in progress.gaps:
                flat[start:stop].zero_()
            self._slot_owner[slot] = bucket
            progress.staged = (slot, flat)
        return progress.staged[1]

    def before_grad(self, bucket: Bucket, index: int, param: torch.Tensor) -> None:
        """Before a backward's first grad accumulates (once per backward):
        a grad set by hand between two backwards of one accumulation would
        have backward add into it, and the reduction add that to what the
        earlier backwards left in the shards, where torch's `p.grad = t`
        drops them. Refused before anything of this backward is staged."""
        if self._round_open:
            return      # every later grad of this backward: one attribute read
        task = torch._C._current_graph_task_id()
        if task == self._scanned_task:
            return
        self._scanned_task = task
        for b in self.buckets:
            arrived = self._of(b).arrived
            for i, p in enumerate(b.params):
                if p.grad is not None and arrived[i]:
                    raise ValueError(
                        f"a grad was set by hand (p.grad = ...) between two backwards of one "
                        f"accumulation, for a param of shape {tuple(b.layout.slots[i].shape)} "
                        f"(group {b.group_index}): torch's assignment drops what the earlier "
                        f"backwards left, which at stage 2 and 3 is already reduced into the "
                        f"shards. Set grads after the last backward (they replace), or before "
                        f"the first (backward adds into them), or use stage 1. Nothing of this "
                        f"backward was taken; p.grad = None drops the grad set by hand")

    def on_grad(self, bucket: Bucket, index: int, param: torch.Tensor) -> None:
        try:
            self._open_round()
        except RuntimeError:
            param.grad = None       # a refused backward leaves no full grad behind
            raise
        progress = self._of(bucket)
        if progress.launched:
            # launched already: this grad is reduced again when backward
            # ends (see _agree_late)
            self._reopen(bucket)
        with torch.no_grad():
            if self._pieced(bucket):
                if progress.staged_params[index]:     # not in place: it may be stolen
                    progress.held[index] = progress.held[index] + param.grad
                else:
                    progress.held[index] = param.grad
            else:
                flat = self._stage(bucket)
                slot = bucket.layout.slots[index]
                target = flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                if progress.staged_params[index]:
                    target.add_(param.grad)
                else:
                    target.copy_(param.grad)
            if not progress.staged_params[index]:
                progress.staged_params[index] = True
                progress.arrived_now += 1     # distinct params, so a repeat cannot launch early
        param.grad = None
        progress.arrived[index] = True
        if progress.arrived_now == bucket.trainable and progress.launches == 0:
            self._completed.append(bucket)
            if self.launch_when_staged:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._sequence):
            bucket = self._sequence[self._next]
            if bucket.trainable and self._of(bucket).arrived_now < bucket.trainable:
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        progress = self._of(bucket)
        if progress.launched or not bucket.trainable:
            return
        if self._pieced(bucket):
            self._launch_pieces(bucket, progress)
            return
        flat = self._stage(bucket)
        if progress.arrived_now < len(bucket.params):
            for index, staged in enumerate(progress.staged_params):
                if not staged:      # no grad this round: it adds zeros
                    place = bucket.layout.slots[index]
                    flat[place.offset:place.offset + place.numel].zero_()
        slot = progress.staged[0]
        progress.launched = True
        progress.launches += 1
        progress.generation += 1
        if not progress.accumulated:
            work = self.comm.reduce_scatter(bucket.flat_grad_shard, flat, async_op=True)
            if slot is None:
                self._pending.append((work, flat))
            else:
                self._slot_work[slot] = work
            progress.accumulated = True
            return
        # A later micro-batch: reduce in place, then add into the shard.
        _reduce_and_add(self.comm, bucket, flat, bucket.flat_grad_shard)

    def _launch_pieces(self, bucket: Bucket, progress: _Progress) -> None:
        """Reduce-scatters a bucket above the cap from its held grads: for
        each piece of the shard range, every rank's part of it is packed
        into a staging slot (the two alternate, so one packs while the
        other's collective runs); a param without a grad adds zeros."""
        held, progress.held = progress.held, {}
        progress.launched = True
        progress.launches += 1
        progress.generation += 1
        accumulate, progress.accumulated = progress.accumulated, True
        dtype, world = bucket.reduce_dtype, bucket.world_size
        shard = bucket.layout.shard_numel
        step = max(1, self._staging[dtype][0].numel() // world)
        for number, lo in enumerate(range(0, shard, step)):
            hi = min(lo + step, shard)
            slot, memory = self._piece_slot(bucket, number)
            flat = memory[:world * (hi - lo)]
            for rank in range(world):
                start, stop = rank_range(rank, hi - lo)
                _pack(flat[start:stop], held, bucket.layout, rank_range(rank, shard)[0] + lo)
            target = bucket.flat_grad_shard[lo:hi]
            if accumulate:
                _reduce_and_add(self.comm, bucket, flat, target)
                continue
            work = self.comm.reduce_scatter(target, flat, async_op=True)
            if slot is None:
                self._pending.append((work, memory))
            else:
                self._slot_work[slot] = work

    def _piece_slot(self, bucket: Bucket, number: int):
        """(slot, memory) for a piece: a staging slot once its last
        collective is done; one still filling with another bucket's grads is
        left to it, and the piece gets memory of its own (slot None)."""
        slot = (bucket.reduce_dtype, number % 2)
        owner = self._slot_owner.get(slot)
        if owner is not None and owner is not bucket:
            theirs = self._of(owner)
            if theirs.staged is not None and not theirs.launched:
                return None, self.backend.empty(self._staging[slot[0]][0].numel(), slot[0])
        work = self._slot_work.pop(slot, None)
        if work is not None:
            work.wait()
        self._slot_owner[slot] = bucket
        return slot, self._staging[slot[0]][slot[1]]

    def flush(self) -> None:
        """Launches whatever backward left (in order), and waits for it all."""
        ended = self._round_open
        if ended:
            self._round_open = False
            # first every bucket's first launch, as a rank still inside
            # backward may wait for one of them; then those reopened. The
            # agreement waits for the data in flight: a hybrid engine's
            # chains start their replicate phase on the group it uses.
            for bucket in self._sequence:
                if self._of(bucket).launches == 0:
                    self._launch(bucket)
            self._next = len(self._sequence)
            self.wait_all()
            self._agree_late()
            if not self._learned:
                self._learn_order()
            for bucket in reversed(self.buckets):
                self._launch(bucket)
        self.wait_all()
        if ended and self.round_ended is not None:
            self.round_ended()
        if self.after_flush is not None:
            self.after_flush()

    def _agree_late(self) -> None:
        """Buckets with grads that came after they were launched, on any
        rank, are reopened on every rank (zeros where none came), so the
        launches that follow are the same everywhere."""
        reopened = [self._of(b).launches > 0 and not self._of(b).launched
                    for b in self.buckets]
        flags = torch.tensor(reopened, dtype=torch.uint8)
        self.comm.all_reduce_max_control(flags, "backward (grads after their bucket went)")
        for bucket, mine, anyone in zip(self.buckets, reopened, flags.tolist()):
            if anyone and not mine:
                self._reopen(bucket)

    def _learn_order(self) -> None:
        """The launch order from now on: the leading rank's order of
        completion in this backward, then the buckets it did not complete,
        in descending index. Every rank takes the same one."""
        position = {id(b): i for i, b in enumerate(self.buckets)}
        done = [position[id(b)] for b in self._completed]
        completed = set(done)
        rest = [i for i in reversed(range(len(self.buckets))) if i not in completed]
        order = self.comm.statuses(done + rest, "backward (the order grads complete)")[0]
        if sorted(order) != list(range(len(self.buckets))):
            raise RuntimeError(f"the ranks hold different buckets ({len(self.buckets)} here, "
                               f"{len(order)} on the leading rank): build the same "
                               f"optimizer on every rank")
        self._sequence = [self.buckets[i] for i in order]
        self._learned = True

    def _reopen(self, bucket: Bucket) -> None:
        """Stages the bucket anew. Its next launch adds into the grad shard
        that the last one may still be writing (rare: wait for them all)."""
        self.wait_all()
        self._of(bucket).reopen(len(bucket.params))

    def wait_all(self) -> None:
        for slot in list(self._slot_work):
            self._slot_work.pop(slot).wait()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # ---- before a step ------------------------------------------------------------------

    def hand_set(self) -> list[list[bool]]:
        """Which params have a grad assigned by hand (not through backward,
        which leaves None), each checked; no collective."""
        marks = []
        for bucket in self.buckets:
            marks.append([p.grad is not None for p in bucket.params])
            for i, p in enumerate(bucket.params):
                if p.grad is None:
                    continue
                shape = bucket.layout.slots[i].shape
                if tuple(p.grad.shape) != shape:
                    placeholder = bucket.sharded_params and p.numel() == 0
                    raise ValueError(
                        f"a param of shape {shape} (group {bucket.group_index}) has a grad of "
                        f"shape {tuple(p.grad.shape)} set by hand" + (
                            ": at stage 3 a param outside a forward is a 0-element placeholder, "
                            "so zeros_like(param) is not a grad for it (torch.distributed."
                            "checkpoint's set_optimizer_state_dict makes such grads for an "
                            "optimizer that has no state yet). Load the state with "
                            "optimizer.load_state_dict instead, or set grads of the full shape"
                            if placeholder else ""))
                check_grad_dtype(p, p.grad, bucket.group_index)
        return marks

    def take_hand_set(self, anyone: list[list[bool]]) -> None:
        """Reduces the grads set by hand on any rank (anyone: agreed across
        ranks), on every rank, zeros where a rank set none. As torch's
        `p.grad = t`, such a grad replaces what backward left for the param:
        its part of the grad shard starts over first."""
        self.flush()      # backward's reductions are done before a part starts over
        if not any(map(any, anyone)):
            return
        self._check_hand_set_everywhere(anyone)
        for bucket, marks in zip(self.buckets, anyone):
            if not self._of(bucket).accumulated:
                continue      # the next launch writes the shard, not adds to it
            for i, mark in enumerate(marks):
                if mark:
                    lo, hi = bucket.shard.local[i]
                    bucket.flat_grad_shard[lo:hi].zero_()
        self._open_round()      # on every rank: the same launches everywhere
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if p.grad is not None:
                    self.on_grad(bucket, i, p)
        self.flush()

    def _check_hand_set_everywhere(self, anyone: list[list[bool]]) -> None:
        """A grad set by hand after backward replaces the reduced grad in
        the shard; set on some ranks only, there is no such whole grad to
        replace (under DDP the ranks would step apart): refused on every
        rank alike, before anything changes. One small sum, only when some
        rank set a grad by hand."""
        mine = [p.grad is not None for bucket in self.buckets for p in bucket.params]
        sums = self.comm.count_control(torch.tensor([1.0] + mine, dtype=torch.float64))
        ranks, counts = int(sums[0]), [int(c) for c in sums[1:].tolist()]
        at = 0
        for bucket, marks in zip(self.buckets, anyone):
            for i, mark in enumerate(marks):
                count = counts[at + i]
                if mark and count < ranks and self._of(bucket).accumulated:
                    raise ValueError(
                        f"a grad was set by hand (p.grad = ...) after backward on {count} of "
                        f"{ranks} ranks for a param of shape "
                        f"{tuple(bucket.layout.slots[i].shape)} (group {bucket.group_index}): "
                        f"at stage 2 and 3 backward's grad is already reduced into the "
                        f"shards, and p.grad = t replaces it only when every rank sets one "
                        f"(their mean is taken, as DDP averages grads). Set it on every rank, "
                        f"set grads before backward (backward adds into them), or use "
                        f"stage 1, where p.grad holds the whole grad after backward")
            at += len(marks)

    def zero(self, set_to_none: bool = True) -> None:
        """The grads start over. set_to_none=False keeps, as torch does, a
        zero grad for every param that had one, so the next step steps it
        (weight decay, momentum) even if no grad comes for it."""
        self.flush()
        for bucket in self.buckets:
            progress = self._of(bucket)
            progress.accumulated = False
            if set_to_none:
                progress.arrived = [False] * len(bucket.params)
            elif any(progress.arrived):
                bucket.flat_grad_shard.zero_()

    def zero_param(self, bucket: Bucket, index: int, set_to_none: bool = True) -> None:
        """One param's grad starts over: its elements of this rank's shard
        are zeroed, and until a grad comes it has none (as p.grad = None),
        or a zero one (set_to_none=False, as torch's zero_())."""
        self.flush()
        shard = bucket.flat_grad_shard
        lo, hi = rank_range(bucket.shard.rank, shard.numel())
        slot = bucket.layout.slots[index]
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < stop:
            shard[start - lo:stop - lo].zero_()
        if set_to_none:
            self._of(bucket).arrived[index] = False


def _reduce_and_add(comm, bucket: Bucket, flat: torch.Tensor, target: torch.Tensor) -> None:
    """target += the mean over ranks of this rank's range of flat. The mean
    lands in that range of flat itself, so no memory is set aside for it."""
    lo, hi = rank_range(bucket.shard.rank, target.numel())
    mine = flat[lo:hi]
    comm.reduce_scatter(mine, flat)
    target.add_(mine)


def _pack(out: torch.Tensor, held: dict, layout, start: int) -> None:
    """out = elements [start, start + len(out)) of the bucket's flat grads,
    taken from the held grads; gaps, padding and params without one are 0."""
    stop, filled = start + out.numel(), start
    for index, slot in enumerate(layout.slots):
        lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
        if lo >= hi:
            continue
        if lo > filled:
            out[filled - start:lo - start].zero_()
        grad = held.get(index)
        if grad is None:
            out[lo - start:hi - start].zero_()
        else:
            out[lo - start:hi - start].copy_(grad.reshape(-1)[lo - slot.offset:hi - slot.offset])
        filled = hi
    if filled < stop:
        out[filled - start:].zero_()
