"""The disk tier of Buffer and copies between tiers.

A disk Buffer is a file of its own in the directory it was given, mapped
into memory: views of it are plain host memory, its pages can be dropped
from this process and fault back in. Its name is removed once it is
mapped, so its blocks go back when it is freed or the process ends.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import rlhfz
from rlhfz import _C
import disk_files
from state_snapshots import resident_kib


def test_a_disk_buffer_is_a_file_that_goes_with_it(tmp_path):
    buffer = _C.Buffer(1000, "disk", path=tmp_path)
    assert buffer.tier == "disk" and buffer.nbytes == 1000
    assert os.path.dirname(buffer.path) == str(tmp_path)
    # its name is gone at once: a process that dies leaves nothing behind
    assert os.listdir(tmp_path) == []
    assert disk_files.held(tmp_path) == [os.path.basename(buffer.path)]
    assert os.path.getsize(disk_files.descriptor_path(buffer)) >= 1000
    view = torch.from_dlpack(buffer.view("float32"))
    assert bool((view == 0).all())                   # a new file reads as zeros
    view.copy_(torch.arange(250.0))
    del view
    assert buffer.exports == 0
    del buffer
    assert disk_files.held(tmp_path) == []


def test_released_pages_leave_the_process_and_come_back(tmp_path):
    nbytes = 256 << 20
    buffer = _C.Buffer(nbytes, "disk", path=tmp_path)
    data = torch.from_dlpack(buffer.view("float32"))
    data.copy_(torch.arange(data.numel(), dtype=torch.float32))
    expected = float(data[-1])
    touched = resident_kib()
    buffer.release_pages()
    dropped = resident_kib()
    assert touched - dropped > 0.9 * nbytes / 1024, (touched, dropped)
    assert float(data[-1]) == expected and float(data[12345]) == 12345.0
    with pytest.raises(ValueError, match="for disk buffers, not host ones"):
        _C.Buffer(64).release_pages()


def test_disk_buffer_failures_are_oserrors_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="could not open a .*disk buffer at .*missing"):
        _C.Buffer(64, "disk", path=tmp_path / "missing")
    regular = tmp_path / "a-file"
    regular.write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        _C.Buffer(64, "disk", path=regular)
    with pytest.raises(OSError):
        _C.Buffer(64, "disk", path="/proc/self")      # no new files there, even for root
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
    # a path is bytes in the file system's encoding, UTF-8 or not
    with pytest.raises(FileNotFoundError, match="could not open"):
        _C.Buffer(64, "disk", path=os.fsencode(tmp_path) + b"/missing\xff")


@pytest.mark.parametrize("src_tier, dst_tier", [
    ("host", "disk"), ("disk", "host"), ("disk", "disk"), ("host", "host"), ("pinned", "disk"),
])
def test_copy_from_between_tiers(tmp_path, src_tier, dst_tier):
    def make(tier):
        return (_C.Buffer(4096 + 6, tier, path=tmp_path) if tier == "disk"
                else _C.Buffer(4096 + 6, tier))
    src, dst = make(src_tier), make(dst_tier)
    values = np.random.default_rng(0).standard_normal(2051).astype(np.float16)
    np.from_dlpack(src.view("float16"))[:] = values
    dst.copy_from(src)
    assert np.array_equal(np.from_dlpack(dst.view("float16")), values)


def test_copy_from_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="src has 8 bytes but this buffer has 16"):
        _C.Buffer(16).copy_from(_C.Buffer(8))
    with pytest.raises(TypeError, match="src must be a Buffer"):
        _C.Buffer(16).copy_from(np.zeros(4, dtype=np.float32))
    buffer = _C.Buffer(16)
    buffer.copy_from(buffer)           # itself: nothing to do


def test_a_copied_export_of_disk_memory_is_host_memory(tmp_path):
    buffer = _C.Buffer(64, "disk", path=tmp_path)
    np.from_dlpack(buffer.view("float32"))[:] = 7.0
    copied = np.from_dlpack(buffer.view("float32"), copy=True)
    del buffer
    assert disk_files.held(tmp_path) == []
    assert bool((copied == 7.0).all())


@pytest.mark.parametrize("nbytes", [(4 << 20) - 2, (4 << 20) + 2, (9 << 20) + 6, 37 << 20])
def test_large_copies_split_over_threads_copy_every_byte(tmp_path, nbytes):
    src, dst = _C.Buffer(nbytes), _C.Buffer(nbytes, "disk", path=tmp_path)
    words = np.random.default_rng(nbytes).integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    np.from_dlpack(src.view("float16")).view(np.uint16)[:] = words
    dst.copy_from(src)
    back = _C.Buffer(nbytes, zero=False)
    back.copy_from(dst)
    assert np.array_equal(np.from_dlpack(back.view("float16")).view(np.uint16), words)


def test_a_shortened_file_is_an_oserror_not_a_crash(tmp_path):
    """Reading a mapping past its file's end kills the process (SIGBUS):
    a copy checks the file first."""
    disk = _C.Buffer(3 * 4096, "disk", path=tmp_path)
    host = _C.Buffer(3 * 4096)
    os.truncate(disk_files.descriptor_path(disk), 4096)
    for copy in (lambda: host.copy_from(disk), lambda: disk.copy_from(host)):
        with pytest.raises(OSError, match="shortened it"):
            copy()


SHORTENED_FILE_SCRIPT = """
import os, sys, tempfile
import numpy as np
from rlhfz import _C
sys.path.insert(0, sys.argv[2])
import disk_files
disk = _C.Buffer(3 * 4096, "disk", path=tempfile.mkdtemp())
os.truncate(disk_files.descriptor_path(disk), 4096)
view = disk.view("float32")
host = _C.Buffer(3 * 4096).view("float32")
touches = {
    "zero_": lambda: disk.zero_(),
    "dlpack_copy": lambda: np.from_dlpack(view, copy=True),
    "sumsq": lambda: _C.sumsq(view),
    "scale_": lambda: _C.scale_(view, 2.0),
    "cast_into": lambda: _C.cast_(view, host),
    "cast_from": lambda: _C.cast_(host, view),
}
try:
    touches[sys.argv[1]]()
except OSError as error:
    print("OSError", error)
"""


@pytest.mark.parametrize("touch", ["zero_", "dlpack_copy", "sumsq", "scale_", "cast_into",
                                   "cast_from"])
def test_every_touch_of_a_shortened_file_is_an_oserror(touch):
    # each in a child: before the check, the touch was a SIGBUS
    result = subprocess.run([sys.executable, "-c", SHORTENED_FILE_SCRIPT, touch,
                             os.path.dirname(os.path.abspath(__file__))],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OSError" in result.stdout and "shortened it" in result.stdout, result.stdout


KILLED_SCRIPT = """
import os, signal, sys, torch, rlhfz
model = torch.nn.Linear(2048, 2048)        # 16 MiB a kind, 80 MiB on disk in all
opt = rlhfz.ZeroAdamW(model.parameters(), stage=0)
model(torch.randn(2, 2048)).sum().backward()
opt.step()
rlhfz.offload(model, opt, to="disk", path=sys.argv[1])
print(len(opt.memory_report()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_process_leaves_no_files(tmp_path):
    """Offload files of a run that is killed (the OOM killer, a preempted
    job) took their space until someone found and deleted them by hand."""
    import shutil
    free_before = shutil.disk_usage(tmp_path).free
    result = subprocess.run([sys.executable, "-c", KILLED_SCRIPT, str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -9 and result.stdout.strip() == "5", result
    assert os.listdir(tmp_path) == []
    # other processes write to the same file system meanwhile: half the
    # 80 MiB the files held is the margin
    assert shutil.disk_usage(tmp_path).free >= free_before - (40 << 20)


def test_reload_from_a_shortened_offload_file_raises_and_stays_offloaded(tmp_path):
    model = torch.nn.Linear(64, 64)
    opt = rlhfz.ZeroAdamW(model.parameters(), stage=0)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    opt.offload(to="disk", path=tmp_path)
    placement = opt.placement()
    for path in disk_files.descriptor_paths(tmp_path):
        os.truncate(path, 0)
    with pytest.raises(OSError, match="shortened it"):
        opt.reload()
    assert opt.placement() == placement
