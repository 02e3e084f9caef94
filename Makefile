# Every target sets up .venv itself. TORCH picks the torch wheel on a fresh venv (default: the
# CPU build 2.13.0; e.g. `make test TORCH=torch==2.11.0` or a CUDA build); a torch already
# importable in .venv is kept. TRANSFORMERS pins the hf extra to the release the tests were measured on
# (its catalogue of plans changes between releases: docs/models.md); the package itself asks only >=5.24.
# ACCELERATE likewise for the trainer extra (ndparallel.hf.Trainer; the Trainer imports accelerate), TRL for the
# trl extra (TRL's SFTTrainer on ndparallel, docs/fine-tuning.md).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TRANSFORMERS ?= transformers==5.25.0
ACCELERATE ?= accelerate==1.16.0
TRL ?= trl==1.16.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ndparallel-installed
CPU_RANKS ?= 4
# pytest workers (pytest-xdist, one test file each at a time; 0: one process). 3 on 2 cores: the jobs tests wait on
# signals, timeouts and launchers, and a third worker fills those gaps (the whole suite 449 -> 403 s); each worker
# computes with cores / workers threads (tests/conftest.py). docs/architecture.md, "Tests", has the times.
WORKERS ?= 3
XDIST := -n $(WORKERS) --dist loadfile
# pip byte-compiles every file it installs (~27 s of a fresh install, mostly torch's, most never imported);
# --no-compile leaves that to the first import, which caches only what runs, so bytecode writing stays on.
PIP_INSTALL := $(PY) -m pip install -q --no-compile
# Everything but torch goes in with uv, pip-installed into the venv: the same ~110 packages and versions as pip
# picks, in ~5 s instead of ~32 s (docs/architecture.md, "Tests"). torch stays pip's, which reads this machine's
# local wheels, and uv is held to the torch installed. Where uv cannot install, pip does.
UV := uv==0.13.9
DEPS := -e ".[dev,hf,trainer,trl,plot,notebook,tensorboard]" "$(TRANSFORMERS)" "$(ACCELERATE)" "$(TRL)"
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-fast zoo accelerate-examples dryrun-matrix stress bench lint format clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) "$(TORCH)"
	@$(PY) -m uv --version >/dev/null 2>&1 || $(PIP_INSTALL) "$(UV)" || true
	$(PY) -m uv pip install -q --python $(PY) $(DEPS) "torch==$$($(PY) -c 'from importlib.metadata import version; print(version("torch"))')" \
		|| $(PIP_INSTALL) $(DEPS)
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/ndparallel train --config configs/demo.yaml --cpu-ranks $(CPU_RANKS)

# The whole suite on this machine's best CPU kernels, then the kernel-sensitive parity checks (marker
# `capability`: fp32 smoke bounds and two float64 shapes, one file: no workers) again on ATen's portable
# `default` kernels.
# Inductor gets its own cache there: torch 2.13 reuses C++ kernels cached under another capability
# and fails to build them ("'at::vec' has not been declared").
test: $(STAMP)
	env -u ATEN_CPU_CAPABILITY $(PY) -m pytest -q $(XDIST) -m "not zoo and not examples and not matrix"
	ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-cache-default $(PY) -m pytest -q -n 0 -m capability

# The inner loop, exactly a plain `pytest` (pyproject's addopts): everything but the jobs (torchrun launches,
# CLI processes, notebooks, signals: marker `jobs`) and the costliest tests, 10-60 s each (marker `slow`: big
# parity groups, inductor builds), on one xdist worker per core (tests/conftest.py; here a third worker, having no
# waiting jobs to fill, only contends: 128 s with 2, 142 s with 3). PYTEST_XDIST_AUTO_NUM_WORKERS=N picks the count.
test-fast: $(STAMP)
	env -u ATEN_CPU_CAPABILITY $(PY) -m pytest -q

# Breadth sweeps that add no code path of their own (marker `zoo`: every other translated Hugging Face plan
# of the catalogue on tp 2, dp_shard 2, cp 2 and pp 2, ~20 s); docs/models.md records their last result.
zoo: $(STAMP)
	env -u ATEN_CPU_CAPABILITY $(PY) -m pytest -q -m zoo

# Native-crash stress (docs/troubleshooting.md, "Exit-time aborts"): STRESS_ROUNDS rounds of pytest -n 2 on the
# multi-process test groups and STRESS_LAUNCHES real launches (a training script, the transformers Trainer), beside
# a CPU burner; one JSON line a round, then the counts. Any native crash or failed job exits 1.
STRESS_ROUNDS ?= 20
STRESS_LAUNCHES ?= 4
stress: $(STAMP)
	env -u ATEN_CPU_CAPABILITY $(PY) -m tests.stress.run --rounds $(STRESS_ROUNDS) --launches $(STRESS_LAUNCHES)

# Accelerate's own examples (imports renamed, a tiny model and data swapped in) and the tutorial loop on 1, 2 and 4
# CPU ranks, each against Accelerate's run of the same script (marker `examples`; docs/accelerate-migration.md).
accelerate-examples: $(STAMP)
	env -u ATEN_CPU_CAPABILITY $(PY) -m pytest -q -m examples

dryrun-matrix: $(STAMP)  # the planner against the dry run at real sizes (tests/dryrun; minutes to an hour)
	env -u ATEN_CPU_CAPABILITY $(PY) -m pytest -q -n 0 -m matrix tests/dryrun

bench: $(STAMP)
	$(VENV)/bin/ndparallel bench --config benchmarks/scaling.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check ndparallel tests benchmarks examples
	$(VENV)/bin/ruff format --check ndparallel tests benchmarks examples

format: $(STAMP)
	$(VENV)/bin/ruff format ndparallel tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .benchmarks
