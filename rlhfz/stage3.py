"""Stage 3: params sharded across ranks, whole only while a unit runs.

A unit is a module (a transformer block, say) whose params form one flat
bucket; each rank keeps its shard. Before the unit's forward its params are
all-gathered, and after it they are released (param.data becomes an empty
placeholder, the gathered memory goes back). Autograd keeps the params
themselves as saved tensors, so a hook on the unit's outputs gathers them
again when backward reaches the unit, and they are released again when
backward is done with it. The next unit in execution order is gathered
ahead while one runs (prefetch).

The unit's inputs pass through a node whose backward runs when the unit's
backward has made their grads: the same event on every rank, where the
unit's params go and its grads are reduced (the reducer's unit_done),
whichever of its params got grads on this rank. Whether a collective is
issued depends only on such events, never on which grads came. A unit used n times in the forwards before a
backward is done at the n-th; a use whose inputs need no grad (the
embedding's token ids) gives no such event, and its unit is reduced when
backward ends.

Which params go where:
- a param below param_persistence_threshold elements stays whole on every
  rank (it rides in an ordinary stage-2 bucket);
- a param owned by modules of one unit belongs to it; one shared across
  units (tied embeddings) belongs to the root unit, the model itself.

A unit that a forward uses more than once (the root: embedding, final norm
and a tied head) is gathered at its first use. Under no_grad (generation, a
reference model) it then stays whole until the forward ends, so each token
gathers it once; with grads it is released after each use, since autograd
gathers it again anyway.
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref

import torch

ROOT = "<root>"
# set (to anything but 0): every rank checks before each gather that the
# others gather the same unit
CHECK_UNITS = "RLHFZ_CHECK_UNITS"
COPY_REFUSED = (
    "a model sharded at stage 3 across ranks, or a part of one, cannot be deep-copied: "
    "between uses its params are empty placeholders and their values live in rlhfz's "
    "shards. Copy the model before ZeroAdamW(stage=3) or shard_model (as TRL's "
    "create_reference_model would), or build the copy anew and shard_model it")
_CHECKED = "a stage-3 gather"
DIVERGED = (f"At stage 3, ranks that run different units (a layer one rank skips, as "
            f"LayerDrop does; a branch around a whole unit) end this way too, or crash inside "
            f"gloo: set {CHECK_UNITS}=1 to check every gather, naming the unit where the "
            f"ranks part. Every rank must run the same units in the same order; make the "
            f"module that holds the branch the unit (wrap=[...]).")


def _unit_modules(model: torch.nn.Module, wrap) -> list[torch.nn.Module]:
    """The modules that become units, outermost first, in registration order."""
    if wrap is not None:
        classes = tuple(wrap)
        if not classes or not all(isinstance(c, type) for c in classes):
            raise ValueError(f"wrap must be a list of nn.Module classes, not {wrap!r}")
        candidates = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    else:
        # the blocks of a transformer: the members of every ModuleList
        candidates = [child for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                      for child in m.children()]
        if not candidates:
            candidates = _by_size(model)
        else:
            order = {id(m): i for i, m in enumerate(model.modules())}
            candidates = sorted(candidates + _large_outside(model, candidates),
                                key=lambda m: order[id(m)])
    # a candidate inside a PEFT layer (its base layer) is that layer, whose
    # forward uses the base layer's weight beside the adapters
    parents = _parents(model)
    lifted = {id(s): s for s in (_site(m, parents) for m in candidates) if s is not model}
    order = {id(m): i for i, m in enumerate(model.modules())}
    units, inside = [], set()
    for module in sorted(lifted.values(), key=lambda m: order[id(m)]):
        if id(module) in inside:                 # nested candidates join their outer unit
            continue
        units.append(module)
        inside.update(id(m) for m in module.modules())
    return units


def _parents(model: torch.nn.Module) -> dict:
    """id(module) -> the module it is registered in (the first, if several)."""
    parents = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)
    return parents


def _tuner_layer(module: torch.nn.Module) -> bool:
    """A PEFT layer (LoRA, DoRA, trainable tokens): its forward reads its
    base layer's weight and its adapters' params directly, outside their
    own forwards (F.embedding on lora_embedding_A, DoRA's weight norm)."""
    peft = sys.modules.get("peft.tuners.tuners_utils")
    return peft is not None and isinstance(module, peft.BaseTunerLayer)


def _site(module: torch.nn.Module, parents: dict) -> torch.nn.Module:
    """The module whose forward uses `module`'s own params: the outermost
    PEFT layer around it, else the nearest module up from it with a forward
    of its own (a ParameterDict's params are used by the module holding it)."""
    site = module
    while type(site).forward is torch.nn.Module.forward and id(site) in parents:
        site = parents[id(site)]
    at = site
    while id(at) in parents:
        at = parents[id(at)]
        if _tuner_layer(at):
            site = at
    return site


def _large_outside(model: torch.nn.Module, blocks: list) -> list[torch.nn.Module]:
    """Modules outside the blocks that hold at least a block's worth of
    params themselves: an untied embedding and LM head. In the root unit
    they would be whole for every forward, each making the root too big for
    a generation budget that could hold either alone. A param two of them
    share (tied weights) still goes to the root."""
    largest = max(_numel(b) for b in blocks)
    inside = {id(m) for b in blocks for m in b.modules()}
    return [m for m in model.modules() if m is not model and id(m) not in inside
            and sum(p.numel() for p in m.parameters(recurse=False)) >= largest]


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _by_size(model: torch.nn.Module, parts: int = 8) -> list[torch.nn.Module]:
    """Without blocks to follow: the largest modules of at most 1/parts of
    the model each, splitting bigger ones into their children."""
    limit = max(1, _numel(model) // parts)
    chosen = []

    def visit(module):
        for child in module.children():
            size = _numel(child)
            if size == 0:
                continue
            if size <= limit or not any(True for _ in child.children()):
                chosen.append(child)
            else:
                visit(child)
    visit(model)
    return chosen


def assign_params(model: torch.nn.Module, wrap, threshold: int, params: list):
    """([(unit module, [params])], [persistent params]): every trainable
    param once, units in registration order, the root unit last."""
    units = _unit_modules(model, wrap)
    unit_of_module = {}
    for unit in units:
        for m in unit.modules():
            unit_of_module[id(m)] = unit
    owners: dict[int, set] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(unit_of_module.get(id(module), model)))
    wanted = {id(p) for p in params}
    members: dict[int, list] = {id(u): [] for u in units + [model]}
    persistent, seen = [], set()
    for p in params:
        if id(p) in seen or id(p) not in wanted:
            continue
        seen.add(id(p))
        if p.numel() < threshold:
            persistent.append(p)
            continue
        homes = owners.get(id(p), {id(model)})
        members[next(iter(homes)) if len(homes) == 1 else id(model)].append(p)
    order = [(u, members[id(u)]) for u in units + [model] if members[id(u)]]
    return order, persistent


class Stage3:
    """The hooks that gather and release each unit's params around its use.

    A unit's hooks sit on its module; the root unit's (params the model
    itself holds, or shared between units) on each module that uses them,
    so it too is whole only while one of those runs. The model's own hooks
    mark where a forward starts and ends: the first forward records the
    order units run in, and later ones gather the next unit in that order
    while the current one runs."""

    def __init__(self, comm, units: list[tuple[torch.nn.Module, list]], root=None):
        self.comm = comm
        comm.explain_failures(DIVERGED)
        # a digest of the units this rank gathered since the last step: ranks
        # that ran different units paired gathers of different units, whose
        # shards mix without an error where their sizes agree
        self.trail = 0
        self.root = root
        self.units = []                       # [(module, [buckets])]
        self.handles = []
        self.order: list[int] = []            # unit indices, as the first forward ran them
        self.order_known = False
        self._uses: dict[int, int] = {}       # unit -> gathers per forward, once order is known
        self.position = 0                     # how far this forward is along order
        self.suspended = 0                    # gather_for_generation(enabled=True) holds all
        self.keep: set[int] = set()           # units a budget keeps gathered
        self.prefetching = True
        # Gathered bytes that holding a unit or gathering ahead may not
        # exceed (gather_for_generation sets it); None: no limit.
        self.limit: int | None = None
        self.running = False                  # inside the root's forward
        self.gather_rank: int | None = None   # gathers_onto(): the one rank made whole
        self._rooted: set[int] = set()        # units gathered onto it
        self.peak_bytes = 0
        self._pending = {}                    # unit -> in-flight gather works
        self._whole: set[int] = set()         # units with gathered params (or in flight)
        self._gathered = 0                    # their bytes
        self._unit_of: dict[int, int] = {}    # id(bucket) -> unit index
        self._index_of: dict[int, int] = {}   # id(module) -> unit index
        self._sites: list[set[int]] = []      # per unit: id of every module hooked for it
        self._depth = 0                       # forwards of the roots running (nested)
        # unit -> its sites running now: one inside another (a module that
        # holds a root param and calls a child that holds another) leaves
        # the unit whole until the outer one ends
        self._running: dict[int, int] = {}
        # per unit, this round: uses whose backward is still to come, and
        # units with a use that no backward event will close
        self._awaiting: dict[int, int] = {}
        self._unclosed: set[int] = set()
        self._listeners: list = []            # reducers' unit_done (weak)
        ref = weakref.ref(self)
        for top in _roots(root):
            self.handles.append(top.register_forward_pre_hook(_eager(_forward_starts(ref))))
            # always_call: a forward that raised lets go of what it held too
            self.handles.append(top.register_forward_hook(_eager(_forward_ends(ref)),
                                                          always_call=True))
        self.add_units(units)

    def add_units(self, units) -> None:
        """Units' buckets, by module: buckets of a module that is a unit
        already (another param group's, or its frozen params') join it, so
        the module still gathers once, all its buckets in flight together."""
        ref = weakref.ref(self)
        for module, buckets in units:
            index = self._index_of.get(id(module))
            if index is None:
                index = len(self.units)
                self.units.append((module, []))
                self._index_of[id(module)] = index
                self._sites.append(set())
            self.units[index][1].extend(buckets)
            for bucket in buckets:
                self._unit_of[id(bucket)] = index
            sites = [module]
            if module is self.root:
                # each module that uses them in its forward: for a param
                # held in a ParameterDict or by a PEFT layer's base layer,
                # the module around them that reads it (see _site)
                mine = {id(p) for b in buckets for p in b.params}
                parents = _parents(module)
                sites = list({id(s): s for s in (
                    _site(m, parents) for m in module.modules()
                    if any(id(p) in mine for p in m.parameters(recurse=False)))}.values())
            for site in sites:
                if id(site) in self._sites[index]:
                    continue
                self._sites[index].add(id(site))
                self.handles += [
                    site.register_forward_pre_hook(_eager(_pre_forward(ref, index))),
                    # always_call: a site that raised leaves no count behind
                    site.register_forward_hook(_eager(_post_forward(ref, index)),
                                               always_call=True),
                    site.register_forward_pre_hook(_eager(_mark_backward_done(ref, index)),
                                                   with_kwargs=True)]

    def replace_bucket(self, old, new) -> None:
        """A unit's bucket rebuilt (an optimizer took some of its params):
        `new` takes its place, or with None it just goes."""
        index = self._unit_of.pop(id(old))
        buckets = self.units[index][1]
        at = next(i for i, b in enumerate(buckets) if b is old)
        if new is None:
            del buckets[at]
        else:
            buckets[at] = new
            self._unit_of[id(new)] = index

    def all_trained(self, index: int) -> bool:
        """Whether every param of the unit gets a grad. A unit with frozen
        params is released after each use's backward; a trained one stays
        whole until its last (backward_done)."""
        return all(b.trainable for b in self.units[index][1])

    # ---- gathering --------------------------------------------------------------------

    def __deepcopy__(self, memo):
        # reached through any module of the model (generation.mark_parts)
        raise TypeError(COPY_REFUSED)

    def gathered_bytes(self) -> int:
        return self._gathered

    def take_trail(self) -> dict:
        """What the ranks agree on at the step: the units gathered since."""
        trail, self.trail = self.trail, 0
        return {"the stage-3 units gathered since the last step (a digest: ranks that differ "
                "ran different units, whose gathers mixed their shards)": trail}

    def unit_bytes(self, index: int) -> int:
        return sum(b.layout.padded_numel * b.itemsize for b in self.units[index][1])

    def _start(self, index: int, async_op: bool) -> list:
        """Gathers a unit's buckets that are not whole; their works."""
        works = []
        if self.gather_rank is not None:
            self._rooted.add(index)
        if os.environ.get(CHECK_UNITS, "0") != "0" and \
                any(b.gathered is None for b in self.units[index][1]):
            module = self.units[index][0]
            self.comm.agree(_CHECKED, f"unit {index} ({type(module).__name__})")
        for bucket in self.units[index][1]:
            if bucket.gathered is None:
                works.append(bucket.gather(self.comm, async_op=async_op,
                                           root=self.gather_rank))
                self._gathered += bucket.gathered_bytes()
        if works:
            self.trail = (self.trail * 1_000_003 + index + 1) % (1 << 61)
        self._whole.add(index)
        self.peak_bytes = max(self.peak_bytes, self._gathered)
        return works

    def gather(self, index: int) -> None:
        work = self._pending.pop(index, None)
        if work is not None:
            for w in work:
                if w is not None:
                    w.wait()
        elif any(b.gathered is None for b in self.units[index][1]):
            self._start(index, async_op=False)

    def prefetch(self, index: int | None) -> None:
        """Starts gathering a unit (in flight while the current one runs)."""
        if index is None or not self.prefetching or index in self._pending:
            return
        if all(b.gathered is not None for b in self.units[index][1]):
            return
        if not self.fits(self.unit_bytes(index)):
            return
        self._pending[index] = self._start(index, async_op=True)

    def fits(self, more: int) -> bool:
        return self.limit is None or self._gathered + more <= self.limit

    def release(self, index: int) -> None:
        if self.suspended or index in self.keep:
            return
        self._drop(index)

    def _drop(self, index: int) -> None:
        work = self._pending.pop(index, None)
        for w in work or []:
            if w is not None:
                w.wait()
        for bucket in self.units[index][1]:
            self._gathered -= bucket.gathered_bytes()
            bucket.release()
        self._whole.discard(index)

    def release_all(self) -> None:
        for index in sorted(self._whole):
            self.release(index)

    @contextlib.contextmanager
    def gathers_onto(self, rank: int):
        """Within it, gathers make params whole on the shard group's `rank`
        alone (a weight sync's sender): the others only send their shards,
        1/n of an all-gather's bytes over n ranks. Units whole already stay
        so; the units it gathered are all released at the end, kept ones
        too, so that every rank leaves it alike. Where the engine has no
        such gather, units gather whole everywhere."""
        self.gather_rank = rank if self.comm.gathers_to_one else None
        try:
            yield
        finally:
            self.gather_rank = None
            rooted, self._rooted = self._rooted, set()
            for index in sorted(rooted & self._whole):
                self._drop(index)

    def hold_all(self) -> None:
        """Every unit whole until unhold_all (the hooks stand aside). All
        gathers are issued before the first is waited for, so they stream."""
        self.gather_many(range(len(self.units)))
        self.suspended += 1

    def gather_many(self, indices) -> None:
        indices = list(indices)
        prefetching, self.prefetching = self.prefetching, True
        try:
            for index in indices:
                self.prefetch(index)
        finally:
            self.prefetching = prefetching
        for index in indices:
            self.gather(index)

    def unhold_all(self) -> None:
        self.suspended -= 1

    def units_within(self, budget: int) -> set[int]:
        """Units to keep whole under a budget of bytes: those a forward uses
        most often first (the root), then the larger, as long as they fit.
        A unit kept saves its gathers in every forward, so for the same
        budget more uses mean more saved. A unit used often that does not
        fit is gathered once per forward if it can be held beside the next
        unit (see holds()): kept units make room for that while they save
        less than it does."""
        sizes = [self.unit_bytes(i) for i in range(len(self.units))]
        uses = self.uses()
        ranked = sorted(range(len(sizes)), key=lambda i: (-uses.get(i, 1), -sizes[i], i))
        chosen, used = [], 0
        for index in ranked:
            if used + sizes[index] <= budget:
                chosen.append(index)
                used += sizes[index]
        left = [i for i in ranked if i not in chosen and uses.get(i, 1) > 1]
        if not left:
            return set(chosen)
        reused, limit = left[0], self.limits(budget)

        def room(kept):
            outside = max((sizes[i] for i in range(len(sizes))
                           if i not in kept and i != reused), default=0)
            return sum(sizes[i] for i in kept) + sizes[reused] + outside <= limit
        trial, given = list(chosen), 0
        while trial and not room(trial):
            given += sizes[trial.pop()]
        saved = (uses[reused] - 1) * sizes[reused]
        return set(trial if room(trial) and given < saved else chosen)

    def uses(self) -> dict[int, int]:
        """How many times one forward gathers each unit (by the first one;
        counted once, since every unit's use asks)."""
        return self._uses

    def limits(self, budget: int | None) -> int:
        """The gathered bytes unit by unit allows (two units: one running,
        the next one gathered ahead), or a budget's (plus one unit running,
        and never less than unit by unit)."""
        sizes = sorted(self.unit_bytes(i) for i in range(len(self.units)))
        two = sum(sizes[-2:])
        return two if budget is None else max(two, budget + (sizes[-1] if sizes else 0))

    def holds(self, index: int) -> bool:
        """Whether a unit stays whole after a use, until the forward ends:
        one used again in this no_grad forward, while any other unit still
        fits beside it (gathering ahead waits for room)."""
        if not self.running or torch.is_grad_enabled() or self.uses().get(index, 1) < 2:
            return False
        if self.limit is None:
            return True
        # a unit gathered ahead gives way: it saves no bytes, holding does
        ahead = sum(self.unit_bytes(i) for i in self._pending)
        others = [self.unit_bytes(i) for i in range(len(self.units))
                  if i != index and (i not in self._whole or i in self._pending)]
        return self._gathered - ahead + max(others, default=0) <= self.limit

    def following(self) -> int | None:
        """The unit after the one running now, by the first forward's order."""
        if not self.order_known or self.position >= len(self.order):
            return None
        return self.order[self.position]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ---- backward ---------------------------------------------------------------------

    def listen(self, unit_done) -> None:
        """unit_done(buckets) is called when backward is done with a unit
        (a bound method, held weakly: a reducer dropped stops listening)."""
        self._listeners = [m for m in self._listeners if m() is not None]
        self._listeners.append(weakref.WeakMethod(unit_done))

    def use_starts(self, index: int, closes: bool) -> None:
        """A forward with grads uses the unit; `closes`: its backward will
        say when it is done (its inputs need grads)."""
        if not closes:
            self._unclosed.add(index)
        elif torch._C._current_graph_task_id() < 0:
            # a use inside backward recomputes a checkpointed one: the
            # reentrant kind's backward says so, as the use it stands for
            # would have; the other kind's never runs
            self._awaiting[index] = self._awaiting.get(index, 0) + 1

    def backward_done(self, index: int) -> None:
        """A use's backward made its inputs' grads. The unit's params may
        go (a frozen unit has no grads to say so); after its last use its
        grads are reduced."""
        left = self._awaiting.get(index, 0) - 1
        self._awaiting[index] = left
        if left <= 0 and index not in self._unclosed:
            for method in list(self._listeners):
                unit_done = method()
                if unit_done is not None:
                    unit_done(self.units[index][1])
            self.release(index)
        elif not self.all_trained(index):
            self.release(index)

    def round_ended(self) -> None:
        """The reducer's round of grads ended (its backward did): the next
        one counts uses afresh."""
        self._awaiting.clear()
        self._unclosed.clear()


def _eager(hook):
    """Under torch.compile the hooks run eagerly, between graphs (a graph
    break at each unit's edges): they swap param.data, which a graph cannot
    hold."""
    return torch.compiler.disable(hook, recursive=True)


def _roots(root) -> list:
    """The modules whose forward is a whole forward of the model: the root,
    and the model a PEFT wrapper's generate runs (its base model, whose
    forward the wrapper's own forward calls too)."""
    if root is None:
        return []
    base = getattr(root, "get_base_model", None)
    base = base() if callable(base) else None
    return [root] + ([base] if isinstance(base, torch.nn.Module) and base is not root else [])


def _forward_starts(ref):
    def hook(module, args):
        self = ref()
        if self is None:
            return
        self._depth += 1
        if self._depth > 1:               # the base model's forward inside the wrapper's
            return
        if self.running:                  # the last forward raised: what it held goes
            self.release_all()
        self._running.clear()
        self.position = 0
        self.running = True
    return hook


def _forward_ends(ref):
    def hook(module, args, output):
        self = ref()
        if self is None:
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth > 0:
            return
        if output is None and not self.order_known:
            self.order.clear()        # it may have raised midway: the next one records
        if not self.order_known and self.order:
            self.order_known = True
            for index in self.order:
                self._uses[index] = self._uses.get(index, 0) + 1
        self.running = False
        self._running.clear()
        self.release_all()            # with any gather ahead that went unused
    return hook


def _pre_forward(ref, index):
    def hook(module, args):
        self = ref()
        if self is None or self.suspended:
            return
        # a count with the unit not whole was left by a site that raised
        inside = self._running.get(index, 0) if index in self._whole else 0
        self._running[index] = inside + 1
        if inside:                    # within another site of the unit: whole already
            return
        if not self.order_known and self.running:
            # only a forward of the root says the order: a submodule run
            # alone (PEFT's generate runs the base model) would stretch it
            self.order.append(index)
        self.position += 1
        self.gather(index)
        self.prefetch(self.following())
    return hook


def _post_forward(ref, index):
    def hook(module, args, output):
        self = ref()
        if self is None or self.suspended:
            return
        inside = self._running.get(index, 0)
        if inside > 1:                # the outer site still runs, and uses the unit
            self._running[index] = inside - 1
            return
        self._running.pop(index, None)
        if torch.is_grad_enabled():
            _on_backward(output, lambda: _backward_gather(ref, index))
        elif self.holds(index):
            return
        self.release(index)
    return hook


def _backward_gather(ref, index):
    self = ref()
    if self is None:
        return
    self.gather(index)
    if not self.all_trained(index):
        # a use whose inputs need no grads says nothing when it is done: at
        # the latest, when backward ends (a trained unit's reducer releases
        # it there)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _release(ref, index))
    # backward runs units in reverse: gather the one before this ahead
    if index in self.order:
        at = self.order.index(index)
        if at > 0:
            self.prefetch(self.order[at - 1])


def _release(ref, index):
    self = ref()
    if self is not None:
        self.release(index)


class _BackwardDone(torch.autograd.Function):
    """Passes a unit's inputs through; its backward runs once the unit's
    backward has made their grads."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        # An input returned as it is would be a view made inside a custom
        # Function, which torch lets nothing change in place; a detached
        # alias shares its memory and version counter, so an in-place op on
        # it does what it does on the input in torch, grads and checks alike.
        tensors = tuple(t.detach() for t in tensors)
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None,) + grads


def _mark_backward_done(ref, index):
    """In a forward with grads, the unit's inputs that need grads go through
    _BackwardDone, which tells stage 3 when backward is done with this use."""
    def hook(module, args, kwargs):
        self = ref()
        if self is None or self.suspended or not torch.is_grad_enabled() or \
                self._running.get(index, 0) > 1:
            return None               # (inside another site: the outer one says)
        places = [("a", i) for i, a in enumerate(args)
                  if isinstance(a, torch.Tensor) and a.requires_grad]
        places += [("k", k) for k, v in kwargs.items()
                   if isinstance(v, torch.Tensor) and v.requires_grad]
        self.use_starts(index, closes=bool(places))
        if not places:
            return None
        fired = []

        def done():
            if not fired:
                fired.append(True)
                owner = ref()
                if owner is not None:
                    owner.backward_done(index)
        values = [args[at] if kind == "a" else kwargs[at] for kind, at in places]
        passed = _BackwardDone.apply(done, *values)
        passed = passed if isinstance(passed, tuple) else (passed,)
        args, kwargs = list(args), dict(kwargs)
        for (kind, at), value in zip(places, passed):
            if kind == "a":
                args[at] = value
            else:
                kwargs[at] = value
        return tuple(args), kwargs
    return hook


def _on_backward(output, fn) -> None:
    """Calls fn once, when backward first reaches any tensor of output."""
    tensors = [t for t in _tensors(output) if t.requires_grad]
    if not tensors:
        return
    fired = []

    def grad_hook(grad):
        if not fired:
            fired.append(True)
            fn()
        return None
    for t in tensors:
        t.register_hook(grad_hook)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif hasattr(value, "to_tuple"):               # transformers' ModelOutput
        yield from _tensors(value.to_tuple())
