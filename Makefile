# The two quick-start commands are `make demo` and `make test`; each bootstraps .venv.
# .venv uses the newest Python here that the newest JAX supports (.ci/newest-python: 3.13 or
# 3.12, from PATH or pyenv, else python3), so `make test` runs the whole suite on the newest
# stack (jax 0.12). `make test-oldest` runs the fast lane (every strategy, fit, checkpoints,
# the launcher, RING) on the oldest supported stack (Python 3.11 and the floors pinned in
# .ci/oldest-constraints.txt) in .venv-oldest. .ci/run runs both.
PYTHON ?= $(shell sh .ci/newest-python)
OLDEST_PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
OLDEST := .venv-oldest
# The TPU compiler without a TPU: libtpu, at the release jax[tpu] pins where the package
# index has it (jax 0.12.1 pins 0.0.53.*; 0.0.52 compiles the same topologies), in its own
# environment: libtpu changes JAX's backend discovery, and it allows one process per
# machine at a time (a lockfile), so its lane runs in one process.
TPU := .venv-tpu
LIBTPU ?= libtpu>=0.0.52,<0.0.54
FAKE_DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8
# Two pytest workers on CI's two cores; each worker fakes 8 devices.
WORKERS ?= 2
PYTEST_ARGS ?=
# The oldest stack's lane: what differs between JAX versions (compat shims, collectives,
# host memory, checkpoints, processes), each strategy's parity suite, and fit's trajectories.
OLDEST_LANE ?= tests/test_jax_compat.py tests/test_strategy.py tests/test_train_step.py \
	tests/test_golden_trajectories.py tests/test_model.py tests/test_checkpoint.py \
	tests/test_launch.py tests/test_multi_worker.py tests/test_central_storage.py \
	tests/test_sharded.py tests/test_parameter_server.py tests/test_notebooks.py \
	tests/test_pipeline.py tests/test_batch_region.py tests/test_flax_annotations.py \
	tests/test_keras3_models.py

.PHONY: demo test test-fast test-lane-a test-lane-b test-lane-c test-lane-d test-oldest test-tpu-compile lint bench format clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The demo needs only the library and scikit-learn (the `demo` extra), not the dev set.
$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.demo

$(TPU)/.dev: pyproject.toml
	$(PYTHON) -m venv $(TPU)
	$(TPU)/bin/python -m pip install --quiet --upgrade pip
	$(TPU)/bin/python -m pip install --quiet -e '.[dev]' '$(LIBTPU)'
	touch $@

$(OLDEST)/.dev: pyproject.toml .ci/oldest-constraints.txt
	$(OLDEST_PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST)/bin/python -m pip install --quiet -c .ci/oldest-constraints.txt -e '.[dev]'
	touch $@

# Uses every device; without an accelerator, 8 fake CPU devices (XLA_FLAGS is only read on CPU).
demo: $(VENV)/.demo
	$(FAKE_DEVICES) $(BIN)/python examples/digits.py
	$(FAKE_DEVICES) $(BIN)/python examples/custom_training_loop.py

test: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(WORKERS) -q $(PYTEST_ARGS)

# The quick lane while working: everything but the tests marked `multiprocess` (real worker
# processes, Ray, a notebook kernel, a child Python) and `slow` (single-process tests over
# about 3 s: benchmark smokes, long trajectories, the README, the examples).
test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(WORKERS) -q -m "not multiprocess and not slow" $(PYTEST_ARGS)

# CI splits `make test` in four lanes on its two cores (each under 15 minutes): the
# multi-process and the heaviest numerical files (B), the pipelines, long sequences, memory
# plans, activation placement and the expert axis (C), the parity matrix, the N-D meshes
# (the parallelism spec's combinations) and offload (D), then everything else (A).
LANE_B ?= tests/test_multi_worker.py tests/test_multi_worker_checkpoints.py \
	tests/test_fault_tolerance.py tests/test_custom_training_tutorial.py \
	tests/test_parameter_server.py tests/test_parameter_server_tutorial.py \
	tests/test_ray_backend.py tests/test_launch.py tests/test_rendezvous.py \
	tests/test_losses_metrics_keras.py \
	tests/test_global_batch.py tests/test_remat.py tests/test_batch_region.py \
	tests/test_keras_checkpoints.py tests/test_keras3_models.py \
	tests/test_parity_matrix_sequence.py

LANE_C ?= tests/test_pipeline.py tests/test_pipeline_circular.py tests/test_pipeline_nnx.py \
	tests/test_context_parallel.py tests/test_activation_rows.py tests/test_plan.py \
	tests/test_moe_expert_axis.py tests/test_parity_matrix_spec.py

LANE_D ?= tests/test_parity_matrix.py tests/test_hybrid.py tests/test_offload.py \
	tests/test_parallel_spec.py

test-lane-a: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(WORKERS) -q $(PYTEST_ARGS) \
		$(addprefix --ignore=,$(LANE_B) $(LANE_C) $(LANE_D) $(LANE_TPU))

test-lane-b: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(WORKERS) -q $(PYTEST_ARGS) $(LANE_B)

test-lane-c: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(WORKERS) -q $(PYTEST_ARGS) $(LANE_C)

test-lane-d: $(VENV)/.dev
	$(BIN)/python -m pytest -n $(WORKERS) -q $(PYTEST_ARGS) $(LANE_D)

# Every strategy's train step compiled by the TPU compiler for a v5e 2x4 slice's
# compile-only devices (no TPU): the seed's program under TPUStrategy, the sharded
# strategies, the pipelines, ring attention, offloading (memory kinds kept), the notebooks'
# programs, and a step the compiler refuses for memory. One process: libtpu's lockfile.
LANE_TPU ?= tests/test_tpu_compile.py

test-tpu-compile: $(TPU)/.dev
	JSTRATEGY_TPU_COMPILE_LANE=1 $(TPU)/bin/python -m pytest -n 0 -q -m tpu_compile \
		$(PYTEST_ARGS) $(LANE_TPU)

test-oldest: $(OLDEST)/.dev
	$(OLDEST)/bin/python -m pytest -n $(WORKERS) -q $(PYTEST_ARGS) $(OLDEST_LANE)

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(VENV)/.dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(VENV)/.dev
	$(FAKE_DEVICES) $(BIN)/python benchmarks/overhead.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/input_pipeline.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/fit_throughput.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/fit_cost.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/memory.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/row_counts.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/sharded_step.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/parameter_server.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/tf_custom_loop.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/context_parallel.py
	$(BIN)/python benchmarks/multi_worker.py

$(VENV)/.docs: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

# The site: the README, the guides, the benchmarks, the changelog and the API reference
# (from the docstrings); any Sphinx warning fails it.
docs: $(VENV)/.docs
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "Documentation: docs/_build/html/index.html"

clean:
	rm -rf $(VENV) $(OLDEST) $(TPU) build dist *.egg-info
