# rlhfz: two commands do all the set-up on a fresh machine.
#   make demo   build, install, and train the demo model with ZeroAdamW beside torch.optim.AdamW
#   make test   build, install, and run the test suite
#   make gpu-check  (on a GPU machine) build, run the GPU tests and benchmarks, print a summary
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# torch is pinned: the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# nvidia-nccl-cu13: the NCCL library the native communicator loads (its tests run without a GPU)
# transformers, trl: stage 3 is tested on GPT-2 and Llama models built from configs, and the
# TRL twin against TRL's own signature; requests: TRL's trainers import it (GRPO/RLOO tests)
DEPS := $(TORCH_PIN) numpy pytest pytest-benchmark hypothesis "setuptools>=64" wheel \
	nvidia-nccl-cu13 transformers trl==1.13.0 requests

.PHONY: deps install demo test bench gpu-check clean

deps:
	$(PIP) install --quiet --disable-pip-version-check $(DEPS)

install: deps
	$(PIP) install --quiet --disable-pip-version-check --no-build-isolation -e .

demo: install
	$(PYTHON) -m rlhfz demo

test: install
	$(PYTHON) -m pytest -q tests

bench: install
	$(PYTHON) -m pytest -q benchmarks --benchmark-columns=min,mean,stddev,rounds \
		--benchmark-group-by=group

# A GPU machine keeps its own CUDA torch (and may have no network): build only.
gpu-check:
	$(PIP) install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
	$(PYTHON) benchmarks/gpu_check.py

clean:
	rm -rf build *.egg-info rlhfz/_C*.so .pytest_cache .benchmarks
