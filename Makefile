# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: setup demo test lint typecheck unit unit-elsewhere docs bench bench-hooks bench-lr bench-lr-hard bench-dead-relu bench-spike bench-spike-healthy bench-big bench-stall-zoo bench-matrix bench-onset bench-real bench-every-arch bench-buffers screenshots test-floor clean

setup: $(STAMP)

# CPU torch comes from the pinned local wheel; an unpinned torch would drag in a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# PNGs of the TensorBoard dashboard from a fresh demo run into docs/img/ (needs Debian's chromium and chromium-driver).
screenshots: demo
	$(PY) tests/scripts/screenshots.py --runs runs --out docs/img

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_gradguard tests examples benchmarks
	$(VENV)/bin/ruff format --check lightning_gradguard tests examples benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# One pytest-xdist worker per core (at most 4), each on one torch thread (tests/conftest.py). An
# OMP_NUM_THREADS of the caller's wins, and then the workers share the cores: cores / threads of them,
# at least one (two workers of two threads on 2 cores took 14 min against 5; nproc would count the
# threads as the cores). worksteal: an idle worker takes the other's queued tests.
WORKERS ?= $(shell n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2); \
	t=$${OMP_NUM_THREADS:-1}; [ "$$t" -ge 1 ] 2>/dev/null || t=1; w=$$(( n / t )); \
	echo $$(( w < 1 ? 1 : (w < 4 ? w : 4) )))
unit: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal

# lint and typecheck beside the unit tests: mypy's cold start (a fresh clone) keeps one core busy for a
# minute or more. Their few lines may land among pytest's progress dots; each job's failure fails the make.
test: $(STAMP)
	$(MAKE) --no-print-directory -j3 lint typecheck unit

# The unit tests again, with this machine rounding like another one (tests/machine/other_machine.py): two
# threads (`make unit` runs one per worker: the other reduction order), other float kernels, AVX2 where
# the CPU has it, every drawn weight moved by 1e-5; in one process (two threads each in two workers would
# oversubscribe 2 cores). A test that holds only on this CPU's rounding fails here before it fails for a
# user (.ci/run runs it after `make test`).
unit-elsewhere: $(STAMP)
	env OMP_NUM_THREADS=2 GRADGUARD_TEST_PERTURB=rounding,kernels GRADGUARD_TEST_ROUNDING_SEED=1 \
	GRADGUARD_TEST_ROUNDING_SCALE=1e-5 TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d) \
	$$(grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo ATEN_CPU_CAPABILITY=avx2) \
	$(PY) -m pytest -q -p no:cacheprovider

# The dependency floor we claim (pyproject.toml), run for real: by hand or before a release, not in
# `make test` or .ci/run. A venv of its own (.venv-floor-low; FLOOR=mid: .venv-floor-mid) with the lowest
# torch, Lightning, torchmetrics and tensorboard we claim and whatever numpy and protobuf pip picks today
# (mid: torch 2.6 + lightning 2.5, tensorboard 2.18 and our numpy floor), this package with its dev extra
# on top (the pins held), then: the README's main job and every example (exit 0, no warning printed),
# `gradguard report`, TensorBoard's GradGuard dashboard (tests/scripts/floor_check.py), and the unit
# tests (a test that needs a newer release or torch 2.13's random draws is skipped with its reason:
# tests/floor.py). The registry's torch wheels before 2.13 are CUDA builds: a few GB to download the
# first time. transformers 5 turns its models off below torch 2.6: the low floor takes transformers 4.
FLOOR ?= low
FLOOR_PINS_low := torch==2.3.1 lightning==2.4.0 torchmetrics==1.3.2 tensorboard==2.17.1 "transformers<5"
FLOOR_PINS_mid := torch==2.6.0 lightning==2.5.0 torchmetrics==1.3.2 tensorboard==2.18.0 numpy==1.26.4
FLOOR_VENV := .venv-floor-$(FLOOR)
FLOOR_PY := $(FLOOR_VENV)/bin/python
test-floor:
	test -n '$(FLOOR_PINS_$(FLOOR))' || { echo "FLOOR=low or FLOOR=mid"; exit 2; }
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	printf '%s\n' $(FLOOR_PINS_$(FLOOR)) > $(FLOOR_VENV)/pins.txt
	$(FLOOR_PY) -m pip install --quiet --upgrade pip
	$(FLOOR_PY) -m pip install --quiet -c $(FLOOR_VENV)/pins.txt $(FLOOR_PINS_$(FLOOR)) -e ".[dev]"
	rm -rf $(FLOOR_VENV)/scratch
	$(FLOOR_PY) tests/scripts/floor_check.py $(FLOOR_VENV)/scratch
	$(FLOOR_PY) -m pytest -q -n $(WORKERS) --dist worksteal -p no:cacheprovider

# The docs extra (mkdocs, material, mkdocstrings) has its own stamp: `make test` does not need it.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PIP) install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

# The site, into site/; strict: a broken link or anchor, a page outside the nav, a missing reference fails.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Per-step overhead of every callback against bare Lightning (about 10 minutes on 2 idle cores).
bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# The Python calls and aten ops inside our hooks per step, and their time against the floor (about 4 minutes).
bench-hooks: $(STAMP)
	cd benchmarks && ../$(PY) hooks.py

# LRFinderPlus against Lightning's lr_find on real sklearn tasks (suggestion quality and wall time), then the hard tasks.
bench-lr: $(STAMP)
	$(PY) benchmarks/lr_finder.py
	$(MAKE) bench-lr-hard

# LRFinderPlus (with and without its search), Lightning's lr_find and torch-lr-finder on the 68 hard tasks of all thirteen
# sets, each finder on six seeds, scored against a brute-force LR grid of three (about three hours with a cold grid
# cache, benchmarks/.lr_hard_grid.json, on a 2-core machine; with a warm cache our two finders still run, and the
# trainings at their new suggestions: about 40 minutes).
# torch-lr-finder is installed with --no-deps: a benchmark-only comparison, never a dependency of ours.
bench-lr-hard: $(STAMP)
	$(PIP) install --quiet --no-deps torch-lr-finder==0.2.2
	$(PY) benchmarks/lr_hard.py --set all --finder-seeds 6 --real

# A DeadReLUMonitor sampled step against a plain step.
bench-dead-relu: $(STAMP)
	$(PY) benchmarks/dead_relu_step.py

# LossSpikeGuard on injected spikes and healthy runs (detection, false alarms, final loss; about 3 minutes).
bench-spike: $(STAMP)
	$(PY) benchmarks/loss_spike.py

# LossSpikeGuard at its defaults on healthy runs of several kinds: skips and rollbacks (false interventions), and the early-divergence margins (about 4 minutes).
bench-spike-healthy: $(STAMP)
	$(PY) benchmarks/spike_healthy.py

# Diagnosis at onset: faults against their fixed twins, all eight training monitors at defaults; delay and cause named (about 20 s).
bench-onset: $(STAMP)
	$(PY) benchmarks/onset_zoo.py

# Real transformers architectures (small configs, random init) trained with their families' recipes: healthy runs, faults against their twins, the pre-flight checks (about 13 minutes on 1 thread).
bench-real: $(STAMP)
	$(PY) benchmarks/real_models.py --preflight --markdown

# Every model class transformers ships for six task families (causal LM, seq2seq, sequence classification,
# masked LM, image and audio classification), each from a config shrunk automatically and trained 40 steps
# at its family's recipe with every monitor and the pre-flight pair at their defaults, plus Muon, Adafactor,
# Lion, schedule-free AdamW and manual optimization: the table of docs/benchmarks.md (about an hour on 1 thread).
bench-every-arch: $(STAMP)
	$(PY) benchmarks/every_arch.py --markdown --json every_arch.json

# What keeping the buffers a step's forward writes costs per step, on a BatchNorm ResNet (about 1 minute).
bench-buffers: $(STAMP)
	$(PY) benchmarks/buffers.py

# The stalled-learning scenarios: every fault against its fixed twin, and the healthy runs (3 seeds, about 2 minutes).
bench-stall-zoo: $(STAMP)
	$(PY) benchmarks/stall_zoo.py --twins

# Every callback across the Trainer configurations users run, against the unwatched run (about 2 minutes).
bench-matrix: $(STAMP)
	cd benchmarks && ../$(PY) matrix.py

# Every monitor on a GPT-2-small-sized model (124 M parameters): step time, peak memory, tags, event-file growth.
bench-big: $(STAMP)
	$(PY) benchmarks/big_model.py

clean:
	rm -rf $(VENV) .venv-floor-* runs site .pytest_cache .mypy_cache .ruff_cache
