# Every target builds the virtual environment it needs first, so each works on a fresh machine.
# CPU PyTorch comes from the pinned release (no CUDA download); SpikingJelly is installed with
# --no-deps plus the few runtime modules it really imports (see requirements-sj.txt).
PYTHON ?= python3
TORCH ?= torch==2.13.0
SJ2 ?= spikingjelly==2.0.0
SJ14 ?= spikingjelly==0.0.0.0.14
TRAIN_EXTRAS = ninja scikit-learn matplotlib h5py
EXTRAS = ninja pytest hypothesis scikit-learn matplotlib h5py triton==3.9.0 dcls==0.1.1 nir==1.0.8 nirtorch==2.6 onnx==1.23.2 onnxruntime==1.32.0 sphinx==9.0.4 furo==2025.12.19

.PHONY: demo train test test-sj2 test-sj14 bench clean test-zoo docs

# (SpikingJelly goes in after the packages pip resolves, so that pip never meets its unmet requirements.)
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q $(TORCH)
	$(1)/bin/pip install -q -r requirements-sj.txt $(3)
	$(1)/bin/pip install -q --no-deps $(2)
	$(1)/bin/pip install -q --no-deps -e .
	touch $(1)/.ready
endef

.venv-sj2/.ready: setup.cfg requirements-sj.txt Makefile
	$(call make_venv,.venv-sj2,$(SJ2),$(EXTRAS))

.venv-sj14/.ready: setup.cfg requirements-sj.txt Makefile
	$(call make_venv,.venv-sj14,$(SJ14),$(EXTRAS))

# The main job's environment: what it needs and nothing more (no Triton, no test tools).
.venv-train/.ready: setup.cfg requirements-sj.txt Makefile
	$(call make_venv,.venv-train,$(SJ2),$(TRAIN_EXTRAS))

# The main job: the paper's sequential image task on the bundled handwritten digits (autoselected).
train: .venv-train/.ready
	.venv-train/bin/python -m spikingjelly_mfpsn build
	.venv-train/bin/python examples/train_sequential.py --out-dir runs/sequential_digits --overwrite

# A one-minute demo: a SpikingJelly LIF network, its neurons switched to MF-PSN, trained briefly.
demo: .venv-sj2/.ready
	.venv-sj2/bin/python examples/demo.py

# The speed suite (not part of the tests): ratio tables in benchmarks/results/.
bench: .venv-sj2/.ready
	.venv-sj2/bin/python benchmarks/speed_suite.py

# The whole test suite, against SpikingJelly 2.0.0 and 0.0.0.0.14.
test: test-sj2 test-sj14

test-sj2: .venv-sj2/.ready
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 .venv-sj2/bin/python -m pytest -q tests

test-sj14: .venv-sj14/.ready
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 .venv-sj14/bin/python -m pytest -q tests

# The documentation site (warnings are errors), then every Python block of its pages run as a doctest.
docs: .venv-sj2/.ready
	.venv-sj2/bin/python -m sphinx -W --keep-going -q -b html -d build/docs/doctrees docs build/docs/html
	OMP_NUM_THREADS=1 .venv-sj2/bin/python -m sphinx -W --keep-going -q -b doctest -d build/docs/doctrees docs build/docs/doctest

# Every constructor of SpikingJelly's model zoo converted to time-last (the tests take one per family).
test-zoo: .venv-sj2/.ready .venv-sj14/.ready
	OMP_NUM_THREADS=1 .venv-sj2/bin/python -m pytest -q tests/test_zoo.py --zoo=all
	OMP_NUM_THREADS=1 .venv-sj14/bin/python -m pytest -q tests/test_zoo.py --zoo=all

clean:
	rm -rf .venv-sj2 .venv-sj14 .venv-train build/docs
