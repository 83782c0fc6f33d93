"""The disk tier's files as this process holds them. A disk buffer's name is
removed as soon as its file is mapped, so a directory lists none of them;
/proc/self/fd still shows each open one as "<dir>/rlhfz-<hex>.buf (deleted)"."""
import os

DELETED = " (deleted)"


def _open_files() -> dict[str, str]:
    """descriptor path -> the file it has open, for every open descriptor."""
    out = {}
    with os.scandir("/proc/self/fd") as entries:
        for entry in entries:
            try:
                out[entry.path] = os.readlink(entry.path)
            except OSError:          # the scandir descriptor itself, closed by now
                pass
    return out


def held(directory) -> list[str]:
    """The disk-tier files of this process in `directory`, by the names they
    had, and whatever else the directory lists: every file that takes its
    space there."""
    directory = os.path.realpath(os.fspath(directory))
    names = set(os.listdir(directory))
    for target in _open_files().values():
        if target.endswith(DELETED) and os.path.dirname(target) == directory:
            names.add(os.path.basename(target[:-len(DELETED)]))
    return sorted(names)


def descriptor_paths(directory) -> list[str]:
    """/proc/self/fd/N of each disk-tier file held in `directory`: a way to
    reach the file from outside rlhfz (to shorten it, say)."""
    directory = os.path.realpath(os.fspath(directory))
    return sorted(fd for fd, target in _open_files().items()
                  if target.endswith(DELETED) and os.path.dirname(target) == directory)


def descriptor_path(buffer) -> str:
    """/proc/self/fd/N of a disk Buffer's file."""
    wanted = buffer.path + DELETED
    return next(fd for fd, target in _open_files().items() if target == wanted)
