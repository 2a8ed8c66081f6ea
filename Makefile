# The two quick-start commands are `make demo` and `make test`; each bootstraps .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FAKE_DEVICES := XLA_FLAGS=--xla_force_host_platform_device_count=8
# Two pytest workers on CI's two cores; each worker fakes 8 devices.
WORKERS ?= 2

.PHONY: demo test lint bench format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Uses every device; without an accelerator, 8 fake CPU devices (XLA_FLAGS is only read on CPU).
demo: $(STAMP)
	$(FAKE_DEVICES) $(BIN)/python examples/digits.py
	$(FAKE_DEVICES) $(BIN)/python examples/custom_training_loop.py

test: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(FAKE_DEVICES) $(BIN)/python benchmarks/overhead.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/input_pipeline.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/fit_throughput.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/memory.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/row_counts.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/sharded_step.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/parameter_server.py
	$(FAKE_DEVICES) $(BIN)/python benchmarks/tf_custom_loop.py
	$(BIN)/python benchmarks/multi_worker.py

clean:
	rm -rf $(VENV) build *.egg-info
