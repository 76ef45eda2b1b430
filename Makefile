# The two commands: `make demo` runs the whole job on embedded defaults, `make test` the tests.
# Both create .venv and install what they need. torch goes in first, pinned to the CPU build
# (set TORCH=... on a GPU machine), so that no resolver pulls a CUDA torch onto a CPU machine.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
WORK ?= demo-work
DEMO_ARGS ?= --dataset synthetic --synthetic-users 3000 --workers 2 --epochs 12
# test processes (pytest-xdist, work stealing): the interpreted Triton tests are single-threaded Python
TEST_WORKERS ?= 2

.PHONY: demo test install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: install
	$(BIN)/hstu run --work-dir $(WORK) $(DEMO_ARGS)

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

clean:
	rm -rf $(VENV) $(WORK)
