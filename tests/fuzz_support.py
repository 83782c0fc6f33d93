"""What the fuzz tests share: how many cases to run, a count of the cases that
really ran, a watchdog that turns a hang into a loud failure, and the one
rule every case obeys (a clean exception of a named family, or success).

RLHFZ_FUZZ_EXAMPLES sets the cases per target (200 by default;
`make fuzz` runs 10000). The default suite draws the same cases every run, so
that CI is repeatable; RLHFZ_FUZZ_RANDOM=1 (which `make fuzz` sets) draws new
ones each time, to explore, from the seed RLHFZ_FUZZ_SEED (make fuzz picks one
and prints it; set it again to replay a failing run exactly)."""
import contextlib
import faulthandler
import os
import sys
import time

from hypothesis import HealthCheck, seed, settings

EXAMPLES = int(os.environ.get("RLHFZ_FUZZ_EXAMPLES", "200"))
RANDOM = os.environ.get("RLHFZ_FUZZ_RANDOM", "0") == "1"
# Fresh draws come from this seed, so that a failure can be replayed.
SEED = (int(os.environ["RLHFZ_FUZZ_SEED"]) if os.environ.get("RLHFZ_FUZZ_SEED")
        else int.from_bytes(os.urandom(4), "little")) if RANDOM else None
# One case takes milliseconds: this much means a hang.
CASE_TIMEOUT_S = float(os.environ.get("RLHFZ_FUZZ_CASE_TIMEOUT", "60"))

# Exceptions that are never a clean refusal: an interpreter-level failure, or
# an allocation sized by the input.
NEVER = (SystemError, MemoryError, RecursionError)


def fuzz_settings(examples=None):
    """Hypothesis settings for a fuzz target, and the seed of a random run."""
    chosen = settings(max_examples=examples or EXAMPLES, deadline=None, database=None,
                      derandomize=not RANDOM, print_blob=True,
                      suppress_health_check=list(HealthCheck))

    def apply(test):
        test = chosen(test)
        return seed(SEED)(test) if SEED is not None else test
    return apply


@contextlib.contextmanager
def watchdog(timeout=CASE_TIMEOUT_S):
    """A case that runs past `timeout` dumps every thread's stack and exits."""
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


class Tally:
    """Cases run, and how they ended, for one target."""

    def __init__(self, target):
        self.target = target
        self.cases = 0
        self.outcomes = {}
        self.started = time.perf_counter()

    def case(self, outcome):
        self.cases += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def report(self, expected=None):
        """Prints the count (make fuzz shows it) and holds it to `expected`."""
        expected = EXAMPLES if expected is None else expected
        seconds = time.perf_counter() - self.started
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items()))
        drawn = f"seed {SEED}" if SEED is not None else "fixed draws"
        line = (f"fuzz {self.target}: {self.cases} cases in {seconds:.1f} s ({kinds}; "
                f"{drawn})")
        print("\n" + line, file=sys.__stdout__, flush=True)
        assert self.cases >= expected, f"{line}: fewer than the {expected} asked for"


def outcome(call, allowed):
    """Runs call(); returns ("ok", result) or ("raised", exception). Anything
    outside `allowed`, or in NEVER, propagates as the test's failure."""
    try:
        return "ok", call()
    except NEVER:
        raise
    except allowed as error:
        return "raised", error
