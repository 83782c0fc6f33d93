"""Shared fixtures and markers for rlhfz's tests."""
import pytest

import rlhfz


def _cuda_available() -> bool:
    return bool(rlhfz.build_info()["cuda"])


needs_cuda = pytest.mark.skipif(not _cuda_available(),
                                reason="needs a CUDA device (none visible to rlhfz here)")


def pytest_collection_modifyitems(config, items):
    import os
    slow = os.environ.get("RLHFZ_SLOW") == "1"
    for item in items:
        if item.get_closest_marker("gpu") and not _cuda_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (none visible here)"))
        if item.get_closest_marker("slow") and not slow:
            item.add_marker(pytest.mark.skip(reason="slow: runs with RLHFZ_SLOW=1"))


def pytest_configure(config):
    """Where a run must test an installed rlhfz (the wheel, or the simulated
    build's environment), the tree must not stand in for it. torch here runs
    on as many threads as in the ranks that run_ranks spawns, whose results
    the tests compare with ones computed here, bit for bit."""
    import os

    import importlib.util

    import torch
    from rlhfz import launch
    torch.set_num_threads(launch.torch_threads())
    # what the tests' ranks import, imported once by the server they fork from
    launch.PRELOAD += [name for name in ("transformers", "transformers.models.gpt2.modeling_gpt2",
                                         "transformers.models.llama.modeling_llama", "peft")
                       if importlib.util.find_spec(name.split(".")[0]) is not None]
    expected = os.environ.get("RLHFZ_EXPECT_INSTALLED_UNDER")
    if expected:
        where = os.path.realpath(rlhfz.__file__)
        if not where.startswith(os.path.realpath(expected) + os.sep):
            raise pytest.UsageError(f"rlhfz was imported from {where}, not from the "
                                    f"installation under {expected}")
