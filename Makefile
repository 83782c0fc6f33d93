# rlhfz: two commands do all the set-up on a fresh machine.
#   make demo   build, install, and train the demo model with ZeroAdamW beside torch.optim.AdamW
#   make test   build, install, and run the test suite
#   make gpu-check  (on a GPU machine) build, run the GPU benchmarks and tests, write a summary
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch is pinned: the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# nvidia-nccl-cu13: the NCCL library the native communicator loads (its tests run without a GPU)
# transformers, trl: stage 3 is tested on GPT-2 and Llama models built from configs, and the
# TRL twin against TRL's own signature; requests: TRL's trainers import it (GRPO/RLOO tests)
# peft: LoRA at stage 3 (a sharded frozen base under trainable adapters) is tested on PEFT's models
# build: the sdist that make wheel-check builds the wheel from
# pytest-timeout: make gpu-check's limit per test
# ray: examples/ray_rlhf.py, the actor-group layout, runs in the tests on a local cluster
DEPS := $(TORCH_PIN) numpy pytest pytest-benchmark pytest-timeout hypothesis "setuptools>=64" \
	wheel build nvidia-nccl-cu13 transformers trl==1.13.0 requests peft ray

.PHONY: deps install demo test wheel-check sim-deps test-sim test-chaos bench bench-deps gpu-check gpu-sanitize \
	compare structure clean

deps:
	$(PIP) install --quiet --disable-pip-version-check $(DEPS)

install: deps
	$(PIP) install --quiet --disable-pip-version-check --no-build-isolation -e .

demo: install
	$(PYTHON) -m rlhfz demo

test: install
	$(PYTHON) -m pytest -q tests

# What pip users get: sdist -> wheel -> a fresh virtual environment, every
# module imported and the first tests run from outside the tree.
wheel-check: deps
	$(PYTHON) tools/wheel/check.py

# The GPU paths on the simulated CUDA runtime and NCCL stand-in (sim/): built
# with RLHFZ_CUDA=sim into a virtual environment of its own (the production
# build stays untouched), gcov and Python coverage reported.
SIM_DEPS := coverage gcovr
SIM_TESTS ?= tests/test_sim_runtime.py tests/test_cuda_kernels.py tests/test_cuda_lowp_kernels.py \
	tests/test_cuda_buffers.py tests/test_sim_end_to_end.py \
	tests/test_cuda_ops_args.py tests/test_cuda_optim.py tests/test_offload_cuda.py \
	tests/test_cuda_collectives.py tests/test_nccl.py tests/test_nccl_sim.py \
	tests/test_sim_failures.py tests/test_nccl_failures.py
sim-deps: deps
	$(PIP) install --quiet --disable-pip-version-check $(SIM_DEPS) -c constraints.txt

test-sim: sim-deps
	$(PYTHON) tools/sim/run.py --coverage $(SIM_TESTS)

# The device tests once per seed of RLHFZ_SIM_CHAOS (random delays on every
# stream, blocks and threads in random order): a missing wait fails a test.
CHAOS_SEEDS ?= 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20
test-chaos: sim-deps
	$(PYTHON) tools/sim/run.py --chaos-seeds "$(CHAOS_SEEDS)" $(SIM_TESTS)

bench: install
	$(PYTHON) -m pytest -q benchmarks --benchmark-columns=min,mean,stddev,rounds \
		--benchmark-group-by=group

# The optional benchmark peers: DeepSpeed on its CPU accelerator (its CPU Adam
# builds on first use), torchao's and bitsandbytes' 8-bit AdamW, and matplotlib
# for the convergence plot. Without them, what needs them skips and says why.
#   make bench-deps bench
BENCH_DEPS := deepspeed==0.19.8 torchao bitsandbytes matplotlib
bench-deps: deps
	$(PIP) install --quiet --disable-pip-version-check $(BENCH_DEPS) -c constraints.txt

# The speed of this tree against an earlier revision (both built for the CPU),
# every workload of benchmarks/revision_workloads.py in interleaved rounds;
# fails if one runs at under 0.95x the old speed. e.g. make compare REV=ff51111
REV ?= HEAD~1
compare: install
	$(PYTHON) tools/perf/compare_revisions.py $(REV) $(COMPARE_ARGS)

# The layering: import circles, underscore reads across modules, shard splits,
# and circles of C files calling each other (in the objects of the last build).
structure: install
	$(PYTHON) tools/structure/py_structure.py rlhfz
	$(PYTHON) tools/structure/c_calls.py

# A GPU machine keeps its own CUDA torch (and may have no network): build rlhfz in
# place for sm_90 (~20 s), install nothing. Then the benchmarks and the GPU tests,
# each phase under a time limit (about 8 minutes on an H200; gpu_check.py --dry-run
# prints the plan and the limits). Results in GPU_CHECK_OUT: summary.md (for benchmarks/RESULTS.md), one
# archive of the logs, junit XML and benchmark JSON, and the build's log.
#   e.g. make gpu-check GPU_CHECK_OUT="$OUT" GPU_CHECK_ARGS="--no-tests --budget 540"
# make gpu-sanitize: the kernel tests under compute-sanitizer (memcheck, racecheck,
# synccheck), after checking that it works here; exit 2, with the reason, if not.
GPU_CHECK_OUT ?= $(or $(RLHFZ_GPU_CHECK_OUT),build/gpu-check)
GPU_CHECK_ARGS ?=
GPU_BUILD = @mkdir -p "$(GPU_CHECK_OUT)"; \
	echo "building rlhfz in place for sm_90 (log: $(GPU_CHECK_OUT)/build.log)"; \
	RLHFZ_CUDA=1 RLHFZ_CUDA_ARCHS=90 $(PYTHON) setup.py build_ext --inplace \
		> "$(GPU_CHECK_OUT)/build.log" 2>&1 \
		|| { tail -n 60 "$(GPU_CHECK_OUT)/build.log"; echo "the build failed"; exit 1; }

gpu-check:
	$(GPU_BUILD)
	$(PYTHON) benchmarks/gpu_check.py --out "$(GPU_CHECK_OUT)" $(GPU_CHECK_ARGS)

gpu-sanitize:
	$(GPU_BUILD)
	$(PYTHON) benchmarks/gpu_check.py --sanitizer --out "$(GPU_CHECK_OUT)" $(GPU_CHECK_ARGS)

clean:
	rm -rf build *.egg-info rlhfz/_C*.so .pytest_cache .benchmarks

# Fuzz rlhfz's input boundaries (the DLPack importer, load_state_dict,
# load_checkpoint) with 10000 freshly drawn cases per target; the default
# test suite runs 200 fixed ones of each. The draws come from
# RLHFZ_FUZZ_SEED, printed first: set it to replay a run exactly.
.PHONY: fuzz
fuzz: install
	@seed=$${RLHFZ_FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "make fuzz: RLHFZ_FUZZ_SEED=$$seed (set it to replay these draws)"; \
	RLHFZ_FUZZ_SEED=$$seed RLHFZ_FUZZ_EXAMPLES=$${RLHFZ_FUZZ_EXAMPLES:-10000} \
		RLHFZ_FUZZ_RANDOM=$${RLHFZ_FUZZ_RANDOM:-1} $(PYTHON) -m pytest -q -s \
		-p no:cacheprovider tests/test_fuzz_dlpack.py tests/test_fuzz_state.py \
		tests/test_fuzz_checkpoint.py

# The C code under AddressSanitizer + UBSan, or valgrind memcheck (tools/sanitize/run.py).
# Each builds its own rlhfz._C under build/ and fails on any report.
#   make sanitize      the whole CPU suite (long)
#   make sanitize-ci   the C-heavy test files (a few minutes)
#   make valgrind      the kernel, Buffer/DLPack and disk-tier tests under memcheck
SANITIZE_TESTS ?= tests
# one two-rank checkpoint case of three: each takes 1-2 minutes under ASan
SANITIZE_CI_TESTS ?= tests/test_kernels.py tests/test_buffer_dlpack.py tests/test_bad_input.py \
	tests/test_disk_tier.py tests/test_offload.py tests/test_optim_api.py tests/test_checkpoint.py \
	"--deselect=tests/test_checkpoint.py::test_two_ranks_resume_bitwise_and_reshard[mlp-2-dtype0-options0]" \
	"--deselect=tests/test_checkpoint.py::test_two_ranks_resume_bitwise_and_reshard[gpt2-3-dtype2-options2]" \
	--deselect=tests/test_checkpoint.py::test_a_failure_on_one_rank_fails_every_rank_and_changes_nothing
VALGRIND_TESTS ?= tests/test_kernels.py tests/test_buffer_dlpack.py tests/test_disk_tier.py
.PHONY: sanitize sanitize-ci valgrind

sanitize: deps
	bash tools/sanitize/install-clang.sh
	$(PYTHON) tools/sanitize/run.py asan -q $(SANITIZE_TESTS)

sanitize-ci: deps
	bash tools/sanitize/install-clang.sh
	$(PYTHON) tools/sanitize/run.py asan -q $(SANITIZE_CI_TESTS)

valgrind: deps
	$(PYTHON) tools/sanitize/run.py valgrind -q $(VALGRIND_TESTS)

# Long soak: 2,000 offload/reload steps and 500 rounds of each gather_for_generation mode,
# held to under 1% RSS growth after warm-up (the default suite runs a short version).
.PHONY: soak
soak: install
	RLHFZ_SOAK_STEPS=$${RLHFZ_SOAK_STEPS:-2000} RLHFZ_SOAK_CYCLES=$${RLHFZ_SOAK_CYCLES:-500} \
		$(PYTHON) -m pytest -q -s tests/test_soak.py
