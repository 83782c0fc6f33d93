"""Bodies of the soak and security tests, and what they measure about this
process: resident memory, open file descriptors, memory mappings, child
processes and listening sockets. Importable by spawned ranks."""
import gc
import os
import time

import torch

import disk_files
import rlhfz
from state_snapshots import resident_kib


# ---- what a process holds ----------------------------------------------------------------

def footprint_is_measurable() -> bool:
    """False under AddressSanitizer's allocator (`make sanitize`): it maps
    a region per size class as first used and holds freed blocks in its
    quarantine, so RSS and the mapping count grow with no leak. Descriptors,
    files, Python objects and results are still checked there."""
    preloaded = os.environ.get("LD_PRELOAD", "").replace(os.pathsep, " ").split()
    return not any("asan" in os.path.basename(path) for path in preloaded)


def settled_rss_kib() -> int:
    """VmRSS after a full collection, so that garbage awaiting the cycle
    collector does not read as growth."""
    gc.collect()
    return resident_kib()


def python_objects() -> int:
    """Objects the cycle collector tracks: a Python-level leak shows here
    long before it shows in RSS."""
    gc.collect()
    return len(gc.get_objects())


def open_fds() -> list[str]:
    """What each open descriptor points at (the listing's own one left out)."""
    targets = []
    with os.scandir("/proc/self/fd") as entries:
        for entry in entries:
            try:
                targets.append(os.readlink(entry.path))
            except OSError:        # the scandir descriptor itself, closed by now
                pass
    return sorted(targets)


def mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return f.read().splitlines()


def mapped_files_under(directory) -> list[str]:
    """Mappings of files inside directory (the disk tier's, if any leak)."""
    prefix = os.path.realpath(directory) + os.sep
    return [line for line in mappings()
            if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith(prefix)]


def children() -> set[int]:
    """Live child processes of every thread of this process."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
        except OSError:
            pass
    return pids


def socket_inodes() -> set[int]:
    inodes = set()
    for target in open_fds():
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


_TCP_LISTEN = "0A"


def listening_sockets() -> set[tuple[str, str, int]]:
    """(protocol, local address, inode) of this process's sockets that accept
    traffic from the network: TCP in LISTEN, and any bound UDP socket."""
    mine = socket_inodes()
    found = set()
    for protocol in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{protocol}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:            # no IPv6 in this kernel
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if inode in mine and (protocol.startswith("udp") or state == _TCP_LISTEN):
                found.add((protocol, local, inode))
    return found


def growth_percent(warm: int, end: int) -> float:
    return 100.0 * (end - warm) / warm


# ---- offload / reload soak ---------------------------------------------------------------

class SoakNet(torch.nn.Module):
    """About 2 MB of fp32 params, so a buffer leaked per cycle shows at once;
    BatchNorm's buffers are the module's own, which rlhfz.offload moves too."""

    def __init__(self, width=256, hidden=1024):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                        torch.nn.Linear(hidden, width))
        self.norm = torch.nn.BatchNorm1d(width)

    def forward(self, x):
        return self.norm(self.body(x))


def soak_model(device="cpu", seed=0):
    torch.manual_seed(seed)
    model = SoakNet().to(device)
    return model, rlhfz.ZeroAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def soak_step(model, opt, step, device="cpu"):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 256, generator=gen).to(device)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def device_used_bytes(device) -> int:
    """Device memory in use as the driver sees it (rlhfz's own buffers are
    not torch's, so torch.cuda.memory_allocated would miss them)."""
    from rlhfz import _C
    torch.cuda.synchronize(device)
    index = torch.device(device).index or 0
    free, total = _C.cuda_mem_get_info(index)
    return total - free


def offload_soak(steps: int, directory, device="cpu") -> dict:
    """Trains `steps` steps with rlhfz.offload/reload of params, grads,
    optimizer state and the model's own buffers after each one, alternating
    disk and host memory, beside the same training without the cycles.

    After every reload the directory must be empty and no mapping of its
    files may remain; from the end of warm-up (a tenth of the steps) on, the
    open descriptors and the number of mappings must match the warm-up's.
    Returns the measurements and every deviation seen."""
    model, opt = soak_model(device)
    plain, plain_opt = soak_model(device)
    warmup = max(1, steps // 10)
    deviations, warm, trace = [], {}, []
    start = time.perf_counter()
    for step in range(steps):
        soak_step(model, opt, step, device)
        soak_step(plain, plain_opt, step, device)
        target = dict(to="disk", path=directory) if step % 2 == 0 else dict(to="cpu")
        rlhfz.offload(model, opt, **target)
        if target["to"] == "disk" and not disk_files.held(directory):
            deviations.append((step, "nothing was written to disk"))
        rlhfz.reload(model, opt)
        left = disk_files.held(directory)
        if left:
            deviations.append((step, f"files left after reload: {left}"))
        if mapped_files_under(directory):
            deviations.append((step, "a disk-tier file is still mapped after reload"))
        if (step + 1) % max(1, steps // 20) == 0:
            trace.append((step + 1, settled_rss_kib()))
        if step + 1 == warmup:
            warm = {"rss_kib": settled_rss_kib(), "fds": open_fds(), "maps": len(mappings()),
                    "objects": python_objects()}
            if device != "cpu":
                warm["device_bytes"] = device_used_bytes(device)
        elif step + 1 > warmup:
            fds = open_fds()
            if fds != warm["fds"]:
                deviations.append((step, f"open descriptors {warm['fds']} became {fds}"))
            maps = len(mappings())
            if maps > warm["maps"] and footprint_is_measurable():
                deviations.append((step, f"{warm['maps']} mappings became {maps}"))
    seconds = time.perf_counter() - start
    end = {"rss_kib": settled_rss_kib(), "fds": open_fds(), "maps": len(mappings()),
           "objects": python_objects()}
    if device != "cpu":
        end["device_bytes"] = device_used_bytes(device)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    same = same and all(torch.equal(a, b) for a, b in zip(model.buffers(), plain.buffers()))
    same = same and all(
        torch.equal(opt.state[p][key], plain_opt.state[q][key])
        for p, q in zip(model.parameters(), plain.parameters()) for key in opt.state[p])
    return {"steps": steps, "warmup_steps": warmup, "seconds": seconds, "warm": warm,
            "end": end, "rss_trace_kib": trace, "deviations": deviations, "bitwise_same": same,
            "placement": opt.placement()}


def offload_soak_alone(steps: int, directory: str) -> dict:
    """offload_soak in a process of its own, on one intra-op thread: threads
    and arenas that earlier work in the caller's process leaves coming and
    going would move the mapping count by a few, which hides nothing but
    reads as a leak."""
    torch.set_num_threads(1)
    return offload_soak(steps, directory)


# ---- gather_for_generation soak (stage 3, every rank) --------------------------------------

class _Planted(Exception):
    """Raised inside a context on purpose."""


def _stage3_at_rest(stage3, hooks: int) -> list[str]:
    """What differs from a model sharded and idle."""
    wrong = []
    if stage3.gathered_bytes():
        wrong.append(f"{stage3.gathered_bytes()} bytes still gathered")
    if stage3.keep or stage3.suspended or stage3._pending or stage3._whole:
        wrong.append(f"keep={stage3.keep} suspended={stage3.suspended} "
                     f"pending={list(stage3._pending)} whole={stage3._whole}")
    if len(stage3.handles) != hooks:
        wrong.append(f"{hooks} hooks became {len(stage3.handles)}")
    for _, buckets in stage3.units:
        for bucket in buckets:
            if bucket.gathered is not None or any(p.numel() for p in bucket.params):
                wrong.append("a bucket's params are whole outside any context")
                return wrong
    return wrong


def gather_soak(rank, world_size, cycles: int, raise_every: int = 5, generate_every: int = 10):
    """`cycles` rounds, each entering and leaving gather_for_generation once in
    every mode (whole model, unit by unit, a byte budget of half the model)
    with a forward inside; every `generate_every`-th round generates too,
    and every `raise_every`-th raises inside the context: half of those from
    the middle of a forward (a hook of the second block), half after it.
    After every exit the model must be sharded and idle again. Memory,
    descriptors and mappings are read at the end of warm-up (a tenth of the
    rounds, and at least every kind of round) and at the end."""
    from stage3_workers import PROMPT, greedy, tiny_lm
    # one thread per rank: two ranks' intra-op pools on a few cores slow
    # gloo's hand-offs tenfold
    torch.set_num_threads(1)
    model = tiny_lm("gpt2").eval()
    opt = rlhfz.ZeroAdamW(model, stage=3, param_persistence_threshold=64)
    stage3 = opt.stage3
    hooks = len(stage3.handles)
    total = sum(stage3.unit_bytes(i) for i in range(len(stage3.units)))
    modes = {"full": dict(enabled=True), "unit": dict(enabled=False),
             "budget": dict(budget_bytes=total // 2)}
    fail_inside = {"now": False}

    def planted(module, args):
        if fail_inside["now"]:
            raise _Planted("raised in the middle of a forward")
    model.transformer.h[1].register_forward_pre_hook(planted)
    hooks_with_planted = len(stage3.handles)
    assert hooks_with_planted == hooks    # the planted hook is not rlhfz's

    tokens_before = greedy(model)
    # warm-up holds every kind of round: a generation and both exceptions
    warmup = min(cycles, max(cycles // 10, 2 * raise_every, generate_every + 1))
    problems, raised, warm, trace = [], 0, {}, []
    start = time.perf_counter()
    for cycle in range(cycles):
        for mode, options in modes.items():
            failing = raise_every and cycle % raise_every == raise_every - 1
            fail_inside["now"] = failing and cycle // raise_every % 2 == 0
            try:
                with torch.no_grad(), rlhfz.gather_for_generation(model, **options):
                    model(PROMPT)
                    if generate_every and cycle % generate_every == 0:
                        greedy(model)
                    if failing:
                        raise _Planted("raised after a forward")
            except _Planted:
                raised += 1
            finally:
                fail_inside["now"] = False
            wrong = _stage3_at_rest(stage3, hooks)
            if wrong:
                problems.append((cycle, mode, wrong))
        if (cycle + 1) % max(1, cycles // 20) == 0:
            trace.append((cycle + 1, settled_rss_kib()))
        if cycle + 1 == warmup:
            warm = {"rss_kib": settled_rss_kib(), "fds": len(open_fds()),
                    "maps": len(mappings()), "sockets": len(socket_inodes()),
                    "objects": python_objects()}
    seconds = time.perf_counter() - start
    end = {"rss_kib": settled_rss_kib(), "fds": len(open_fds()), "maps": len(mappings()),
           "sockets": len(socket_inodes()), "objects": python_objects()}
    tokens_after = greedy(model)
    return {"cycles": cycles, "warmup_cycles": warmup, "seconds": seconds, "warm": warm,
            "end": end, "rss_trace_kib": trace, "problems": problems[:10],
            "problem_count": len(problems),
            "raised": raised, "peak_bytes": stage3.peak_bytes, "model_bytes": total,
            "same_tokens": torch.equal(tokens_before, tokens_after)}


# ---- workloads of the security tests ------------------------------------------------------

def small_model(seed=0, **options):
    """A small MLP whose BatchNorm buffers are the module's own."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(),
                                torch.nn.Linear(40, 16), torch.nn.BatchNorm1d(16))
    return model, rlhfz.ZeroAdamW(model, lr=1e-2, **options)


def train(model, opt, steps, rank=0, world_size=1):
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8 * world_size, 24, generator=gen)[rank::world_size]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()


def single_process_workload(directory) -> None:
    """What one process does with rlhfz in an RLHF loop, besides generation."""
    directory = os.fspath(directory)
    model, opt = small_model()
    train(model, opt, 3)
    opt.memory_report()
    opt.placement()
    rlhfz.build_info()
    for target in (dict(to="cpu"), dict(to="disk", path=directory)):
        rlhfz.offload(model, opt, **target)
        rlhfz.reload(model, opt)
    with rlhfz.offloaded(model, opt, to="disk", path=directory):
        pass
    opt.load_state_dict(opt.state_dict())
    rlhfz.save_checkpoint(os.path.join(directory, "sharded"), model, opt, client_state={"step": 3})
    rlhfz.load_checkpoint(os.path.join(directory, "sharded"), model, opt)
    rlhfz.save_consolidated(os.path.join(directory, "consolidated"), model, opt)
    rlhfz.load_checkpoint(os.path.join(directory, "consolidated"), model, opt)
    dict(rlhfz.iter_full_params(model))
    train(model, opt, 1)


def listening_after_workload(rank, world_size, directory):
    """Listening sockets right after init_process_group, those opened inside
    torch.distributed's group creation, after the optimizer is built, and
    after a stage-3 workload: generation in every mode, offload and reload,
    checkpoints in both formats, weight export."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    at_init, before_children = listening_sockets(), children()
    opened_by_torch = set()
    new_group = dist.new_group

    def watched_new_group(*args, **kwargs):
        before = listening_sockets()
        group = new_group(*args, **kwargs)
        opened_by_torch.update(listening_sockets() - before)
        return group
    dist.new_group = watched_new_group
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
                                      for _ in range(4)])
        opt = rlhfz.ZeroAdamW(model, lr=1e-3, stage=3, param_persistence_threshold=0,
                              wrap={torch.nn.Sequential})
    finally:
        dist.new_group = new_group
    after_optimizer = listening_sockets()
    x = torch.randn(4, 32)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    total = sum(opt.stage3.unit_bytes(i) for i in range(len(opt.stage3.units)))
    with torch.no_grad():
        for options in (dict(enabled=True), dict(enabled=False), dict(budget_bytes=total // 2)):
            with rlhfz.gather_for_generation(model, **options):
                model(x)
    mine = os.path.join(directory, f"rank{rank}")
    os.makedirs(mine, exist_ok=True)
    for target in (dict(to="cpu"), dict(to="disk", path=mine)):
        rlhfz.offload(model, opt, **target)
        rlhfz.reload(model, opt)
    rlhfz.save_checkpoint(os.path.join(directory, "sharded"), model, opt)
    rlhfz.load_checkpoint(os.path.join(directory, "sharded"), model, opt)
    rlhfz.save_consolidated(os.path.join(directory, "consolidated"), model, opt)
    rlhfz.load_checkpoint(os.path.join(directory, "consolidated"), model, opt)
    exported = dict(rlhfz.iter_full_params(model))
    return {"at_init": at_init, "opened_by_torch": opened_by_torch,
            "after_optimizer": after_optimizer, "at_end": listening_sockets(),
            "new_children": sorted(children() - before_children),
            "worked": len(exported) == 8 and not disk_files.held(mine)}
