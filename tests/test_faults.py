"""Fault injection in distributed runs (gloo, 2 to 4 ranks).

One rank raises, is SIGKILLed, or raises, catches it and stays alive
elsewhere: mid-step, mid-reduce-scatter, mid-gather-for-generation (full and
unit by unit) and mid-save. Every other rank must exit non-zero with an
rlhfz error that names the collective, within RLHFZ_COLLECTIVE_TIMEOUT (plus
a margin), never hang; and the last complete checkpoint must still load and,
resumed in a fresh world, end bitwise where an uninterrupted run ends.

The default group's timeout is far longer than rlhfz's, so only rlhfz's own
timeout can end a stall. Each rank is its own process, so one can die and
the test can watch the others' exit codes, stderr and exit times; the ranks
are forked by `fault_workers.py --serve`, which imports torch once, rather
than each importing it (seconds apiece, dozens of ranks, two cores).

    python -m pytest -q -s tests/test_faults.py    # -s prints each scenario's exit times
"""
import glob
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch

import rlhfz
import fault_workers
from state_snapshots import assert_same

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "fault_workers.py")
TIMEOUT_S = 10           # RLHFZ_COLLECTIVE_TIMEOUT of every run
PG_TIMEOUT_S = 300       # the default group's
RAISE_MARGIN_S = 3       # a survivor raises within TIMEOUT_S + this after the fault
EXIT_MARGIN_S = 10       # and has exited within TIMEOUT_S + this (teardown, 2 loaded cores)
DEADLINE_S = 150         # any world still running then is killed, and the test fails
BUCKET_BYTES = 8192      # several stage 2 buckets, so a step has reduce-scatters in flight


@dataclass
class Scenario:
    point: str            # step | reduce_scatter | gather | save
    how: str              # raise | kill | sleep | barrier (the last two: caught, stays alive)
    world: int
    stage: int
    rank: int             # the faulty one
    gen: str | None = None    # full | unit: gather_for_generation before every step
    resume: bool = False      # then resume in a fresh world and compare bitwise

    @property
    def step(self):
        # saves follow steps 2, 4, 6: a save fault hits the one after step 4
        return 4 if self.point == "save" else 5

    @property
    def saved(self):
        """The step of the last complete checkpoint."""
        return 2 if self.point == "save" else 4

    @property
    def id(self):
        gen = f"-{self.gen}" if self.gen else ""
        return f"{self.point}{gen}-{self.how}-w{self.world}s{self.stage}r{self.rank}"


# World sizes 2, 3 and 4, stages 2 and 3, rank 0 and others, each point
# raised and killed; rank 0 holds nothing special here (a file store), but
# it is the rank that commits a checkpoint.
SCENARIOS = [
    Scenario("step", "raise", 2, 2, 1, resume=True),
    Scenario("step", "kill", 3, 3, 0, resume=True),
    Scenario("reduce_scatter", "raise", 4, 3, 2),
    Scenario("reduce_scatter", "kill", 2, 2, 0, resume=True),
    Scenario("gather", "kill", 3, 3, 1, gen="full"),
    Scenario("gather", "raise", 4, 3, 3, gen="full"),
    Scenario("gather", "raise", 2, 3, 0, gen="unit"),
    Scenario("gather", "kill", 4, 3, 2, gen="unit", resume=True),
    Scenario("save", "raise", 3, 2, 2, resume=True),
    Scenario("save", "kill", 4, 3, 0, resume=True),
    # caught, and alive elsewhere: only rlhfz's timeout can end the others' wait
    Scenario("reduce_scatter", "sleep", 2, 2, 1),
    Scenario("step", "sleep", 4, 2, 3),
    Scenario("gather", "barrier", 3, 3, 0, gen="unit"),
]

# What a survivor's error may name, by where the fault hit. Mid-step under
# stage 3 (no all-gather after the step) the survivors stall in the next
# forward's unit gather; mid-reduce-scatter under stage 3 possibly in
# backward's re-gather of a unit.
NAMES = {"step": ("all_gather",), "reduce_scatter": ("reduce_scatter", "all_gather"),
         "gather": ("all_gather",), "save": ("save_checkpoint", "failed to write its shard")}
RLHFZ_ERROR = re.compile(r"^(?:\[rank\d+\]: )?(rlhfz\.(?:comm\.CollectiveError|comm\."
                         r"CollectiveMismatchError|checkpoint\.CheckpointError): .*)$", re.M)


# ---- running a world of rank processes ---------------------------------------------------------

class Server:
    """fault_workers.py --serve: forks rank processes, reports their exits."""

    def __init__(self):
        env = dict(os.environ, RLHFZ_PROGRESS="0", RLHFZ_BUCKET_BYTES=str(BUCKET_BYTES),
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, WORKER, "--serve"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.exits = {}                   # pid -> (returncode, wall-clock time)
        self._pids = []
        self._pending = b""

    def spawn(self, env, config, log) -> int:
        request = {"env": env, "config": config, "log": log}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        end = time.monotonic() + 60
        while not self._pids:
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError("the rank server does not answer")
            self.poll(0.1)
        return self._pids.pop(0)

    def poll(self, wait_s=0.0) -> None:
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], wait_s)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                return
            self._pending += data
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = json.loads(line)
                if "pid" in message:
                    self._pids.append(message["pid"])
                else:
                    self.exits[message["exited"]] = (message["code"], message["time"])
            wait_s = 0.0

    def kill(self, pid) -> None:
        self.poll()
        if pid not in self.exits:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.proc.stdin.close()            # the server kills what is left, and exits
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server():
    started = Server()
    yield started
    started.close()


class World:
    """One process per rank, each with its own log; times every exit."""

    def __init__(self, server, directory, world, config):
        self.server, self.directory, self.world = server, directory, world
        os.makedirs(directory, exist_ok=True)
        config = dict(config, store=os.path.join(directory, "store"), out=directory,
                      pg_timeout=PG_TIMEOUT_S)
        self.logs = [os.path.join(directory, f"rank{rank}.log") for rank in range(world)]
        self.pids = [server.spawn({"RANK": str(rank), "WORLD_SIZE": str(world),
                                   "RLHFZ_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)}, config, log)
                     for rank, log in enumerate(self.logs)]

    def code(self, rank):
        return self.server.exits.get(self.pids[rank], (None, None))[0]

    def exit_time(self, rank):
        return self.server.exits.get(self.pids[rank], (None, None))[1]

    def wait(self, ranks=None, deadline_s=DEADLINE_S) -> bool:
        """Until `ranks` (default: all) have exited; False at the deadline."""
        ranks = range(self.world) if ranks is None else ranks
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            self.server.poll(0.05)
            if all(self.code(r) is not None for r in ranks):
                return True
        return False

    def kill(self) -> None:
        for pid in self.pids:
            self.server.kill(pid)

    def log(self, rank) -> str:
        with open(self.logs[rank], errors="replace") as f:
            return f.read()

    def logs_tail(self) -> str:
        return "\n".join(f"--- rank {r} (exit {self.code(r)}) ---\n{self.log(r)[-3000:]}"
                         for r in range(self.world))

    def read(self, name):
        path = os.path.join(self.directory, name)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)


@pytest.fixture
def workdir(server):
    path = tempfile.mkdtemp(prefix="rlhfz-faults-")
    worlds = []
    yield path, worlds, server
    for world in worlds:
        world.kill()
    shutil.rmtree(path, ignore_errors=True)


def current_index(checkpoint) -> dict:
    with open(os.path.join(checkpoint, "index.json")) as f:
        return json.load(f)


# ---- the faults -----------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_survivors_fail_fast_and_the_last_checkpoint_resumes(workdir, scenario):
    path, worlds, server = workdir
    checkpoint = os.path.join(path, "ckpt")
    fault = {"rank": scenario.rank, "step": scenario.step, "point": scenario.point,
             "how": scenario.how}
    world = World(server, os.path.join(path, "faulty"), scenario.world,
                  {"stage": scenario.stage, "gen": scenario.gen, "checkpoint": checkpoint,
                   "fault": fault})
    worlds.append(world)
    survivors = [r for r in range(scenario.world) if r != scenario.rank]
    lingers = scenario.how in ("sleep", "barrier")
    finished = world.wait(survivors if lingers else None)
    world.kill()                       # the lingering rank, if it is still there
    assert finished, f"ranks still running after {DEADLINE_S} s:\n{world.logs_tail()}"
    fired = world.read("fault.json")
    assert fired is not None, f"the fault never fired:\n{world.logs_tail()}"

    # the faulty rank did what it was told
    code = world.code(scenario.rank)
    if scenario.how == "kill":
        assert code == -signal.SIGKILL, world.logs_tail()
    elif scenario.how == "raise":
        assert code == 1 and "InjectedFault: injected fault" in world.log(scenario.rank), \
            world.logs_tail()

    # every survivor: a clear rlhfz error, in time, and a plain non-zero exit (no abort)
    times = []
    for r in survivors:
        log = world.log(r)
        # its own log's end alone: what an abort printed comes last
        assert world.code(r) == 1, f"rank {r} (exit {world.code(r)}):\n{log[-2500:]}"
        errors = RLHFZ_ERROR.findall(log)
        assert errors, f"rank {r} exited without an rlhfz error:\n{log[-3000:]}"
        assert any(name in errors[-1] for name in NAMES[scenario.point]), errors[-1]
        if lingers:
            assert f"within {TIMEOUT_S} s (RLHFZ_COLLECTIVE_TIMEOUT)" in errors[-1], errors[-1]
        # (after a kill a survivor may time out too: its transfer with another
        # survivor stalls while that one is failing, until rlhfz's timeout)
        if scenario.how != "raise" or scenario.point != "save":
            assert f"rank {r}" in errors[-1], errors[-1]
        raised = world.read(f"error-{r}.json")["time"] - fired["time"]
        exited = world.exit_time(r) - fired["time"]
        times.append((raised, exited))
        assert raised <= TIMEOUT_S + RAISE_MARGIN_S, (r, raised, errors[-1])
        assert exited <= TIMEOUT_S + EXIT_MARGIN_S, (r, exited, errors[-1])
    if lingers:
        # it was still there when they gave up (in the barrier, it fails once they exit)
        gone = world.exit_time(scenario.rank)
        assert gone is None or gone - fired["time"] >= max(a for a, _ in times), \
            world.logs_tail()
    print(f"{scenario.id}: survivors raised / exited after the fault: "
          + ", ".join(f"{a:.1f}/{b:.1f} s" for a, b in times))

    # the last complete checkpoint is the one the index names
    index = current_index(checkpoint)
    assert index["client_state"] == {"step": scenario.saved}
    assert os.path.isdir(os.path.join(checkpoint, index["generation"]))
    # a killed save leaves its partial generation (load ignores it, the next
    # save removes it); a save that raised cleaned up after itself
    partial = glob.glob(os.path.join(checkpoint, ".tmp-*", "rank-*"))
    assert bool(partial) == (scenario.point == "save" and scenario.how == "kill"), partial
    if not scenario.resume:
        # it loads (any world size loads any other: here, one process)
        with torch.random.fork_rng():
            model, opt = fault_workers.make(2)
        assert rlhfz.load_checkpoint(checkpoint, model, opt) == {"step": scenario.saved}
        return

    resumed = World(server, os.path.join(path, "resumed"), scenario.world,
                    {"stage": scenario.stage, "gen": scenario.gen, "checkpoint": checkpoint,
                     "resume": True, "reference": True})
    worlds.append(resumed)
    finished = resumed.wait()
    assert finished and all(resumed.code(r) == 0 for r in range(scenario.world)), \
        resumed.logs_tail()
    result = torch.load(os.path.join(resumed.directory, "result.pt"), weights_only=True)
    assert result["start"] == scenario.saved
    assert any(key.endswith("exp_avg_sq") for key in result["state"])
    assert_same(result["reference"], result["state"])
    # the saves after the resume removed what the fault left (a partial generation)
    index = current_index(checkpoint)
    assert index["client_state"] == {"step": fault_workers.STEPS}
    assert sorted(os.listdir(checkpoint)) == sorted([index["generation"], "index.json"])
