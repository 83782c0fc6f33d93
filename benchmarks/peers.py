"""Optional benchmark peers. DeepSpeed runs on its CPU accelerator; it is
not a dependency of rlhfz, so its comparisons skip, with the reason, where
it is not installed (make bench-deps installs it, torch pinned)."""
import os

import pytest

INSTALL = "make bench-deps installs it (deepspeed==0.19.8, torch pinned)"


def deepspeed_or_skip():
    # before the import: DeepSpeed picks its accelerator once, on import
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        pytest.skip(f"DeepSpeed is not installed ({e}): {INSTALL}")
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
