# kvbench front door.  `make bench` and `make test` work as the very first command on a fresh clone.
#
#   make install            venv in .venv, kvbench + test tools, MPI from the mpich wheel
#                           (MPI=site: use the mpirun/libmpi already on PATH instead), and the
#                           engines NIXL, UCX (ucxx) and Mooncake (ENGINES=0: skip them)
#   make bench              the quick suite on 2 ranks of localhost
#   make bench SUITE=name   another suite from suites/ (or a path); NP=4 for 4 ranks
#   make test               the test suite (unit, property, real mpiexec runs)
#   make bench-fidelity     every network path and engine, push/pull, bulk/paged, vs plain library references (QUICK=1: a check)
#   make bench-overlap      exposed time against the model over several prefill/transfer ratios
#   make bench-engines      nixl, ucx, mooncake bulk and hot rows next to the engines' own tools; nixl on 4k/thp pages
#   make bench-descriptors  building and coalescing 1M descriptors (80 layers, random blocks): old and new path
#   make soak               thousands of iterations per transport; RSS and open files per rank must not grow
#   make selftest           (root) kvbench's tcp and mpi rates and exposed time against a tc-shaped veth link
#   make lint               ruff

PYTHON  ?= python3
VENV    ?= .venv
SUITE   ?= quick
NP      ?= 2
MPI     ?= wheel
ARGS    ?=
ENGINES ?= 1
BIN      = $(VENV)/bin
STAMP    = $(VENV)/.kvbench-installed
# the launcher: the venv's (mpich wheel) unless MPI=site or the user names one with MPIRUN=...
MPIRUN  ?= $(if $(filter site,$(MPI)),mpirun,$(BIN)/mpiexec)

.PHONY: install bench bench-overlap bench-fidelity bench-engines bench-descriptors soak selftest test lint clean-results help

help:
	@sed -n '2,16p' Makefile

$(STAMP): pyproject.toml setup.py kvbench/_native.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	@if [ "$(MPI)" = "site" ]; then \
	  command -v mpirun >/dev/null || { echo "MPI=site but no mpirun on PATH" >&2; exit 1; }; \
	  $(BIN)/python -m pip install -q --no-binary mpi4py mpi4py; \
	else \
	  $(BIN)/python -m pip install -q mpi4py mpich; \
	fi
	$(BIN)/python -m pip install -q -e '.[test]'
	@if [ "$(ENGINES)" = "1" ]; then \
	  echo "installing engines: nixl (no deps: no CUDA torch), ucxx, mooncake (non-CUDA build)"; \
	  $(BIN)/python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 && \
	  $(BIN)/python -m pip install -q ucxx-cu12 mooncake-transfer-engine-non-cuda || \
	  echo "warning: an engine did not install; its rows will say unavailable" >&2; \
	fi
	@touch $@

install: $(STAMP)

bench: $(STAMP)
	$(MPIRUN) -n $(NP) $(BIN)/kvbench run $(SUITE) $(ARGS)

# exposed time against the model over several P/T ratios (shm, tcp; push, pull; serial, streaming)
bench-overlap: $(STAMP)
	$(BIN)/python benchmarks/overlap.py --mpirun $(MPIRUN)

# measurement fidelity: tcp and mpi bulk GB/s next to plain socket / mpi4py references, ratio per size
bench-fidelity: $(STAMP)
	$(BIN)/python benchmarks/fidelity.py --mpirun $(MPIRUN) $(if $(QUICK),--quick)

# engines vs their own tools: nixl, ucx, mooncake bulk and hot GB/s next to nixl_reference, ucx_perftest,
# transfer_engine_bench; then nixl bulk vs nixl_reference on 4k and thp pages (the same scattered 1 MiB blocks)
bench-engines: $(STAMP)
	$(BIN)/python benchmarks/engines.py --mpirun $(MPIRUN)

# control plane: build + coalesce 1M descriptors, sorting per layer (old) vs runs from the block tables (new); < 50 ms
bench-descriptors: $(STAMP)
	$(BIN)/python benchmarks/descriptors.py

# leaks: RSS growth after warm-up < 50 MB and unchanged open file descriptors per rank, across transports
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py --mpirun $(MPIRUN)

# proof of the timing (needs root): two network namespaces, a veth shaped with tc tbf (RATE, default 1gbit),
# one rank in each; bulk GB/s against iperf3 and the shaped rate, a streaming row against the model
selftest: $(STAMP)
	$(BIN)/python -m kvbench.selftest --rate $(or $(RATE),1gbit) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check kvbench tests

clean-results:
	@echo "results are never deleted by make; remove results/<machine>/ files by hand if you must"
