"""The examples run as documented: one process, and two gloo ranks under torchrun."""
import os
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("trl")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("script,marker", [("ppo_loop.py", "ppo_loop:"),
                                           ("grpo_tiny.py", "grpo_tiny:"),
                                           ("rlhf_stage3.py", "rlhf_stage3:")])
@pytest.mark.parametrize("ranks", [1, 2])
def test_example_runs(script, marker, ranks):
    path = os.path.join(ROOT, "examples", script)
    launch = ([sys.executable] if ranks == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(ranks), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), ROOT])),
               OMP_NUM_THREADS="1")
    done = subprocess.run(launch + [path], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{marker}" in done.stdout and f"on {ranks} rank(s)" in done.stdout, done.stdout
    assert f"stage {3 if ranks > 1 or script == 'rlhf_stage3.py' else 2}" in done.stdout
    moved = re.search(r"params moved by up to (\S+),", done.stdout)
    assert moved and float(moved.group(1)) > 0, done.stdout        # it trained
    if script == "rlhf_stage3.py":
        assert "transformers reads it back with the same logits" in done.stdout


def test_ray_example_runs_the_actor_groups_and_syncs_the_engine():
    """examples/ray_rlhf.py on a local Ray cluster: 7 actors in 4 placement
    groups, 2 GRPO steps; the engine's logits match the policy's at the end."""
    pytest.importorskip("ray")
    path = os.path.join(ROOT, "examples", "ray_rlhf.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                     ROOT])),
               OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, path, "--steps", "2"], capture_output=True, text=True,
                          timeout=420, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for group in ("policy rank 1", "reference rank 1", "reward rank 1", "generation rank 0"):
        assert group in done.stdout, done.stdout
    assert "step 1:" in done.stdout and "optimizer on host during generation" in done.stdout
    kl = re.search(r"step 1: .* kl (\S+),", done.stdout)
    assert kl and float(kl.group(1)) > 0, done.stdout    # the policy moved off the reference
    assert "logits match the policy's (max difference 0)" in done.stdout, done.stdout
