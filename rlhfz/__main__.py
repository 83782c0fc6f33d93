"""python -m rlhfz demo | bench | estimate | info | consolidate"""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args) -> int:
    import rlhfz
    print(json.dumps(rlhfz.build_info(), indent=2))
    return 0


def _cmd_demo(args) -> int:
    from rlhfz import demo
    try:
        demo.check_run(args.steps, args.batch_size, demo.run_world_size(args.world_size),
                       args.stage)
    except ValueError as error:
        return _usage_error("demo", str(error))
    try:
        demo.run(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                 world_size=args.world_size, stage=args.stage)
    except demo.DemoCheckFailed as error:
        print(f"python -m rlhfz demo: error: {error}", file=sys.stderr)
        return 1
    return 0


# what bench holds per param at once: param, grad and two fp32 moments, and
# the temporary a foreach step makes (measured; one peer at a time)
BENCH_BYTES_PER_PARAM = 24


def _cmd_bench(args) -> int:
    """A quick look at one CPU step; the recorded figures come from benchmarks/."""
    import os

    import torch

    import rlhfz

    n = args.params
    needed = BENCH_BYTES_PER_PARAM * n
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    too_much = (f"--params {n:,} needs about {needed:,} bytes ({BENCH_BYTES_PER_PARAM} per "
                f"param: the param, its grad, two fp32 moments and a step's temporary)")
    if needed > memory:
        return _usage_error("bench", f"{too_much}, more than this machine's {memory:,}")
    # every peer on the same threads, so the rows compare the steps alone;
    # torch's own count comes back after (main() may run inside a program)
    threads, torch_threads = rlhfz.get_num_threads(), torch.get_num_threads()
    torch.set_num_threads(threads)
    print(f"one fp32 AdamW step over {n:,} params, each peer on {threads} threads "
          f"(RLHFZ_NUM_THREADS sets it)")
    try:
        for name in ("rlhfz", "torch_foreach", "torch_fused"):
            try:
                seconds = _time_step(name, n, args.repeat)
            except (MemoryError, RuntimeError) as error:
                if not isinstance(error, MemoryError) and "alloc" not in str(error).lower():
                    raise
                return _usage_error("bench", f"{too_much}; the allocation failed: {error}")
            own = rlhfz.get_num_threads() if name == "rlhfz" else torch.get_num_threads()
            print(f"{name:<14} {seconds * 1e3:8.2f} ms/step  {28 * n / seconds / 1e9:7.2f} "
                  f"GB/s (28 bytes/param moved, {own} threads)")
    finally:
        torch.set_num_threads(torch_threads)
    return 0


def _time_step(name: str, n: int, repeat: int) -> float:
    """Seconds per step of one peer's optimizer on one param of n elements;
    its memory is gone when this returns."""
    import time

    import torch

    import rlhfz
    p = torch.nn.Parameter(torch.randn(n))
    if name == "rlhfz":
        opt = rlhfz.ZeroAdamW([p], lr=1e-3)
    else:
        opt = torch.optim.AdamW([p], lr=1e-3, foreach=name == "torch_foreach",
                                fused=name == "torch_fused" or None)
    p.grad = torch.randn(n)
    opt.step()
    start = time.perf_counter()
    for _ in range(repeat):
        opt.step()
    return (time.perf_counter() - start) / repeat


def _cmd_estimate(args) -> int:
    from rlhfz.estimate import estimate_bytes, format_estimate
    if args.offload_ratio is not None and args.offload is None:
        return _usage_error("estimate", "--offload-ratio is the share of the optimizer state "
                                        "on the host: it needs --offload cpu")
    if args.world_size > 1 and args.stage == 0:
        return _usage_error("estimate", f"stage 0 does not shard, so it has no use for "
                                        f"{args.world_size} ranks: pick stage 1, 2 or 3")
    if args.largest_unit is not None and args.stage != 3:
        return _usage_error("estimate", "--largest-unit is the params of the largest stage-3 "
                                        "unit: it needs --stage 3")
    try:
        result = estimate_bytes(args.params, world_size=args.world_size, stage=args.stage,
                                param_dtype=args.dtype, offload=args.offload,
                                offload_ratio=1.0 if args.offload_ratio is None
                                else args.offload_ratio, bucket_bytes=args.bucket_bytes,
                                state_dtype=args.state_dtype, largest_unit=args.largest_unit)
    except ValueError as error:
        return _usage_error("estimate", str(error))
    print(format_estimate(result, args))
    return 0


def _cmd_consolidate(args) -> int:
    from rlhfz.checkpoint import CheckpointError
    from rlhfz.checkpoint.export import consolidate
    try:
        done = consolidate(args.checkpoint, args.out, dtype=args.dtype)
    except (CheckpointError, OSError) as error:
        print(f"python -m rlhfz consolidate: error: {error}", file=sys.stderr)
        return 1
    print(f"{args.out}: {done['tensors']} tensors, {done['bytes']:,} bytes "
          f"(largest tensor {done['largest']:,} bytes)")
    return 0


def _usage_error(command: str, message: str) -> int:
    print(f"python -m rlhfz {command}: error: {message}", file=sys.stderr)
    return 2


def _parse_count(text: str) -> int:
    """'7e9', '7B', '350M' or a plain integer, at least 1."""
    from rlhfz.engine.numbers import parse_count
    try:
        count = parse_count(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count: write e.g. 7B, 350M, 125000 or 7e9") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a model has at least one parameter")
    return count


def _checked(convert, what: str, ok, rule: str):
    """An argparse type: convert(text), or a message naming what was wrong."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {rule}")
        return value
    return parse


_positive_int = _checked(int, "a whole number", lambda v: v >= 1, "at least 1")
_ratio = _checked(float, "a number", lambda v: 0.0 <= v <= 1.0, "a share between 0 and 1")
_positive_float = _checked(float, "a number", lambda v: 0.0 < v < float("inf"),
                           "a finite number above 0")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhfz", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a small transformer with ZeroAdamW on gloo ranks "
                                       "beside torch.optim.AdamW")
    demo.add_argument("--steps", type=_positive_int, default=300)
    demo.add_argument("--batch-size", type=_positive_int, default=16)
    demo.add_argument("--lr", type=_positive_float, default=3e-3)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--world-size", type=_positive_int, default=2,
                      help="gloo ranks (1: one process)")
    demo.add_argument("--stage", type=int, default=2, choices=(0, 1, 2))
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="time one CPU AdamW step against torch's")
    bench.add_argument("--params", type=_parse_count, default=10_000_000)
    bench.add_argument("--repeat", type=_positive_int, default=10)
    bench.set_defaults(func=_cmd_bench)

    estimate = sub.add_parser("estimate", help="expected per-rank bytes for a model")
    estimate.add_argument("--params", type=_parse_count, required=True,
                          help="parameter count, e.g. 7B or 350M")
    estimate.add_argument("--world-size", type=_positive_int, default=1)
    estimate.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    estimate.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    estimate.add_argument("--offload", default=None, choices=("cpu",))
    estimate.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                          help="how exp_avg and exp_avg_sq are kept (ZeroAdamW's state_dtype)")
    estimate.add_argument("--offload-ratio", type=_ratio, default=None,
                          help="share of the optimizer state on the host (with --offload "
                               "cpu; default 1.0)")
    estimate.add_argument("--bucket-bytes", type=_positive_int, default=None,
                          help="ZeroAdamW's bucket_bytes (stages 2 and 3: the bucket and "
                               "staging cap; default 32 MiB, at most an eighth of the model)")
    estimate.add_argument("--largest-unit", type=_parse_count, default=None,
                          help="stage 3: params of the largest unit (a transformer block, or "
                               "the embedding and head); each grads staging slot is at most "
                               "that, so without it the grads figure is an upper bound")
    estimate.set_defaults(func=_cmd_estimate)

    consolidate = sub.add_parser(
        "consolidate", help="an rlhfz checkpoint (any world size) to a Hugging Face "
                            "safetensors model, one tensor in memory at a time")
    consolidate.add_argument("checkpoint", help="a directory written by rlhfz.save_checkpoint")
    consolidate.add_argument("out", help="the directory for model.safetensors and config.json")
    consolidate.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                             help="cast floating tensors (default: as saved)")
    consolidate.set_defaults(func=_cmd_consolidate)

    info = sub.add_parser("info", help="print build information as JSON")
    info.set_defaults(func=_cmd_info)

    args = parser.parse_args(argv)
    try:
        _check_environment(args.command)
    except ValueError as error:
        return _usage_error(args.command, str(error))
    return args.func(args)


def _check_environment(command: str) -> None:
    """A ValueError naming the variable the command reads that is not valid."""
    if command in ("demo", "bench", "estimate"):         # the commands that build buckets
        from rlhfz.engine.layout import env_bucket_bytes
        env_bucket_bytes()
    if command == "consolidate":                         # progress for what it writes
        from rlhfz.progress import min_bytes
        min_bytes()


if __name__ == "__main__":
    sys.exit(main())
