"""What a user changes in ZeroAdamW's torch-facing state, taken in before a
step could ignore it, or refused.

torch's AdamW steps from whatever optimizer.state and param_groups hold
when step() runs. ZeroAdamW steps from its own buffers, which the tensors
in optimizer.state view. So before a step, and before a state dict is
made, what was changed there reaches the buffers:
- an entry cleared (optimizer.state.clear(), del optimizer.state[p], a new
  optimizer.state, an empty dict): the param starts afresh at its next
  step, step 0 and zero moments, as torch's would;
- a tensor or the step count replaced in an entry: its values are copied
  in, and the entry views the buffers again;
- an entry that lost a key: refused, as torch's step would fail on it;
- a non-empty entry for a param not yet stepped: refused (load state with
  load_state_dict, which places it);
- a param list in param_groups edited: refused, since the buckets were
  built from it (add_param_group adds params).
Writes into the state tensors in place need none of this: they are the
buffers (Bucket.adopt_written and ShardState.take_stitched_writes cover
the params and the stitched copies).
"""
from __future__ import annotations

import math
from itertools import chain
from operator import is_

import torch

_MISSING = object()


def check_group_params(param_groups, built: list[tuple]) -> None:
    """Raises if a group's param list (or the list of groups) differs from
    the params the buckets were built from."""
    if len(param_groups) != len(built):
        raise ValueError(
            f"optimizer.param_groups holds {len(param_groups)} groups, but the optimizer was "
            f"built with {len(built)}: add groups with add_param_group(); to drop one, build "
            f"a new ZeroAdamW and load this one's state_dict() into it")
    for index, (group, params) in enumerate(zip(param_groups, built)):
        now = group["params"]
        if len(now) != len(params) or not all(map(is_, now, params)):
            raise ValueError(
                f"param_groups[{index}]['params'] was changed after the optimizer was built "
                f"({len(params)} params then, {len(now)} now): its buckets hold the params it "
                f"was built with, so a param added there would never train and one taken "
                f"out would go on training. Add params with add_param_group(); to drop some, "
                f"build a new ZeroAdamW and load this one's state_dict() into it")


class StateEntries:
    """The entries ZeroAdamW put into optimizer.state, as it put them."""

    def __init__(self):
        # id(param) -> (param, entry, its keys, its values)
        self.given: dict[int, tuple] = {}
        self._seen = None            # optimizer.state as last taken, flat

    def give(self, param: torch.Tensor, entry: dict) -> None:
        self.given[id(param)] = (param, entry, tuple(entry), tuple(entry.values()))
        self._seen = None

    def drop(self, param: torch.Tensor) -> None:
        self.given.pop(id(param), None)
        self._seen = None

    def _unchanged(self, state) -> bool:
        """Whether optimizer.state is as last taken: its keys, entries and
        values the same objects. Compared in C loops without hashing a
        tensor, since this runs before every step."""
        if self._seen is None or not isinstance(state, dict):
            return False
        keys, entries, lengths, values = self._seen
        if len(state) != len(keys) or not all(map(is_, state, keys)):
            return False
        got = list(state.values())
        return (all(map(is_, got, entries)) and list(map(len, got)) == lengths
                and all(map(is_, chain.from_iterable(map(dict.values, got)), values)))

    def _remember(self, state) -> None:
        entries = list(state.values())
        if all(isinstance(entry, dict) for entry in entries):
            self._seen = (list(state), entries, list(map(len, entries)),
                          list(chain.from_iterable(map(dict.values, entries))))

    def take(self, state, engine) -> None:
        """Carries the edits to `state` (optimizer.state) into the engine's
        buffers, or raises having changed nothing."""
        if self._unchanged(state):
            return
        if not isinstance(state, dict):
            raise TypeError(f"optimizer.state must be a dict (torch's is a defaultdict(dict)), "
                            f"not {type(state).__name__}")
        owners = engine.owners()
        for key, entry in state.items():
            if id(key) in owners and id(key) not in self.given and \
                    (not isinstance(entry, dict) or entry):
                bucket, index = owners[id(key)]
                raise ValueError(
                    f"optimizer.state holds an entry for {describe(bucket, index)}, which has "
                    f"not been stepped yet; ZeroAdamW keeps state in its own buffers and takes "
                    f"it from load_state_dict() (or clear the entry)")
        resets, writes = [], []
        for param, entry, keys, values in list(self.given.values()):
            bucket, index = owners[id(param)]
            got = state.get(param)
            if got is None or (isinstance(got, dict) and not got):
                resets.append((param, bucket, index))
                continue
            if not isinstance(got, dict):
                raise TypeError(f"optimizer.state[{describe(bucket, index)}] must be a dict, not "
                                f"{type(got).__name__}")
            if got is entry and len(got) == len(values) and all(map(is_, got.values(), values)):
                continue
            changed = []
            for key, view in zip(keys, values):
                value = got.get(key, _MISSING)
                if value is view:
                    continue
                changed.append((key, _checked(value, key, view, bucket, index)))
            writes.append((param, got, bucket, index, changed, keys, values))
        for param, bucket, index in resets:
            bucket.state.reset(index)
            engine.unregister(bucket, index)
        for param, got, bucket, index, changed, keys, values in writes:
            for key, value in changed:
                if key == "step":
                    bucket.state.write_step(index, value)
                else:
                    region = "master" if key == "master_param" else key
                    bucket.state.write_stored(region, index, value)
            got.update(zip(keys, values))
            state[param] = got
            self.give(param, got)
        self._remember(state)


def describe(bucket, index: int) -> str:
    return f"the param of shape {tuple(bucket.layout.slots[index].shape)} " \
           f"(param_groups[{bucket.group_index}])"


def _checked(value, key: str, view: torch.Tensor, bucket, index: int):
    """A replaced entry's value, in the form its buffer stores, or raises."""
    where = f"optimizer.state[{describe(bucket, index)}][{key!r}]"
    if value is _MISSING:
        raise ValueError(f"{where} was removed: torch's AdamW cannot step from such an entry "
                         f"either. Clear the whole entry to start the param afresh, or load a "
                         f"state dict")
    if key == "step":
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value < 0 or not float(value).is_integer():
            raise ValueError(f"{where} must be a whole number >= 0 (or a tensor of one), "
                             f"not {value!r}")
        return float(value)
    if not isinstance(value, torch.Tensor) or value.is_meta or value.layout != torch.strided:
        raise ValueError(f"{where} must be a tensor with values, not {value!r}")
    if tuple(value.shape) != tuple(view.shape):
        raise ValueError(f"{where} was replaced by a tensor of shape {tuple(value.shape)}; its "
                         f"state has shape {tuple(view.shape)} here")
    if value.dtype != view.dtype and not (value.is_floating_point() and
                                          view.is_floating_point()):
        raise ValueError(f"{where} was replaced by a {value.dtype} tensor; it is stored as "
                         f"{view.dtype}")
    return value.detach().to(view.device, view.dtype).reshape(-1).clone()
