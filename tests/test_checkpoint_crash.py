"""Checkpoints against a process that dies: SIGKILL, not exceptions.

A training run killed between checkpoints and resumed from the last one ends
bitwise where an uninterrupted run ends. A save killed at any moment leaves a
loadable checkpoint: the previous one until index.json is replaced, the new
one after, and whatever the dead save left behind (a .tmp- directory, a
generation no index names, a staged index) is ignored by load and removed by
the next save. Loading copies into the optimizer's own memory, so its peak
RSS stays close to the steady state, where torch.load + load_state_dict
holds a second copy of the state.

The processes that get killed run this file as a script (see _child_main):
a test cannot SIGKILL itself and go on checking.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import rlhfz
from state_snapshots import assert_same, peak_kib_during, snapshot, status_kib

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS = 12
SAVE_EVERY = 3
KILL_AFTER_STEP = 7
CHILD_TIMEOUT = 90       # seconds any child may take, far above what it needs
LARGE = [24 << 20, 16 << 20]     # 40M fp32 params: a save long enough to land a kill in
RSS_NUMEL = 64 << 20
RSS_BOUND = 1.3


# ---- models whose every value is known ------------------------------------------------------

class Net(torch.nn.Module):
    """Trained on data from the step number alone; BatchNorm adds buffers the
    optimizer does not own, so the checkpoint's module entries are exercised."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                                        torch.nn.Linear(256, 256), torch.nn.GELU(),
                                        torch.nn.Linear(256, 8))
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.body(x))


def make_net():
    torch.manual_seed(0)
    model = Net()
    return model, rlhfz.ZeroAdamW(model, lr=1e-2, weight_decay=0.01)


def train_step(model, opt, step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=gen)
    target = torch.randn(64, 8, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), target).backward()
    opt.step()


class Flat(torch.nn.Module):
    """Params with closed-form values and grads: building one and stepping it
    is elementwise work only, so a test process can recompute a large state
    bitwise without a matmul whose result might depend on the thread count."""

    def __init__(self, sizes):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.linspace(-1.0, 1.0, n) * (i + 1))
            for i, n in enumerate(sizes))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))


def make_flat(sizes):
    model = Flat(sizes)
    return model, rlhfz.ZeroAdamW(model, lr=1e-2, weight_decay=0.01)


def advance(model, opt, k):
    """The k-th update: grads from the current params, so each state is new."""
    for p in model.weights:
        p.grad = torch.sin(p.detach() * (k + 3.0))
    opt.step()
    model.updates += 1


def flat_state(sizes, updates):
    model, opt = make_flat(sizes)
    for k in range(updates):
        advance(model, opt, k)
    return model, opt


def held(model, opt) -> dict:
    """What a checkpoint holds: params, buffers and optimizer state (grads are
    not saved)."""
    return {k: v for k, v in snapshot(model, opt).items() if not k.endswith(".grad")}


# ---- running and killing children ---------------------------------------------------------

@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="rlhfz-crash-")
    children = []
    yield path, children
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()
    shutil.rmtree(path, ignore_errors=True)


def spawn(workdir, **args):
    path, children = workdir
    env = dict(os.environ, RLHFZ_PROGRESS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), ROOT])))
    log = os.path.join(path, f"child-{len(children)}.log")
    with open(log, "wb") as out:
        child = subprocess.Popen([sys.executable, HERE, json.dumps(args)], env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
    child.log = log
    children.append(child)
    return child


def _output(child) -> str:
    with open(child.log, errors="replace") as f:
        return f.read()[-4000:]


def finish(child):
    try:
        child.wait(CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail(f"child did not finish in {CHILD_TIMEOUT} s:\n{_output(child)}")
    assert child.returncode == 0, _output(child)


def kill_when(child, condition, what: str) -> None:
    """SIGKILLs the child as soon as condition() holds (polled every ~1 ms)."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not condition():
        if child.poll() is not None:
            pytest.fail(f"child exited ({child.returncode}) before {what}:\n{_output(child)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no sign of {what} in {CHILD_TIMEOUT} s:\n{_output(child)}")
        time.sleep(0.001)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(CHILD_TIMEOUT)
    assert child.returncode == -signal.SIGKILL, _output(child)


def current_index(path) -> dict:
    with open(os.path.join(path, "index.json")) as f:
        return json.load(f)


# ---- a. killed mid-training, resumed -------------------------------------------------------

def test_run_killed_mid_training_resumes_to_the_same_bits(workdir):
    path, _ = workdir
    # the uninterrupted run and the one to be killed side by side, for time
    reference = spawn(workdir, mode="train", checkpoint=os.path.join(path, "ref"),
                      out=os.path.join(path, "ref.pt"))
    checkpoint = os.path.join(path, "ckpt")
    marker = os.path.join(path, "step7")
    victim = spawn(workdir, mode="train", checkpoint=checkpoint, out=os.path.join(path, "x.pt"),
                   marker=marker)
    kill_when(victim, lambda: os.path.exists(marker), f"step {KILL_AFTER_STEP}")
    finish(reference)
    assert not os.path.exists(os.path.join(path, "x.pt"))
    assert current_index(checkpoint)["client_state"] == {"step": 6}

    resumed = spawn(workdir, mode="train", checkpoint=checkpoint, resume=True,
                    out=os.path.join(path, "resumed.pt"))
    finish(resumed)
    want = torch.load(os.path.join(path, "ref.pt"), weights_only=True)
    got = torch.load(os.path.join(path, "resumed.pt"), weights_only=True)
    assert (want["start"], got["start"]) == (0, 6)
    assert want["state"].keys() == got["state"].keys()
    assert any(key.endswith("exp_avg_sq") for key in got["state"])
    assert_same(want["state"], got["state"])


# ---- b. killed mid-save ---------------------------------------------------------------------

def _expect_loadable(path, sizes, updates, client_state):
    """Loads path into a fresh optimizer: it must hold exactly the state
    after `updates` updates. Returns the loaded model and optimizer."""
    model, opt = make_flat(sizes)          # fresh: no optimizer state yet
    assert rlhfz.load_checkpoint(path, model, opt) == client_state
    want_model, want_opt = flat_state(sizes, updates)
    assert_same(held(want_model, want_opt), held(model, opt))
    return model, opt


def _next_save_cleans_up(path, model, opt, reload=True):
    advance(model, opt, 7)
    rlhfz.save_checkpoint(path, model, opt, client_state={"save": 3})
    generation = current_index(path)["generation"]
    assert sorted(os.listdir(path)) == [generation, "index.json"]
    if not reload:
        return
    fresh, fresh_opt = make_flat([p.numel() for p in model.weights])
    assert rlhfz.load_checkpoint(path, fresh, fresh_opt) == {"save": 3}
    assert_same(held(model, opt), held(fresh, fresh_opt))


def test_kill_while_writing_a_large_save_keeps_the_previous_one(workdir):
    path, _ = workdir
    checkpoint = os.path.join(path, "ckpt")
    first = os.path.join(path, "first-saved")
    child = spawn(workdir, mode="save_twice", checkpoint=checkpoint, sizes=LARGE, marker=first)

    def second_save_is_writing():
        if not os.path.exists(first):
            return False
        files = glob.glob(os.path.join(checkpoint, ".tmp-*", "rank-*.safetensors"))
        try:
            return any(os.path.getsize(f) >= 16 << 20 for f in files)
        except FileNotFoundError:        # renamed between glob and stat
            return False
    kill_when(child, second_save_is_writing, "the second save writing its file")

    # the kill landed inside the write: its directory is still .tmp-, and unfinished
    leftovers = glob.glob(os.path.join(checkpoint, ".tmp-*"))
    assert len(leftovers) == 1
    index = current_index(checkpoint)
    assert index["client_state"] == {"save": 1}
    written = os.path.getsize(glob.glob(os.path.join(leftovers[0], "rank-*"))[0])
    assert written < index["files"][0]["bytes"]

    model, opt = _expect_loadable(checkpoint, LARGE, 1, {"save": 1})
    _next_save_cleans_up(checkpoint, model, opt, reload=False)    # the small tests reload


SMALL = [3000, 517, 64]
# Where the child stops (and is killed) inside its second save, and how many
# updates the checkpoint left on disk must then hold.
MOMENTS = {
    "writing": 1,     # mid-file, in .tmp-<token>
    "renamed": 1,     # g-<token> complete, index.json not yet replaced
    "replaced": 2,    # index.json names the new generation, the old one not yet deleted
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_kill_at_each_moment_of_a_save_leaves_a_loadable_checkpoint(workdir, moment):
    path, _ = workdir
    checkpoint = os.path.join(path, "ckpt")
    stopped = os.path.join(path, "stopped")
    child = spawn(workdir, mode="save_twice", checkpoint=checkpoint, sizes=SMALL,
                  marker=os.path.join(path, "first-saved"), stop_at=moment, stopped=stopped)
    kill_when(child, lambda: os.path.exists(stopped), f"the save reaching {moment!r}")

    entries = os.listdir(checkpoint)
    generations = sorted(e for e in entries if e.startswith("g-"))
    current = current_index(checkpoint)["generation"]
    if moment == "writing":
        assert generations == [current]
        assert any(e.startswith(".tmp-") for e in entries)
    else:
        # two complete generations, one of them named by no index
        assert len(generations) == 2 and current in generations
        stale = next(g for g in generations if g != current)
        assert os.listdir(os.path.join(checkpoint, stale))
    if moment == "renamed":
        assert any(e.startswith(".index-") for e in entries)     # the staged, unused index

    updates = MOMENTS[moment]
    model, opt = _expect_loadable(checkpoint, SMALL, updates, {"save": updates})
    _next_save_cleans_up(checkpoint, model, opt)


def test_a_generation_no_index_names_is_ignored_and_removed(workdir):
    """A stale g-<token> put there by hand, holding other values, with a
    name that sorts before and after the current one."""
    path, _ = workdir
    checkpoint = os.path.join(path, "ckpt")
    model, opt = flat_state(SMALL, 1)
    rlhfz.save_checkpoint(checkpoint, model, opt, client_state={"save": 1})
    current = current_index(checkpoint)["generation"]
    other, other_opt = flat_state(SMALL, 2)
    elsewhere = os.path.join(path, "elsewhere")
    rlhfz.save_checkpoint(elsewhere, other, other_opt, client_state={"save": 2})
    for stale in ("g-0000000000000000", "g-ffffffffffffffff"):
        shutil.copytree(os.path.join(elsewhere, current_index(elsewhere)["generation"]),
                        os.path.join(checkpoint, stale))
    assert current not in ("g-0000000000000000", "g-ffffffffffffffff")

    loaded, loaded_opt = _expect_loadable(checkpoint, SMALL, 1, {"save": 1})
    _next_save_cleans_up(checkpoint, loaded, loaded_opt)


# ---- c. load's peak memory ------------------------------------------------------------------

def test_load_peak_rss_stays_near_the_steady_state(workdir):
    path, _ = workdir
    # side by side, for time: each child's peak is its own
    children = {loader: spawn(workdir, mode="rss", loader=loader, numel=RSS_NUMEL,
                              checkpoint=os.path.join(path, loader),
                              out=os.path.join(path, f"{loader}.json"))
                for loader in ("rlhfz", "torch")}
    results = {}
    for loader, child in children.items():
        finish(child)
        with open(os.path.join(path, f"{loader}.json")) as f:
            results[loader] = json.load(f)
        shutil.rmtree(os.path.join(path, loader))
    for loader, r in results.items():
        print(f"{loader}: steady {r['steady_kib'] >> 10} MiB, peak during load "
              f"{r['peak_kib'] >> 10} MiB ({r['peak_kib'] / r['steady_kib']:.2f}x, "
              f"{r['how']}), load {r['seconds']:.2f} s")
    mine, theirs = results["rlhfz"], results["torch"]
    assert mine["peak_kib"] <= RSS_BOUND * mine["steady_kib"], mine
    # the bound means something: a load that holds a second copy of the
    # optimizer state (both moments) breaks it
    assert theirs["peak_kib"] - theirs["steady_kib"] >= 0.9 * 2 * RSS_NUMEL * 4 / 1024, theirs
    assert theirs["peak_kib"] > RSS_BOUND * theirs["steady_kib"], theirs


# ---- what the children run ------------------------------------------------------------------

def _touch(path):
    with open(path, "w"):
        pass


def _train(checkpoint, out, marker=None, resume=False):
    torch.set_num_threads(1)      # every run does its matmuls the same way
    model, opt = make_net()
    start = 0
    if resume:
        start = rlhfz.load_checkpoint(checkpoint, model, opt)["step"]
    for step in range(start, STEPS):
        train_step(model, opt, step)
        done = step + 1
        if done % SAVE_EVERY == 0:
            rlhfz.save_checkpoint(checkpoint, model, opt, client_state={"step": done})
        if marker is not None and done == KILL_AFTER_STEP:
            _touch(marker)
            time.sleep(CHILD_TIMEOUT)      # the parent kills it here
    torch.save({"start": start, "state": snapshot(model, opt)}, out)


def _stop_second_save_at(moment, stopped):
    """Makes the child's next save stall at `moment` (and say so), for the
    parent to kill it there. Returns the switch that arms it."""
    import rlhfz.checkpoint.format as tensorfile
    armed = [False]

    def stop():
        if armed[0]:
            _touch(stopped)
            time.sleep(CHILD_TIMEOUT)

    if moment == "writing":
        write = tensorfile.TensorFileWriter.write

        def stalling_write(self, name, *parts, **kw):
            write(self, name, *parts, **kw)
            stop()
        tensorfile.TensorFileWriter.write = stalling_write
    elif moment == "renamed":
        replace = os.replace

        def stalling_replace(src, dst, *a, **kw):
            if os.path.basename(dst) == "index.json":
                stop()
            return replace(src, dst, *a, **kw)
        os.replace = stalling_replace
    elif moment == "replaced":
        rmtree = shutil.rmtree

        def stalling_rmtree(path, *a, **kw):
            stop()
            return rmtree(path, *a, **kw)
        shutil.rmtree = stalling_rmtree
    return lambda: armed.__setitem__(0, True)


def _save_twice(checkpoint, sizes, marker, stop_at=None, stopped=None):
    arm = _stop_second_save_at(stop_at, stopped) if stop_at else (lambda: None)
    model, opt = flat_state(sizes, 1)
    rlhfz.save_checkpoint(checkpoint, model, opt, client_state={"save": 1})
    _touch(marker)
    advance(model, opt, 1)
    arm()
    rlhfz.save_checkpoint(checkpoint, model, opt, client_state={"save": 2})
    time.sleep(CHILD_TIMEOUT)     # not reached in time: the parent kills it during the save


def _rss(loader, numel, checkpoint, out):
    import gc
    model, opt = flat_state([numel], 1)     # grads and both moments exist
    param = model.weights[0]
    state = opt.state[param]
    digest = [float(t.double().sum()) for t in (param, state["exp_avg"], state["exp_avg_sq"])]
    if loader == "rlhfz":
        rlhfz.save_checkpoint(checkpoint, model, opt)
    else:
        rlhfz.save_consolidated(checkpoint, model, opt)
    with torch.no_grad():                   # so that the load has something to restore
        for t in (param, state["exp_avg"], state["exp_avg_sq"]):
            t.zero_()
    gc.collect()
    steady = status_kib("VmRSS:")

    def load():
        if loader == "rlhfz":
            rlhfz.load_checkpoint(checkpoint, model, opt)
        else:
            loaded = torch.load(os.path.join(checkpoint, "optimizer.pt"), map_location="cpu",
                                weights_only=True)
            opt.load_state_dict(loaded)
    start = time.perf_counter()
    peak, how = peak_kib_during(load)
    seconds = time.perf_counter() - start
    state = opt.state[param]
    if loader == "rlhfz":
        restored = [float(t.double().sum()) for t in (param, state["exp_avg"], state["exp_avg_sq"])]
    else:   # only the optimizer's file was read
        restored = [digest[0]] + [float(state[k].double().sum()) for k in ("exp_avg", "exp_avg_sq")]
    assert restored == digest, (restored, digest)
    with open(out, "w") as f:
        json.dump({"steady_kib": steady, "peak_kib": peak, "how": how, "seconds": seconds}, f)


def _child_main(args):
    mode = args.pop("mode")
    {"train": _train, "save_twice": _save_twice, "rss": _rss}[mode](**args)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
