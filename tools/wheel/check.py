"""Tests rlhfz as pip users get it: sdist, then a wheel built from that
sdist, installed into a fresh virtual environment, used from outside the tree.

    python3 tools/wheel/check.py [pytest args]   # default: WHEEL_TESTS below

1. `python -m build --sdist` of a clean copy of the tree (the files git
   tracks or would track: no egg-info or build output of an earlier install
   can slip in): the source distribution, as MANIFEST.in and the package
   finder make it;
2. `pip wheel` of that sdist, which pip unpacks and builds in a directory
   of its own, so a header, a .cu file or a subpackage the sdist lacks fails
   the build or the imports below;
3. a new virtual environment (system site-packages give it torch and the
   test tools; its own site-packages come first, so the wheel's rlhfz is the
   one imported), the wheel installed into it;
4. every module of rlhfz imported from a working directory outside the tree,
   and rlhfz.__file__ checked to lie inside the environment;
5. the given tests run against the installed wheel (tests/conftest.py checks
   RLHFZ_EXPECT_INSTALLED_UNDER, so the tree can never stand in for it).

Everything lives under build/wheel-check/ and is made anew each run.
"""
import glob
import os
import shutil
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORK = os.path.join(ROOT, "build", "wheel-check")
# The optimizer against torch, the TRL twin (rlhfz.integrations), the demo,
# the C core through DLPack: the paths a pip user takes first.
WHEEL_TESTS = ["tests/test_optim_parity.py", "tests/test_trl_integration.py",
               "tests/test_demo.py", "tests/test_buffer_dlpack.py", "tests/test_offload.py"]

IMPORT_ALL = textwrap.dedent("""
    import importlib, os, pkgutil, sys
    import rlhfz
    prefix = os.path.realpath(sys.prefix)
    where = os.path.realpath(rlhfz.__file__)
    assert where.startswith(prefix + os.sep), f"rlhfz came from {where}, not from {prefix}"
    names = ["rlhfz"] + [m.name for m in pkgutil.walk_packages(rlhfz.__path__, "rlhfz.")]
    for name in names:
        module = importlib.import_module(name)
        path = os.path.realpath(module.__file__)
        assert path.startswith(prefix + os.sep), f"{name} came from {path}"
    for required in ("rlhfz._C", "rlhfz.integrations", "rlhfz.integrations.trl",
                     "rlhfz.integrations.trainer", "rlhfz.integrations.accelerate"):
        assert required in names, f"the wheel has no {required}"
    from rlhfz.integrations.trl import unwrap_model_for_generation  # noqa: F401
    print(f"wheel-check: imported {len(names)} modules from {os.path.dirname(where)}")
""")


def _say(*args):
    print("[wheel-check]", *args, flush=True)


def _run(command, **kwargs):
    _say(" ".join(command))
    subprocess.check_call(command, **kwargs)


def _clean_copy(dest):
    """The tree's tracked and untracked-but-not-ignored files, copied to dest."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, name))


def main(argv):
    shutil.rmtree(WORK, ignore_errors=True)
    source, dist, wheels, venv, outside = (
        os.path.join(WORK, name) for name in ("source", "dist", "wheelhouse", "venv", "outside"))
    os.makedirs(outside)
    _clean_copy(source)
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", dist, source])
    sdist, = glob.glob(os.path.join(dist, "rlhfz-*.tar.gz"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--disable-pip-version-check", "-w", wheels, sdist], cwd=outside)
    wheel, = glob.glob(os.path.join(wheels, "rlhfz-*.whl"))
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv])
    python = os.path.join(venv, "bin", "python")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "--quiet", wheel], cwd=outside)
    _run([python, "-c", IMPORT_ALL], cwd=outside)
    tests = [os.path.join(ROOT, t) if t.startswith("tests") else t for t in (argv or WHEEL_TESTS)]
    env = dict(os.environ, RLHFZ_EXPECT_INSTALLED_UNDER=os.path.realpath(venv))
    env.pop("PYTHONPATH", None)
    _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT, *tests],
         cwd=outside, env=env)
    _say(f"passed: {os.path.basename(wheel)} from {os.path.basename(sdist)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
