"""Optional benchmark peers. DeepSpeed runs on its CPU accelerator; it is
not a dependency of rlhfz, so its comparisons skip, with the reason, where
it is not installed (make bench-deps installs it, torch pinned)."""
import os

import pytest

INSTALL = "make bench-deps installs it (deepspeed==0.19.8, torch pinned)"


def deepspeed_missing_reason():
    """None where DeepSpeed imports, else why not: for a test that runs
    without it and records the reason instead of skipping."""
    # before the import: DeepSpeed picks its accelerator once, on import
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        return f"DeepSpeed is not installed ({e}): {INSTALL}"
    return None


def deepspeed_or_skip():
    reason = deepspeed_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    import deepspeed
    return deepspeed


def deepspeed_cpu_adam_or_skip():
    """DeepSpeedCPUAdam, its extension built (JIT, once per machine)."""
    deepspeed_or_skip()
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load(verbose=False)
    except Exception as e:     # a failed JIT build reads as any exception
        pytest.skip(f"DeepSpeedCPUAdam could not be built here: {e}")
    return DeepSpeedCPUAdam


def deepspeed_in_rank():
    """DeepSpeed in a rank run_ranks spawned, on its CPU accelerator and the
    gloo group already there (init_distributed finds it initialised and
    wraps it rather than making one); returns the module."""
    import logging

    import torch.distributed as dist
    os.environ.setdefault("DS_ACCELERATOR", "cpu")      # before the import, which picks it
    # what its launcher would set: the engine reads LOCAL_RANK
    for name, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", dist.get_rank()),
                        ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(name, str(value))
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed
