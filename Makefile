# precision-lab: `make reports` runs the main job from nothing, `make test` passes the tests from nothing.
.DEFAULT_GOAL := help
SHELL := /bin/bash

VENV        := .venv
PYTHON      := $(VENV)/bin/python
LAB         := $(VENV)/bin/precision-lab
# torch with the torchvision built for it (the model-zoo tests and examples/torchvision read torchvision's own
# models), a CUDA build that runs on the CPU too; a torch already importable (e.g. your CUDA build) is kept
TORCH_SPEC  ?= torch==2.14.1 torchvision==0.29.1
TORCH_INDEX ?=
PARAMS      ?= params/seed.yaml
KERNEL      := precision-lab

.PHONY: help setup system-deps reports quick lab test bench wheels clean

help: ## show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[1m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(VENV)/.installed ## create .venv, install the package (editable) and register the Jupyter kernel

$(VENV)/.installed: pyproject.toml
	@if [ ! -x $(PYTHON) ]; then \
	  if python3 -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then \
	    echo "keeping the CUDA torch of $$(command -v python3) (venv with system site-packages)"; \
	    python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	$(PYTHON) -m pip install -q --upgrade pip
	@$(PYTHON) -c 'import torch' 2>/dev/null || $(PYTHON) -m pip install -q $(TORCH_INDEX) $(TORCH_SPEC)
	@$(PYTHON) -c 'import torchvision' 2>/dev/null || echo "note: no torchvision beside this torch: the model-zoo \
	  tests are skipped (pip install the torchvision built for your torch)"
	$(PYTHON) -m pip install -q -e ".[test]"
	$(PYTHON) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Python (precision-lab)" >/dev/null
	@touch $@

reports: setup ## run the six notebooks at the seed scale and render reports/latest/index.html
	$(LAB) run --params $(PARAMS)

quick: setup ## the six notebooks at small sizes (params/quick.yaml), for a first look
	$(LAB) run --params params/quick.yaml

# Debian packages the end-to-end tests use: gfortran (examples/fortran), chromium + driver (browser test),
# clang (tinygrad's CPU backend in examples/frameworks)
system-deps: ## install gfortran, clang and headless chromium when missing (needs root and apt-get; else those tests skip)
	@missing=""; \
	command -v gfortran >/dev/null || missing="$$missing gfortran"; \
	command -v clang >/dev/null || missing="$$missing clang"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "note: missing$$missing (not root or no apt-get): the tests that need them will be skipped"; fi; \
	fi

lab: setup ## open the notebooks in JupyterLab (installed into .venv on first use)
	@$(PYTHON) -c 'import jupyterlab' 2>/dev/null || $(PYTHON) -m pip install -q -e ".[lab]"
	$(VENV)/bin/jupyter lab notebooks/

test: setup system-deps ## run the test suite (unit tests, notebooks with quick parameters, end-to-end checks)
	$(PYTHON) -m pytest -q --durations=20

bench: setup ## print the benchmark ratios (float64 reference, cost of a diagnosis, algorithms)
	$(LAB) bench

# what a GPU node with a CUDA torch but no network typically lacks (scripts/gpu-run.sh installs them)
WHEELS         ?= scipy papermill nbconvert nbformat ipykernel mrcfile pyyaml tqdm psutil pytest mpmath<1.4 dask distributed pyarrow onnx
# distributions the node already has: not kept, so its own builds stay (a CUDA torch always brings numpy;
# a fuller image can name more, e.g. WHEELS_PRESENT="numpy pyarrow pandas" to keep .whl/ small)
WHEELS_PRESENT ?= numpy
WHEELS_PYTHON  ?= 3.12
WHEELS_PLATFORM ?= manylinux2014_x86_64

wheels: ## download the wheels a GPU node without network lacks into .whl/ (then: bash scripts/gpu-run.sh test)
	rm -rf .whl && mkdir -p .whl
	$(if $(wildcard $(PYTHON)),$(PYTHON),python3) -m pip download -q --only-binary=:all: --python-version $(WHEELS_PYTHON) --implementation cp \
	  --platform $(WHEELS_PLATFORM) --platform manylinux_2_28_x86_64 --platform linux_x86_64 -d .whl $(foreach w,$(WHEELS),'$(w)')
	@for name in $(WHEELS_PRESENT); do \
	  for f in .whl/*.whl; do \
	    [ "$$(basename "$$f" | cut -d- -f1 | tr 'A-Z-' 'a-z_')" = "$$(echo $$name | tr 'A-Z-' 'a-z_')" ] && rm -f "$$f"; \
	  done; \
	done; true
	@echo "$$(ls .whl/*.whl | wc -l) wheels, $$(du -sh .whl | cut -f1) in .whl/ (the node's own: $(WHEELS_PRESENT))"
	@echo "now copy the project with .whl/ to the node and run: bash scripts/gpu-run.sh test (or reports)"

clean: ## remove the virtual environment and build debris (keeps data/runs and reports)
	rm -rf $(VENV) build *.egg-info
