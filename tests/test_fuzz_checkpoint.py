"""Fuzzing load_checkpoint with damaged and edited checkpoints.

The pristine checkpoints hold state A: one saved by this process, and one
saved by two ranks (a legal reshard when loaded here). The live optimizer
then steps once, to state B. Each case copies a pristine checkpoint, damages
or edits it (flipped bits anywhere, truncated, extended or missing files,
edited index fields and tensor-file headers, swapped rank files) and loads
it. A refused load raises CheckpointError and leaves params, buffers,
optimizer state and param groups bitwise at B. A load that succeeds gives
A bitwise, the param groups and client_state the index names, and valid
hyperparameters. Case counts: RLHFZ_FUZZ_EXAMPLES (see fuzz_support)."""
import copy
import json
import os
import shutil
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlhfz
from fuzz_support import EXAMPLES, Tally, fuzz_settings, outcome, watchdog
from rlhfz.launch import run_ranks
from state_snapshots import assert_same, snapshot
from test_fuzz_state import group_view, hyperparameters_valid, small_model


def build():
    model = small_model()
    return model, rlhfz.ZeroAdamW(model, lr=1e-2, weight_decay=0.1, stage=2)


def train(model, opt, first, last, rank=0, world_size=1):
    for step in range(first, last):
        opt.zero_grad()
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        model(x[rank::world_size]).pow(2).mean().backward()
        opt.step()


def save_two_ranks(rank, world_size, path):
    """A rank's part of the two-rank pristine checkpoint."""
    model, opt = build()
    train(model, opt, 0, 3, rank, world_size)
    rlhfz.save_checkpoint(path, model, opt, client_state={"ranks": world_size})


# ---- damage and edits ------------------------------------------------------------------------

def files_in(root):
    out = []
    for folder, _, names in os.walk(root):
        out += [os.path.join(folder, n) for n in sorted(names)]
    return sorted(out)


def rank_files(root):
    return [f for f in files_in(root) if f.endswith(".safetensors")]


def edit_json(draw, doc):
    """One edit of a parsed index.json (in place, or a replacement)."""
    if not isinstance(doc, dict):
        return doc
    target = draw(st.sampled_from(["top", "world_size", "stage", "format", "generation",
                                   "files", "file", "crc", "param", "bucket", "group",
                                   "module", "client_state", "whole"]))
    if target == "whole":
        return draw(st.sampled_from([[], "x", None, 3, {}]))
    if target == "top" and doc:
        doc.pop(draw(st.sampled_from(sorted(doc))), None)
    elif target in ("world_size", "stage"):
        doc[target] = draw(st.sampled_from([0, -1, 1, 2, 3, "1", 1.0, True, None, 2**70]))
    elif target == "format":
        doc["format"] = draw(st.sampled_from(["rlhfz.checkpoint.v2", "", None]))
    elif target == "generation":
        doc["generation"] = draw(st.sampled_from(["g-0000000000000000", "../g", "g-", 5,
                                                  "g-" + "a" * 16]))
    elif target == "files" and isinstance(doc.get("files"), list) and doc["files"]:
        how = draw(st.sampled_from(["drop", "duplicate", "empty", "reverse"]))
        if how == "drop":
            doc["files"].pop()
        elif how == "duplicate":
            doc["files"].append(copy.deepcopy(doc["files"][0]))
        elif how == "empty":
            doc["files"] = []
        else:
            doc["files"].reverse()
    elif target == "file" and isinstance(doc.get("files"), list) and doc["files"] \
            and all(isinstance(e, dict) and isinstance(e.get("bytes"), int) for e in doc["files"]):
        entry = draw(st.sampled_from(doc["files"]))
        field = draw(st.sampled_from(["name", "bytes"]))
        entry[field] = draw(st.sampled_from(
            ["../../etc/passwd", "rank-00001-of-00002.safetensors", "index.json", None]
            if field == "name" else [entry["bytes"] + 1, entry["bytes"] - 1, -1, "10", 0,
                                     2**70]))
    elif target == "crc" and isinstance(doc.get("files"), list) and doc["files"]:
        crcs = draw(st.sampled_from(doc["files"])).get("crc32")
        if not isinstance(crcs, dict) or not crcs:
            return doc
        name = draw(st.sampled_from(sorted(crcs)))
        how = draw(st.sampled_from(["drop", "off", "empty", "negative", "text", "extra"]))
        if how == "drop":
            del crcs[name]
        elif how == "off":
            crcs[name] = [(c + 1) % 2**32 for c in crcs[name]]
        elif how == "extra":
            crcs["bucket9.param"] = [0]
        else:
            crcs[name] = {"empty": [], "negative": [-1], "text": ["a"]}[how]
    elif target == "param" and doc.get("params"):
        p = draw(st.sampled_from(doc["params"]))
        field = draw(st.sampled_from(["shape", "dtype", "name"]))
        p[field] = draw(st.sampled_from({
            "shape": [p["shape"][::-1], p["shape"] + [1], [], [-1], ["7"], None],
            "dtype": ["float16", "bfloat16", "int8", None, 3],
            "name": ["other", None, 5, p["name"]]}[field]))
    elif target == "bucket" and doc.get("buckets"):
        b = draw(st.sampled_from(doc["buckets"]))
        field = draw(st.sampled_from(["padded_numel", "shard_numel", "offsets", "numels",
                                      "registered", "master", "dtype", "params", "group"]))
        value = b[field]
        if isinstance(value, list) and value:
            i = draw(st.integers(0, len(value) - 1))
            value[i] = draw(st.sampled_from(
                [True, False, 1, None] if field == "registered" else
                [value[i] + 1, value[i] - 1, -1, 10**6, 2**70, "0", 0.5]))
            if field == "params" and draw(st.booleans()):
                value.reverse()
        else:
            b[field] = draw(st.sampled_from(
                [not value if isinstance(value, bool) else value, "bfloat16", None, -1,
                 value * 2 if isinstance(value, int) else 0, 2**70]))
    elif target == "group" and doc.get("param_groups"):
        g = draw(st.sampled_from(doc["param_groups"]))
        name, value = draw(st.sampled_from(
            [("lr", 0.5), ("lr", -1.0), ("lr", "x"), ("betas", [0.5, 0.6]), ("betas", [2, 0]),
             ("betas", "ab"), ("eps", -1.0), ("weight_decay", None), ("amsgrad", True),
             ("params", []), ("params", None), ("custom", 3), ("maximize", True)]))
        g[name] = value
    elif target == "module" and isinstance(doc.get("module"), dict) and doc["module"]:
        name = draw(st.sampled_from(sorted(doc["module"])))
        how = draw(st.sampled_from(["shape", "dtype", "drop", "add"]))
        if how == "shape":
            doc["module"][name]["shape"] = [9]
        elif how == "dtype":
            doc["module"][name]["dtype"] = draw(st.sampled_from(["float16", "int32", "x"]))
        elif how == "drop":
            del doc["module"][name]
        else:
            doc["module"]["extra"] = {"shape": [1], "dtype": "float32"}
    elif target == "client_state":
        doc["client_state"] = draw(st.sampled_from([{"step": 99}, None, [1, 2], "s", 7]))
    return doc


def edit_header(draw, path):
    """One edit of a tensor file's JSON header (the file is rewritten)."""
    data = open(path, "rb").read()
    if len(data) < 8:
        return
    (length,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + length])
    except ValueError:
        return
    if not isinstance(header, dict):
        return
    names = sorted(k for k in header if k != "__metadata__")
    how = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "rename", "metadata",
                                "length"]))
    if names and how in ("dtype", "shape", "offsets", "drop", "rename"):
        name = draw(st.sampled_from(names))
        spec = header[name]
        if how == "dtype":
            spec["dtype"] = draw(st.sampled_from(["F64", "I32", "F16", "BF16", "X", 4]))
        elif how == "shape":
            spec["shape"] = draw(st.sampled_from([[0], [1, 1], [-1], spec["shape"] + [2],
                                                  [2**62, 4]]))
        elif how == "offsets":
            lo, hi = spec["data_offsets"]
            spec["data_offsets"] = draw(st.sampled_from([[lo, hi + 4], [lo + 4, hi], [hi, lo],
                                                         [lo, 2**70], [-4, hi]]))
        elif how == "drop":
            del header[name]
        else:
            header[name + "x"] = header.pop(name)
    elif how == "metadata":
        header["__metadata__"] = draw(st.sampled_from([{"a": 1}, [], "x", {"format": "y"}]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    if how == "length":
        prefix = struct.pack("<Q", draw(st.sampled_from([0, 7, 2**62, 2**64 - 1,
                                                         len(data), length + 8])))
    else:
        prefix = struct.pack("<Q", len(text))
    with open(path, "wb") as f:
        f.write(prefix + (data[8:8 + length] if how == "length" else text) + data[8 + length:])


def difference(a, b, where="index"):
    """Where two JSON documents first differ, for the case's description."""
    if type(a) is not type(b) or not isinstance(a, (dict, list)):
        return None if a == b and type(a) is type(b) else f"{where}: {a!r} -> {b!r}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b), key=repr):
            if key not in a or key not in b:
                return f"{where}.{key}: {a.get(key)!r} -> {b.get(key)!r}"
            found = difference(a[key], b[key], f"{where}.{key}")
            if found:
                return found
    else:
        if len(a) != len(b):
            return f"{where}: {len(a)} -> {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            found = difference(x, y, f"{where}[{i}]")
            if found:
                return found
    return None


@st.composite
def damage(draw, root, two_ranks, foreign_index):
    """Damages the checkpoint copy at root; returns what was done."""
    done = []
    for _ in range(draw(st.integers(1, 3))):
        files = files_in(root)
        how = draw(st.sampled_from(["flip", "flip", "flip_data", "truncate", "extend",
                                    "remove", "index", "index", "index", "header", "header",
                                    "swap", "foreign"]))
        if not files:
            break
        path = draw(st.sampled_from(files))
        size = os.path.getsize(path)
        if how in ("flip", "flip_data") and size:
            ranks = rank_files(root)
            if how == "flip_data" and ranks:
                path = draw(st.sampled_from(ranks))
                size = os.path.getsize(path)
                lo = max(0, size - 2048)
            else:
                lo = 0
            if not size:
                continue
            at = draw(st.integers(lo, size - 1))
            with open(path, "r+b") as f:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ (1 << draw(st.integers(0, 7)))]))
            done.append(f"flip {os.path.basename(path)}@{at}")
        elif how == "truncate":
            os.truncate(path, draw(st.integers(0, max(size - 1, 0))))
            done.append(f"truncate {os.path.basename(path)}")
        elif how == "extend":
            with open(path, "ab") as f:
                f.write(draw(st.binary(min_size=1, max_size=16)))
            done.append(f"extend {os.path.basename(path)}")
        elif how == "remove":
            if draw(st.booleans()):
                os.unlink(path)
            else:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            done.append(f"remove {os.path.basename(path)}")
        elif how == "index" and os.path.exists(os.path.join(root, "index.json")):
            index_path = os.path.join(root, "index.json")
            try:
                doc = json.loads(open(index_path, "rb").read())
            except ValueError:
                continue
            before = copy.deepcopy(doc)
            doc = edit_json(draw, doc)
            with open(index_path, "w") as f:
                json.dump(doc, f)
            done.append(f"edit index: {difference(before, doc)}")
        elif how == "header" and rank_files(root):
            edit_header(draw, draw(st.sampled_from(rank_files(root))))
            done.append("edit header")
        elif how == "swap" and two_ranks and len(rank_files(root)) == 2:
            a, b = rank_files(root)
            data_a, data_b = open(a, "rb").read(), open(b, "rb").read()
            open(a, "wb").write(data_b)
            open(b, "wb").write(data_a)
            done.append("swap rank files")
        elif how == "foreign":
            shutil.copy(foreign_index, os.path.join(root, "index.json"))
            done.append("foreign index")
    return done


# ---- the oracle ------------------------------------------------------------------------------

def without_grads(snap):
    """A checkpoint holds no grads: a load leaves them as they were."""
    return {k: v for k, v in snap.items() if not k.endswith(".grad")}


def as_registered(state, root, names):
    """A's state as the index registers it: a param the index marks as never
    stepped has no optimizer state after the load (a flag no checksum covers).
    names: the params' names in the optimizer's order."""
    doc = json.loads(open(os.path.join(root, "index.json"), "rb").read())
    out = dict(state)
    for b in doc["buckets"]:
        for pos, registered in zip(b["params"], b["registered"]):
            if not registered:
                for key in ("step", "exp_avg", "exp_avg_sq", "master_param"):
                    out.pop(f"{names[pos]}.{key}", None)
    return out


def index_groups(root, groups_before):
    """The param groups a successful load must leave: the index's options."""
    doc = json.loads(open(os.path.join(root, "index.json"), "rb").read())
    out = copy.deepcopy(groups_before)
    for group, saved in zip(out, doc["param_groups"]):
        for key, value in saved.items():
            if key not in ("params", "param_names"):
                group[key] = tuple(value) if isinstance(value, list) else value
    return out, doc.get("client_state")


# Starting two ranks takes longer than a few hundred cases: the default suite
# fuzzes only the one-process checkpoint, `make fuzz` both.
TWO_RANKS = EXAMPLES >= 1000 or os.environ.get("RLHFZ_FUZZ_TWO_RANKS") == "1"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-checkpoints")
    if TWO_RANKS:
        run_ranks(save_two_ranks, 2, str(root / "two"))
    model, opt = build()
    train(model, opt, 0, 3)
    rlhfz.save_checkpoint(root / "one", model, opt, client_state={"step": 3})
    a_one = snapshot(model, opt), group_view(opt)
    train(model, opt, 3, 4)
    rlhfz.save_checkpoint(root / "b", model, opt)
    b = snapshot(model, opt), group_view(opt)
    a_two = None
    if TWO_RANKS:
        rlhfz.load_checkpoint(root / "two", model, opt)
        a_two = snapshot(model, opt), group_view(opt)
    rlhfz.load_checkpoint(root / "one", model, opt)
    assert_same(without_grads(a_one[0]), without_grads(snapshot(model, opt)))
    rlhfz.load_checkpoint(root / "b", model, opt)
    assert_same(b[0], snapshot(model, opt))
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = [by_id[id(p)] for group in opt.param_groups for p in group["params"]]
    return {"root": root, "model": model, "opt": opt, "B": b, "names": names,
            "A": {"one": a_one, "two": a_two}}


def test_fuzz_load_checkpoint(pristine, tmp_path):
    model, opt, root = pristine["model"], pristine["opt"], pristine["root"]
    b_state, b_groups = pristine["B"]
    tally = Tally("load_checkpoint")

    at_b = [True]

    @fuzz_settings()
    @given(data=st.data())
    def case(data):
        if not at_b[0]:          # a failed case left another state: start from B again
            rlhfz.load_checkpoint(root / "b", model, opt)
            for g, saved in zip(opt.param_groups, b_groups):
                g.update(saved)
        at_b[0] = False
        source = data.draw(st.sampled_from(["one", "one", "two"] if TWO_RANKS else ["one"]))
        path = tmp_path / "case"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(root / source, path)
        other = root / ("two" if source == "one" and TWO_RANKS else
                        "b" if source == "one" else "one") / "index.json"
        done = data.draw(damage(str(path), source == "two", str(other)))
        with watchdog():
            kind, value = outcome(lambda: rlhfz.load_checkpoint(path, model, opt),
                                  (rlhfz.CheckpointError,))
        if kind == "raised":
            assert_same(b_state, snapshot(model, opt))
            assert group_view(opt) == b_groups
        else:
            a_state, _ = pristine["A"][source]
            expected = as_registered(without_grads(a_state), path, pristine["names"])
            assert_same(expected, without_grads(snapshot(model, opt)))
            groups, client_state = index_groups(path, b_groups)
            assert group_view(opt) == groups and value == client_state, done
            assert all(hyperparameters_valid(g) for g in opt.param_groups), done
            rlhfz.load_checkpoint(root / "b", model, opt)      # back to B
            for g, saved in zip(opt.param_groups, b_groups):
                for k in set(g) - set(saved) - {"params"}:
                    del g[k]
            assert_same(b_state, snapshot(model, opt))
            assert group_view(opt) == b_groups
        at_b[0] = True
        tally.case("refused" if kind == "raised" else "loaded")

    case()
    tally.report()
