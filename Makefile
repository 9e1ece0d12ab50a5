# minillm course: every command uses one virtual environment, .venv, in this folder.
# Needs only python3 (3.11+; the pinned stack does not install on 3.10) and make.
#
#   make venv                create .venv: torch first, then requirements.txt (and the
#                            --no-deps ones: requirements-nodeps.txt), then minillm
#   make course              Jupyter Lab on notebooks/ (NO_BROWSER=1 to not open a browser)
#   make test                ruff + the test suite (against solutions/) + the notebooks
#   make grade CH=01         grade YOUR exercises of chapter 01 (no CH: all chapters)
#   make notebooks NB=02     re-run notebook 02 (no NB: all) and save outputs that read
#                            well unrun (notebooks/save.py)
#   make lint | format       ruff check / ruff fix + format
#   make gpu-check           GPU machine: check the GPU half (own python3; benchmarks/results/)
#   make colab-check NB=06   a fresh Colab runtime, simulated: first cell, then the notebook
#   make clean               delete .venv and caches
#
# GPU machines (Linux x86_64, CUDA 13 driver): see the README's GPU steps; with make it is
#   make venv GPU=1          GPU machine: requirements-gpu.txt instead of requirements.txt
# once, before any other target; the other targets then use that .venv unchanged.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch pin, read from requirements.txt so it is written in one place.
TORCH_REQ := $(shell grep -m1 -E '^torch==' requirements.txt)
# Where torch comes from. Empty: the default index (on Linux x86_64 PyPI's torch is a
# multi-GB CUDA build). For a small CPU-only download set
#     make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# Notebooks open the bundled model offline; HF_HUB_OFFLINE=0 lets them download hub models.
HF_HUB_OFFLINE ?= 1
CH ?=
NOTEBOOKS := $(wildcard notebooks)
REQS := $(if $(GPU),requirements-gpu.txt,requirements.txt)
# Tests: reference solutions, never the network. Triton kernels run compiled on a GPU and
# in Triton's CPU interpreter elsewhere: minillm.kernels decides, before triton is imported.
TEST_ENV := MINILLM_IMPL=solutions HF_HUB_OFFLINE=1

.DEFAULT_GOAL := help
.PHONY: help venv course test grade notebooks lint format clean gpu-check colab-check

help:
	@grep -E '^#   make' Makefile | sed 's/^#   //'

venv: $(STAMP)

# Re-runs only when the requirements files or pyproject.toml change (or .venv is gone).
# torch goes in first, alone, so that nothing else can pull a different build of it.
$(STAMP): $(REQS) requirements-nodeps.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "minillm needs Python 3.11+ ($(PYTHON) is $$($(PYTHON) -V 2>&1)); try make PYTHON=python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "$(TORCH_REQ)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -r $(REQS)
	$(BIN)/python -m pip install --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -e . --no-deps
	touch $@

# Jupyter runs from .venv, so its default kernel is .venv's Python: nothing is registered
# globally.
# As root (containers, some cloud notebooks) Jupyter refuses to start without --allow-root.
course: $(STAMP)
	HF_HUB_OFFLINE=$(HF_HUB_OFFLINE) $(BIN)/jupyter lab notebooks/ $(if $(NO_BROWSER),--no-browser) \
	  $(if $(filter 0,$(shell id -u)),--allow-root)

# One pytest run over tests/ and the notebooks (nbval re-executes each .ipynb, compares only
# cells marked NBVAL_CHECK_OUTPUT), so there is one summary line; the 30 slowest tests and
# notebook cells are listed after it, to show where CI's time goes. Every test and notebook
# runs on one torch thread, so two pytest-xdist workers use both cores of a small machine;
# --dist loadscope keeps a notebook's cells (and a test module's tests) on one worker, in
# order. The notebooks (more than half of the work, up to 6 minutes each) are handed out
# first, in the order given, so that the small test modules fill in at the end and neither
# worker runs a long notebook alone while the other is done. WORKERS=0 runs everything in
# this process (easier to debug).
WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(TEST_ENV) $(BIN)/pytest -q $(NOTEBOOKS) tests --nbval-lax --nbval-current-env \
	  -n $(WORKERS) --dist loadscope --no-loadscope-reorder --durations=30

# A fresh Colab runtime, simulated: a new venv with only what Colab ships (torch, IPython,
# matplotlib, pandas, pytest, tqdm, ipywidgets), google.colab stubbed, a notebook's first
# cell run as written against a clone of this tree, then the notebook top to bottom on the
# CPU. NB=06 (default: 06 08); about 2 minutes of set-up, then each notebook's own time.
colab-check: $(STAMP)
	$(BIN)/python tests/colab_check.py $(or $(NB),06 08)

# The committed outputs: each notebook run top to bottom with the reference solutions, then
# tidied (no widget progress bars, no timestamps) by notebooks/save.py.
notebooks: $(STAMP)
	cd notebooks && $(TEST_ENV) ../$(BIN)/python save.py $(if $(NB),$(NB)_*.ipynb,[0-9][0-9]_*.ipynb)

# Grades exercises/ instead of solutions/; test names carry the chapter (ch01, ch02, ...).
grade: $(STAMP)
	MINILLM_IMPL=exercises HF_HUB_OFFLINE=1 \
	  $(BIN)/pytest tests/exercises $(if $(CH),-k ch$(CH))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The GPU machine's own python3 with the repository on the path: nothing is installed, and a
# part that needs a missing package says "skipped: needs X". GPU_CHECK_ARGS=--cpu runs the tiny
# CPU mode that CI runs (tests/test_gpu_check.py).
GPU_CHECK_ARGS ?=
COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null)
gpu-check:
	MINILLM_COMMIT=$(COMMIT) PYTHONPATH=. PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
