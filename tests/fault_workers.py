"""One rank of a fault-injection run (see test_faults.py), run as a script:

    RANK=r WORLD_SIZE=n python fault_workers.py '<json config>'

or forked, one process per rank, by `python fault_workers.py --serve`, a
server that has imported torch once (see serve()): the test starts dozens
of ranks, and each would spend seconds importing torch on a small machine.

Each rank trains the same small model with ZeroAdamW on gloo, saving a
checkpoint every SAVE_EVERY steps. On the faulty rank, at the chosen step
and point, the fault fires: the rank raises, SIGKILLs itself, or raises,
catches it and stays alive elsewhere (asleep, or in a collective of the
default group that no other rank enters). Before it fires, it writes the
wall-clock time to `fault.json`, so the test can time the others' exits.

Points, each reached on purpose after part of the work is in flight:
- "step": inside opt.step(), at the second AdamW kernel call (the first
  bucket's all-gather is already issued);
- "reduce_scatter": when backward launches its second bucket's
  reduce-scatter (the first is in flight);
- "gather": inside gather_for_generation, at the second unit gather;
- "save": inside save_checkpoint, after the rank file's first tensor is on disk.

With "resume", the rank loads the last complete checkpoint, trains to the
end, and, with "reference", also trains a fresh model uninterrupted in the
same world, saving both final states for the test to compare bitwise.
"""
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rlhfz
from rlhfz.checkpoint import format as tensorfile

STEPS = 6
SAVE_EVERY = 2
GLOBAL_BATCH = 24          # divides evenly by 2, 3 and 4 ranks
LINGER_S = 600             # the test kills a lingering rank long before this


class Net(torch.nn.Module):
    """Odd sizes, so shard boundaries fall inside params; the blocks become
    stage 3 units, the embedding and head the root unit."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(37, 61)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(61, 61), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(61, 7)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(stage):
    torch.manual_seed(0)
    model = Net()
    opt = rlhfz.ZeroAdamW(model, lr=1e-2, weight_decay=0.01, stage=stage,
                          param_persistence_threshold=0)
    return model, opt


def batch(step, rank, world_size):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 37, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 7, generator=gen)
    per_rank = GLOBAL_BATCH // world_size
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def note(directory, name, value):
    """Writes a small JSON file whole (the test may read it at any moment)."""
    with open(os.path.join(directory, name + ".tmp"), "w") as f:
        json.dump(value, f)
    os.replace(os.path.join(directory, name + ".tmp"), os.path.join(directory, name))


class InjectedFault(RuntimeError):
    pass


class Injector:
    """Wraps the chosen point on the faulty rank; fires at its second call
    within the armed step (and, for "gather", the generation context)."""

    def __init__(self, fault, rank, opt, out):
        self.fault = fault if fault and fault["rank"] == rank else None
        self.out = out
        self.step = 0
        self.generating = False
        self.calls = 0
        if self.fault is None:
            return
        point = self.fault["point"]
        if point == "step":
            self._wrap(opt.backend, "adamw_step")
        elif point == "reduce_scatter":
            self._wrap(opt.comm, "reduce_scatter")
        elif point == "gather":
            self._wrap(opt.stage3, "gather", when=lambda: self.generating)
        elif point == "save":
            write = tensorfile.TensorFileWriter.write
            injector = self

            def faulty_write(writer, *args, **kwargs):
                injector._maybe_fire()
                return write(writer, *args, **kwargs)
            tensorfile.TensorFileWriter.write = faulty_write
        else:
            raise ValueError(f"unknown fault point {point!r}")

    def _wrap(self, owner, name, when=lambda: True):
        original = getattr(owner, name)

        def faulty(*args, **kwargs):
            if when():
                self._maybe_fire()
            return original(*args, **kwargs)
        setattr(owner, name, faulty)

    def _maybe_fire(self):
        if self.step != self.fault["step"]:
            return
        self.calls += 1
        if self.calls == 2:
            self._fire()

    def _fire(self):
        where = f"{self.fault['point']} of step {self.step}"
        note(self.out, "fault.json", {"time": time.time(), "where": where})
        if self.fault["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected fault in {where}")


def generate(model, mode, injector):
    injector.generating = True
    try:
        with rlhfz.gather_for_generation(model, enabled=mode == "full"), torch.no_grad():
            model(torch.ones(2, 37))
    finally:
        injector.generating = False


def train(model, opt, start, rank, world_size, cfg, injector, checkpoint):
    for step in range(start + 1, STEPS + 1):
        injector.step = step
        if cfg.get("gen"):
            generate(model, cfg["gen"], injector)
        x, y = batch(step, rank, world_size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        if checkpoint is not None and step % SAVE_EVERY == 0:
            rlhfz.save_checkpoint(checkpoint, model, opt, client_state={"step": step})


def final_state(model, opt) -> dict:
    """Whole params and the torch-format optimizer state (a collective)."""
    params = {name: t.clone() for name, t in rlhfz.iter_full_params(model)}
    state = opt.state_dict()["state"]
    out = {f"param.{name}": t for name, t in params.items()}
    for index, entry in state.items():
        for key, value in entry.items():
            out[f"state.{index}.{key}"] = value.clone()
    return out


def linger(how):
    """A rank that caught its error and went elsewhere."""
    if how == "barrier":
        dist.barrier()              # the default group: no other rank comes
    time.sleep(LINGER_S)


def main(cfg):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)        # every run does its matmuls the same way
    rlhfz.set_num_threads(1)        # a tiny model: threads would only contend
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=cfg["pg_timeout"]))
    model, opt = make(cfg["stage"])
    out = cfg["out"]
    start = 0
    if cfg.get("resume"):
        start = rlhfz.load_checkpoint(cfg["checkpoint"], model, opt)["step"]
    injector = Injector(cfg.get("fault"), rank, opt, out)
    try:
        train(model, opt, start, rank, world_size, cfg, injector, cfg["checkpoint"])
    except InjectedFault:
        if injector.fault is None or injector.fault["how"] == "raise":
            raise
        linger(injector.fault["how"])
    result = {"start": start, "state": final_state(model, opt)}
    if cfg.get("reference"):
        model, opt = make(cfg["stage"])
        train(model, opt, 0, rank, world_size, cfg, Injector(None, rank, opt, out), None)
        result["reference"] = final_state(model, opt)
    if rank == 0:
        torch.save(result, os.path.join(out, "result.pt"))
    dist.destroy_process_group()


def run_rank(config) -> None:
    """main(), noting when it raised (beside when the process exits)."""
    try:
        main(config)
    except BaseException as error:
        note(config["out"], f"error-{os.environ['RANK']}.json",
             {"time": time.time(), "error": f"{type(error).__name__}: {error}"})
        raise


# ---- a fork server: ranks start in a moment instead of importing torch ------------------------

def _reply(message) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _child(request) -> None:
    """In the forked rank: own log, own environment, then the rank's run.
    Its exit is a normal interpreter exit, an uncaught error's included."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG: dies with the server
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.update(request["env"])
    try:
        run_rank(request["config"])
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)
    sys.exit(0)


def serve() -> None:
    """Reads spawn requests (JSON lines) on stdin; answers {"pid"} for each
    and {"exited", "code", "time"} when a rank ends (code as Popen's
    returncode: -9 for SIGKILL). torch and rlhfz are imported once, here.
    End of input ends the server and, with it, every rank still running."""
    import select
    import torch._dynamo  # noqa: F401  (torch.optim imports it on first use)
    import rlhfz.checkpoint  # noqa: F401
    import rlhfz.generation  # noqa: F401
    import rlhfz.optim  # noqa: F401
    children, pending = set(), b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.01)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line))
                children.add(pid)
                _reply({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status),
                    "time": time.time()})
    for pid in children:
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        run_rank(json.loads(sys.argv[1]))
