"""ZeroAdamW's options: checked as torch.optim.AdamW checks its own, and the
ones rlhfz adds. Bad input raises here, before anything is built."""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .engine import DTYPE_NAMES, MIN_BUCKET_BYTES, STATE_DTYPES


def _number(name: str, value) -> float:
    """A hyperparameter as a float. Like torch, which compares it with 0.0,
    only numbers and one-element tensors pass: a string is a TypeError,
    never parsed."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{name} must be a number or a one-element tensor, not "
                    f"{type(value).__name__} ({value!r})")


def check_hparams(lr, betas, eps, weight_decay) -> None:
    """Each value range torch checks; a message names the value as given."""
    value = _number("lr", lr)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"Invalid learning rate: {lr}")
    value = _number("eps", eps)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, not {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= _number(f"betas[{i}]", beta) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    decay = _number("weight_decay", weight_decay)
    if not (math.isfinite(decay) and decay >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_constructor_hparams(lr, betas, eps, weight_decay, foreach, capturable) -> None:
    """check_hparams, with what torch.optim.AdamW's constructor alone
    refuses, in its words and order: a tensor lr or beta with foreach=True,
    and betas that are not both floats or both tensors (an int beta too)."""
    per_tensor = foreach and not capturable
    if isinstance(lr, torch.Tensor):
        if per_tensor:
            raise ValueError("lr as a Tensor is not supported for capturable=False and "
                             "foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    check_hparams(lr, betas, eps, weight_decay)
    floats = all(isinstance(b, float) for b in betas)
    if not floats and not all(isinstance(b, torch.Tensor) for b in betas):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            if per_tensor:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for "
                                 f"capturable=False and foreach=True")
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")


def check_unsupported(options: dict[str, Any]) -> None:
    """Refuse torch.optim.AdamW options rlhfz does not implement."""
    if options.get("amsgrad"):
        raise ValueError("amsgrad=True is not supported by rlhfz.ZeroAdamW")
    if options.get("capturable"):
        raise ValueError("capturable=True (CUDA graph capture) is not supported by this build "
                         "of rlhfz.ZeroAdamW")
    if options.get("differentiable"):
        raise ValueError("differentiable=True is not supported by rlhfz.ZeroAdamW")
    if not options.get("decoupled_weight_decay", True):
        # torch's Adam steps with this flag; its AdamW keeps it True
        raise ValueError("decoupled_weight_decay=False (Adam's L2 weight decay, added to the "
                         "grad) is not supported by rlhfz.ZeroAdamW, which steps AdamW's "
                         "decoupled decay: leave it True")
    if options.get("foreach") and options.get("fused"):
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_state_dtype(state_dtype, min_8bit_size) -> None:
    if not isinstance(state_dtype, str) or state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {', '.join(map(repr, STATE_DTYPES))}, "
                         f"not {state_dtype!r}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) \
            or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be an int >= 0, not {min_8bit_size!r}")


def group_storage(group) -> tuple[str, int]:
    """How a param group keeps its moments: (state_dtype, min_8bit_size)."""
    return group["state_dtype"], group["min_8bit_size"]


def check_group(options: dict[str, Any]) -> None:
    """A param group's options (merged over the defaults)."""
    check_unsupported(options)
    check_hparams(options["lr"], options["betas"], options["eps"], options["weight_decay"])
    check_state_dtype(options.get("state_dtype", "fp32"), options.get("min_8bit_size", 4096))


def group_hparams(group) -> dict[str, Any]:
    """The kernels' keywords for one param group, checked."""
    check_unsupported(group)
    beta1, beta2 = (float(b) for b in group["betas"])
    check_hparams(group["lr"], (beta1, beta2), group["eps"], group["weight_decay"])
    return dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), maximize=bool(group["maximize"]))


def check_engine_options(stage, offload, offload_ratio, pin_memory, nonfinite,
                         param_persistence_threshold, reduce_dtype, collectives,
                         bucket_bytes=None) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")
    if offload not in (None, "cpu"):
        raise ValueError(f"offload must be None or 'cpu', not {offload!r}")
    if not (isinstance(offload_ratio, numbers.Real) and not isinstance(offload_ratio, bool)
            and 0.0 <= offload_ratio <= 1.0):
        raise ValueError(f"offload_ratio must be a number in [0, 1], not {offload_ratio!r}")
    if offload_ratio != 1.0 and offload is None:
        raise ValueError(f"offload_ratio={offload_ratio!r} is the share of the optimizer state "
                         f"that steps on the host: it needs offload='cpu'")
    # `is`: 0, 1.0 or a numpy bool compare equal to a bool but are none
    if not (pin_memory is True or pin_memory is False or pin_memory == "auto"):
        raise ValueError(f"pin_memory must be True, False or 'auto', not {pin_memory!r}")
    if nonfinite not in ("raise", "skip", None):
        raise ValueError(f"nonfinite must be 'raise', 'skip' or None, not {nonfinite!r}")
    if not (isinstance(param_persistence_threshold, int) and param_persistence_threshold >= 0):
        raise ValueError("param_persistence_threshold must be an int >= 0")
    if reduce_dtype not in (None, torch.float32):
        raise ValueError(f"reduce_dtype must be None (the params' dtype) or torch.float32, "
                         f"not {reduce_dtype!r}")
    if collectives not in ("torch", "nccl"):
        raise ValueError(f"collectives must be 'torch' or 'nccl', not {collectives!r}")
    if bucket_bytes is not None and not (isinstance(bucket_bytes, int) and
                                         not isinstance(bucket_bytes, bool) and
                                         bucket_bytes >= MIN_BUCKET_BYTES):
        raise ValueError(f"bucket_bytes must be None (32 MiB, at most an eighth of a param "
                         f"group) or an int >= {MIN_BUCKET_BYTES}, not {bucket_bytes!r}")


def check_params(tensors: list, device: torch.device, groups) -> None:
    """Params as torch.optim takes them, of the dtypes and device rlhfz
    steps; none twice, in this group or another one."""
    seen = set()
    for p in tensors:
        if not isinstance(p, torch.Tensor):
            raise TypeError("optimizer can only optimize Tensors, but one of the params is "
                            + torch.typename(p))
        if p.layout != torch.strided:
            raise ValueError(f"sparse parameters ({p.layout}) are not supported")
        if p.dtype not in DTYPE_NAMES:
            # complex and float64 are refused on purpose: the kernels step
            # fp32 master weights, which would silently lose their precision
            raise TypeError(f"parameters must be float32, bfloat16 or float16, "
                            f"not {p.dtype}")
        if p.device != device:
            raise ValueError(f"every parameter must be on one device: {p.device} (shape "
                             f"{tuple(p.shape)}) differs from {device}")
        if id(p) in seen:
            raise ValueError("a parameter appears more than once in the param group "
                             f"(shape {tuple(p.shape)})")
        seen.add(id(p))
    for group in groups:
        for q in group["params"]:
            if id(q) in seen:
                raise ValueError("some parameters appear in more than one parameter group")
    check_no_shared_memory(tensors + [q for group in groups for q in group["params"]])


def check_no_shared_memory(params: list) -> None:
    """Two params over the same memory (Parameter(t) twice, or views of one
    tensor): torch's AdamW applies both updates to that memory, where rlhfz
    would give each a bucket slot of its own and untie them."""
    spans = {}
    for p in params:
        storage = p.untyped_storage()
        if p.is_meta or storage.nbytes() == 0 or p.numel() == 0:
            continue
        start = p.storage_offset() * p.element_size()
        reach = sum((n - 1) * abs(k) for n, k in zip(p.shape, p.stride())) + 1
        spans.setdefault((p.device, storage.data_ptr()), []).append(
            (start, start + reach * p.element_size(), tuple(p.shape)))
    for runs in spans.values():
        runs.sort()
        for (_, end, shape), (start, _, other) in zip(runs, runs[1:]):
            if start < end:
                raise ValueError(
                    f"two parameters share memory (shapes {shape} and {other}): torch's "
                    f"AdamW would apply both updates to it, and rlhfz keeps each param in a "
                    f"slot of its own, which would untie them. Tie them as one Parameter "
                    f"(as tied embeddings are), or give each its own memory (clone())")


def common_device(params: list) -> torch.device:
    """The device of the first tensor among params (or param-group dicts);
    check_params then holds every param to it. A group's generator is read
    into a list here, every group's, since it can be read only once."""
    for item in params:
        if isinstance(item, dict):
            tensors = item.get("params", [])
            if not isinstance(tensors, (torch.Tensor, list, tuple, set)) and tensors is not None:
                item["params"] = list(tensors)
    for item in params:
        tensors = [item]
        if isinstance(item, dict):
            tensors = item.get("params", [])
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
        for t in tensors or []:
            t = t[1] if isinstance(t, tuple) else t
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")
