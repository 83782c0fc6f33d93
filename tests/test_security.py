"""Security properties of rlhfz's files and processes.

- Disk-tier files are created 0600 (whatever the umask), owned by the user,
  in the directory the user named, under names with 128 random bits; a
  file or link planted where a name would go is neither followed nor
  overwritten.
- Checkpoint files (tensor files, index.json, model.pt, optimizer.pt) are
  created 0600.
- Loading a checkpoint executes nothing from it: a pickle payload in any
  file it reads is refused before it can run, and rlhfz's sources unpickle
  nothing they did not make.
- rlhfz listens on no network port: one process opens no socket at all,
  and across ranks every listening socket is one torch.distributed opened.
"""
import ast
import contextlib
import glob
import json
import os
import pickle
import re
import shutil
import stat
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import rlhfz
from rlhfz import _C
from rlhfz.launch import run_ranks
import disk_files
from state_snapshots import assert_same, snapshot

import soak_workers as workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"rlhfz-([0-9a-f]{32})\.buf")


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def bit_distance(a: str, b: str) -> int:
    return bin(int(a, 16) ^ int(b, 16)).count("1")


def disk_tier_mappings() -> list[str]:
    """Paths of every disk-tier file this process has mapped."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and ".buf" in fields[5]:
                paths.add(fields[5].removesuffix(disk_files.DELETED))
    return sorted(p for p in paths if NAME.fullmatch(os.path.basename(p)))


# ---- disk-tier files -----------------------------------------------------------------------

def test_disk_tier_files_are_private_unguessable_and_where_asked(tmp_path):
    model, opt = workers.small_model()
    workers.train(model, opt, 2)
    mapped_before = set(disk_tier_mappings())
    with umask(0):                     # the mode must not depend on a restrictive umask
        rlhfz.offload(model, opt, to="disk", path=tmp_path)
    try:
        assert os.listdir(tmp_path) == []      # names removed once mapped
        names = disk_files.held(tmp_path)
        # params, grads, master-less fp32 moments, and the model's own buffers
        assert len(names) >= 6, names
        descriptors = disk_files.descriptor_paths(tmp_path)
        assert len(descriptors) == len(names)
        for name, descriptor in zip(names, descriptors):
            info = os.stat(descriptor)
            assert stat.S_ISREG(info.st_mode) and info.st_nlink == 0, name
            assert stat.S_IMODE(info.st_mode) == 0o600, (name, oct(info.st_mode))
            assert info.st_uid == os.getuid(), name
            assert NAME.fullmatch(name), name
        mapped = sorted(set(disk_tier_mappings()) - mapped_before)
        directory = os.path.realpath(tmp_path)
        assert mapped == [os.path.join(directory, name) for name in names]   # nothing elsewhere
        randoms = [NAME.fullmatch(n).group(1) for n in names]
        randoms += [NAME.fullmatch(os.path.basename(_C.Buffer(64, "disk", path=tmp_path).path))
                    .group(1) for _ in range(8)]      # one after another, freed at once
        # 128 random bits differ in 64 +- 6 places; a counter or a clock in
        # the name would leave most of them equal
        distances = [bit_distance(a, b) for i, a in enumerate(randoms) for b in randoms[:i]]
        assert min(distances) >= 32, sorted(distances)[:5]
    finally:
        rlhfz.reload(model, opt)
    assert os.listdir(tmp_path) == []


def test_links_planted_at_the_old_predictable_names_are_not_followed(tmp_path):
    """Names of the form rlhfz-<pid>-<counter>.buf were guessable: links
    planted there are left alone, and what they point at is untouched."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    planted = [offload_dir / f"rlhfz-{os.getpid()}-{n}.buf" for n in range(64)]
    for link in planted:
        link.symlink_to(victim)
    victim_before = victim.stat()
    model, opt = workers.small_model()
    workers.train(model, opt, 1)
    rlhfz.offload(model, opt, to="disk", path=offload_dir)
    made = set(disk_files.held(offload_dir)) - {p.name for p in planted}
    assert made and all(NAME.fullmatch(n) for n in made), made
    rlhfz.reload(model, opt)
    assert victim.read_bytes() == b"precious"
    assert victim.stat().st_mode == victim_before.st_mode
    assert sorted(os.listdir(offload_dir)) == sorted(p.name for p in planted)
    assert all(p.is_symlink() and os.readlink(p) == str(victim) for p in planted)


_SHIM = r"""
/* getrandom() that hands out the same bytes for the first SHIM_REPEATS
 * 16-byte requests made while SHIM_REPEATS is set, then real ones: a name
 * collision on demand. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

static int repeated;

ssize_t getrandom(void *buffer, size_t length, unsigned int flags)
{
    const char *repeats = getenv("SHIM_REPEATS");
    if (repeats != NULL && length == 16 && repeated < atoi(repeats)) {
        repeated++;
        memset(buffer, 0xab, length);
        return (ssize_t)length;
    }
    return syscall(SYS_getrandom, buffer, length, flags);
}

int shim_repeated(void) { return repeated; }
"""

_COLLIDE = textwrap.dedent("""
    import ctypes, json, os, sys
    from rlhfz import _C
    directory, repeats = sys.argv[1], sys.argv[2]
    os.environ["SHIM_REPEATS"] = repeats
    try:
        buffer = _C.Buffer(4096, "disk", path=directory)
        out = {"path": buffer.path, "files": sorted(os.listdir(directory))}
        del buffer
    except OSError as error:
        out = {"error": type(error).__name__, "message": str(error)}
    out["after"] = sorted(os.listdir(directory))
    out["forced"] = ctypes.CDLL(None).shim_repeated()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def colliding_random(tmp_path_factory):
    """A preloadable getrandom() that makes the next names collide."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the getrandom() shim")
    folder = tmp_path_factory.mktemp("shim")
    (folder / "shim.c").write_text(_SHIM)
    library = folder / "shim.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                    str(folder / "shim.c")], check=True)
    return library


def _collide(library, directory, repeats: int) -> dict:
    # after any preload already there (a sanitizer runtime must stay first)
    env = dict(os.environ, LD_PRELOAD=os.pathsep.join(filter(None, [os.environ.get("LD_PRELOAD"),
                                                                    str(library)])),
               PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", _COLLIDE, str(directory), str(repeats)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("planted", ["link to a file", "dangling link", "file"])
def test_a_name_taken_in_advance_is_skipped_not_followed(tmp_path, colliding_random, planted):
    """The next name is forced (the shim); something is already there. The
    buffer takes a fresh random name, and what was planted, and anything it
    points at, is untouched."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "offload"
    directory.mkdir()
    taken = directory / f"rlhfz-{'ab' * 16}.buf"
    if planted == "link to a file":
        taken.symlink_to(victim)
    elif planted == "dangling link":
        taken.symlink_to(tmp_path / "created-through-the-link")
    else:
        taken.write_bytes(b"someone else's")
    out = _collide(colliding_random, directory, repeats=1)
    assert "error" not in out and out["forced"] == 1, out
    made = os.path.basename(out["path"])
    assert made != taken.name and NAME.fullmatch(made)
    assert out["files"] == [taken.name] and out["after"] == [taken.name]
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "created-through-the-link").exists()
    if planted == "file":
        assert taken.read_bytes() == b"someone else's"
    else:
        assert taken.is_symlink()


def test_a_name_that_always_collides_fails_cleanly(tmp_path, colliding_random):
    (tmp_path / f"rlhfz-{'ab' * 16}.buf").write_bytes(b"someone else's")
    out = _collide(colliding_random, tmp_path, repeats=10_000)
    assert out["error"] == "FileExistsError" and out["forced"] > 1, out
    assert "could not open" in out["message"]
    assert out["after"] == [f"rlhfz-{'ab' * 16}.buf"]
    assert (tmp_path / f"rlhfz-{'ab' * 16}.buf").read_bytes() == b"someone else's"


# ---- checkpoint files ----------------------------------------------------------------------

def without_grads(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.endswith(".grad")}


def _files_under(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files)


def test_checkpoint_files_are_created_private(tmp_path):
    model, opt = workers.small_model()
    workers.train(model, opt, 2)
    with umask(0):
        rlhfz.save_checkpoint(tmp_path / "sharded", model, opt)
        rlhfz.save_checkpoint(tmp_path / "sharded", model, opt)     # over an existing one
        rlhfz.save_consolidated(tmp_path / "consolidated", model, opt)
    files = _files_under(tmp_path)
    kinds = {os.path.basename(f).split("-")[0] for f in files}
    assert {"index.json", "rank", "model.pt", "optimizer.pt"} <= kinds, files
    for file in files:
        info = os.lstat(file)
        assert stat.S_IMODE(info.st_mode) == 0o600, (file, oct(info.st_mode))
        assert info.st_uid == os.getuid()
    fresh, fresh_opt = workers.small_model(seed=1)     # still loadable, both formats
    rlhfz.load_checkpoint(tmp_path / "sharded", fresh, fresh_opt)
    assert_same(without_grads(snapshot(model, opt)), snapshot(fresh, fresh_opt))
    rlhfz.load_checkpoint(tmp_path / "consolidated", fresh, fresh_opt)


# ---- loading executes nothing --------------------------------------------------------------

class _Payload:
    """Unpickling this creates the marker file named at pickling."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def _plant(tmp_path, model, opt, where: str, marker):
    """A checkpoint directory with a payload where `where` says."""
    path = tmp_path / "ckpt"
    payload = _Payload(marker)
    if where in ("model.pt", "model.pt nested", "optimizer.pt", "optimizer.pt param_groups"):
        rlhfz.save_consolidated(path, model, opt)
        if where == "model.pt":
            torch.save(payload, path / "model.pt")
        elif where == "model.pt nested":
            state = model.state_dict()
            state["0.weight"] = [state["0.weight"], {"x": payload}]
            torch.save(state, path / "model.pt")
        elif where == "optimizer.pt":
            state = opt.state_dict()
            state["state"][0]["exp_avg"] = payload
            torch.save(state, path / "optimizer.pt")
        else:
            state = opt.state_dict()
            state["param_groups"][0]["lr"] = payload
            torch.save(state, path / "optimizer.pt")
        return path
    rlhfz.save_checkpoint(path, model, opt)
    if where == "index.json":
        (path / "index.json").write_bytes(pickle.dumps(payload, protocol=2))
    elif where == "tensor file":
        file = glob.glob(str(path / "g-*" / "rank-*.safetensors"))[0]
        blob = pickle.dumps(payload, protocol=2)
        with open(file, "r+b") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
    elif where == "beside a sharded checkpoint":
        torch.save(payload, path / "model.pt")
        torch.save(payload, path / "optimizer.pt")
    return path


@pytest.mark.parametrize("where", ["model.pt", "model.pt nested", "optimizer.pt",
                                   "optimizer.pt param_groups", "index.json", "tensor file",
                                   "beside a sharded checkpoint"])
def test_loading_runs_no_payload(tmp_path, where):
    """A pickle payload in every file load_checkpoint reads (and beside the
    ones it reads) never runs; where it is in the way, loading raises
    CheckpointError and nothing changes."""
    model, opt = workers.small_model()
    workers.train(model, opt, 2)
    marker = tmp_path / "payload-ran"
    path = _plant(tmp_path, model, opt, where, marker)
    target, target_opt = workers.small_model(seed=1)
    before = snapshot(target, target_opt)
    if where == "beside a sharded checkpoint":
        rlhfz.load_checkpoint(path, target, target_opt)      # index.json decides what is read
        assert_same(without_grads(snapshot(model, opt)), snapshot(target, target_opt))
    else:
        with pytest.raises(rlhfz.CheckpointError):
            rlhfz.load_checkpoint(path, target, target_opt)
        assert_same(before, snapshot(target, target_opt))
    assert not marker.exists()


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


# (file, call) that may unpickle freely: each reads only bytes rlhfz itself wrote
ALLOWED_UNPICKLING = {
    # run_ranks reads back results its own spawned ranks pickled to it
    ("launch.py", "torch.load"),
}


def test_sources_unpickle_nothing_from_outside():
    """Every torch.load passes weights_only=True (except reading back what
    run_ranks' own children sent), and nothing calls pickle, marshal, eval
    or exec."""
    found = []
    for file in sorted(glob.glob(os.path.join(ROOT, "rlhfz", "**", "*.py"), recursive=True)):
        with open(file) as f:
            tree = ast.parse(f.read(), file)
        short = os.path.relpath(file, os.path.join(ROOT, "rlhfz"))
        for node, name in _calls(tree):
            if name in ("eval", "exec", "compile", "__import__") or name.startswith(
                    ("pickle.", "marshal.", "shelve.", "dill.", "cloudpickle.")):
                found.append((short, node.lineno, name))
            if name.endswith("torch.load"):
                weights_only = [k.value for k in node.keywords if k.arg == "weights_only"]
                safe = weights_only and isinstance(weights_only[0], ast.Constant) \
                    and weights_only[0].value is True
                if not safe and (short, "torch.load") not in ALLOWED_UNPICKLING:
                    found.append((short, node.lineno, ast.unparse(node)))
    assert found == []


# ---- network ----------------------------------------------------------------------------------

def test_one_process_opens_no_socket(tmp_path, capsys):
    """Training, offload and reload to host memory and disk, checkpoints in
    both formats, and `python -m rlhfz info`: no socket at all, no child
    process."""
    from rlhfz.__main__ import main
    sockets, listening, children = (workers.socket_inodes(), workers.listening_sockets(),
                                    workers.children())
    workers.single_process_workload(tmp_path)
    assert main(["info"]) == 0
    assert json.loads(capsys.readouterr().out)["version"]
    assert workers.socket_inodes() - sockets == set()
    assert workers.listening_sockets() - listening == set()
    assert workers.children() - children == set()


def test_ranks_listen_only_where_torch_distributed_does(tmp_path):
    """Two gloo ranks (file:// rendezvous) at stage 3: generation in every
    mode, offload and reload, checkpoints in both formats, weight export.
    Every listening socket at the end was opened inside init_process_group
    or new_group, and none appeared after the optimizer was built."""
    results = run_ranks(workers.listening_after_workload, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["at_init"], f"rank {rank}: gloo listens nowhere? {result}"
        assert result["at_end"] <= result["at_init"] | result["opened_by_torch"], result
        assert result["at_end"] == result["after_optimizer"], result
        assert not any(proto.startswith("udp") for proto, _, _ in result["at_end"]), result
        assert result["new_children"] == [], result
        assert result["worked"], result
