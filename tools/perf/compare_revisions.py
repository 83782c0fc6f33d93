"""Times two revisions of rlhfz on the same workloads, rounds interleaved.

    python3 tools/perf/compare_revisions.py OLD_REV [NEW_REV] [--rounds N] [--iterations N]

NEW_REV defaults to the working tree. Each revision is exported to a
directory of its own and built there for the CPU (RLHFZ_CUDA=0, the same
build for both). Then, round after round, every workload of
benchmarks/revision_workloads.py runs once per revision, alternating which
goes first, so that a machine whose speed drifts (other load, thermal)
drifts for both alike. Prints per workload the median per-iteration time
of each and new/old speed, and exits non-zero if a workload of the new one
runs at under --floor (default 0.95) times the old one's speed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = ("cpu_step", "stage1_iteration", "stage2_iteration", "stage3_iteration",
             "generation", "offload_reload")


def export(rev: str | None, into: str) -> str:
    """A copy of the tree at rev (None: the working tree, tracked and new files)."""
    os.makedirs(into)
    if rev is None:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=ROOT, check=True,
                                capture_output=True).stdout.decode().split("\0")
        for name in filter(None, listed):
            source = os.path.join(ROOT, name)
            if os.path.isfile(source):
                target = os.path.join(into, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(source, target)
    else:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def build(tree: str) -> None:
    env = dict(os.environ, RLHFZ_CUDA="0")
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                   env=env, check=True, stdout=subprocess.DEVNULL)


def run(tree: str, workload: str, iterations: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", RLHFZ_PROGRESS="0")
    script = os.path.join(ROOT, "benchmarks", "revision_workloads.py")
    done = subprocess.run([sys.executable, script, workload, str(iterations)], cwd=tree,
                          env=env, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["seconds"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--floor", type=float, default=0.95)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    scratch = tempfile.mkdtemp(prefix="rlhfz-revisions-")
    try:
        trees = {"old": export(args.old, os.path.join(scratch, "old")),
                 "new": export(args.new, os.path.join(scratch, "new"))}
        for tree in trees.values():
            build(tree)
        times = {w: {"old": [], "new": []} for w in workloads}
        for round_ in range(args.rounds):
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for workload in workloads:
                for which in order:
                    times[workload][which] += run(trees[which], workload, args.iterations)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    worst = None
    print(f"{'workload':<18} {'old ms':>9} {'new ms':>9} {'new/old speed':>14}")
    for workload in workloads:
        old = statistics.median(times[workload]["old"])
        new = statistics.median(times[workload]["new"])
        speed = old / new
        worst = speed if worst is None else min(worst, speed)
        print(f"{workload:<18} {old * 1e3:9.2f} {new * 1e3:9.2f} {speed:13.3f}x")
    return 0 if worst >= args.floor else 1


if __name__ == "__main__":
    sys.exit(main())
