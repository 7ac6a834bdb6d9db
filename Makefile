# kvbench front door.  `make bench` and `make test` work as the very first command on a fresh clone.
#
#   make install            venv in .venv, kvbench + test tools, MPI from the mpich wheel
#                           (MPI=site: use the mpirun/libmpi already on PATH instead), and the
#                           engines NIXL, UCX (ucxx) and Mooncake (ENGINES=0: skip them)
#   make bench              the quick suite on 2 ranks of localhost
#   make bench SUITE=name   another suite from suites/ (or a path); NP=4 for 4 ranks
#   make test               the test suite (unit, property, real mpiexec runs)
#   make check              the five-minute tier: every in-process test, one real launch per honesty mechanism
#   make check-mutants      take out each honesty mechanism in turn (MUTANTS=poison,..: some): make check must fail
#   make fuzz               every probe list of tests/probes/ against kvbench's doors, each probe sandboxed (LIST=door,faults: some)
#   make bench-fidelity     every network path and engine, push/pull, bulk/paged, vs plain library references (QUICK=1: a check; CACHE=as-is: caches as each side leaves them; AA=1: the reference against itself, the noise floor)
#   make bench-overlap      exposed time against the model over several prefill/transfer ratios
#   make bench-engines      nixl, ucx, mooncake bulk and hot rows next to the engines' own tools; nixl on 4k/thp pages
#   make bench-underload    (RUNS=20) honest shm,tcp and make bench runs beside two busy loops end OK; liars still caught
#   make bench-connect      connect seconds per peer and in all, per transport, on 2, 4 and 8 ranks (all-pairs)
#   make bench-descriptors  building and coalescing 1M descriptors (80 layers, random blocks): old and new path
#   make soak               thousands of iterations per transport; RSS and open files per rank must not grow
#   make selftest           (root) kvbench's tcp and mpi rates and exposed time against a tc-shaped veth link
#   make lab                (root) a 4-node, 2-rail namespaces lab at RATE (1gbit): rails, incast, bidir, mpi/nixl carriers
#   make bench-codecs       codecs on shm, tcp loopback and (root) a 1 Gbit/s shaped link: measured vs predicted
#   make lint               ruff
#   make procurement        the buyer's sweep (every transport, push/pull, 16-256-token blocks, fp16/fp8, serial/streaming),
#                           then its report and plan in results/runs/<machine>/ (41 min on a 2-core VM; QUICK=1: 5 min)
#   make bench-staged       staged over tcp on torch-cpu pools: the pipeline against pipeline=off
#   make gpu-wheels         (here, with network) the wheels a bare CUDA image lacks, into wheels/gpu/ (~20 MiB)
#   make gpu-check          (a GPU machine, no network) install those wheels, build, then device pools, copy engines,
#                           host<->device, cuda_ipc, staged, real prefill: <= 8 min; DEVICE=cpu: the rehearsal here

PYTHON  ?= python3
VENV    ?= .venv
SUITE   ?= quick
NP      ?= 2
MPI     ?= wheel
ARGS    ?=
ENGINES ?= 1
# torch for the device layer: the CPU build where no CUDA driver loads (docs/pitfalls.md#torch-cpu-build: this pinned version resolves to
# the CPU wheel; an unpinned torch is a multi-GB CUDA build); TORCH_INDEX=<url> picks the index it comes from
TORCH_CPU ?= 2.13.0
TORCH_INDEX ?=
BIN      = $(VENV)/bin
STAMP    = $(VENV)/.kvbench-installed
# what the venv was installed with: a change of MPI or ENGINES re-installs (make install MPI=site after make bench)
CHOICES  = $(VENV)/.kvbench-choices
# the launcher: the venv's (mpich wheel) unless MPI=site or the user names one with MPIRUN=...
MPIRUN  ?= $(if $(filter site,$(MPI)),mpirun,$(BIN)/mpiexec)

.PHONY: FORCE check check-mutants fuzz pyc gpu-check gpu-wheels bench-staged sysdeps benchdeps install bench bench-overlap bench-fidelity bench-engines bench-underload bench-connect bench-descriptors soak selftest lab test lint clean-results help procurement bench-codecs

help:
	@sed -n '2,28p' Makefile

$(CHOICES): FORCE
	@mkdir -p $(VENV); c="MPI=$(MPI) ENGINES=$(ENGINES)"; \
	  [ "$$(cat $@ 2>/dev/null)" = "$$c" ] || { [ ! -e $@ ] || echo "install: $$(cat $@) -> $$c: re-installing"; \
	  echo "$$c" > $@; }

FORCE:

$(STAMP): $(CHOICES) pyproject.toml setup.py kvbench/_native.c kvbench/_codec.c kvbench/_mpicalls.c kvbench/_keyed.c kvbench/_ucx.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	@if [ "$(MPI)" = "site" ]; then \
	  command -v mpirun >/dev/null || { echo "MPI=site but no mpirun on PATH" >&2; exit 1; }; \
	  $(BIN)/python -m pip uninstall -q -y mpich 2>/dev/null; \
	  $(BIN)/python -m pip install -q --force-reinstall --no-cache-dir --no-binary mpi4py mpi4py; \
	  echo "mpi4py built against $$(command -v mpicc || echo 'the MPI on PATH')"; \
	else \
	  $(BIN)/python -m pip install -q mpi4py mpich; \
	  $(BIN)/python -c "import mpi4py.MPI as M; assert 'MPICH' in M.Get_library_version()" 2>/dev/null || \
	  $(BIN)/python -m pip install -q --force-reinstall --no-cache-dir mpi4py; \
	fi
	$(BIN)/python -m pip install -q -e '.[test,report,codecs]'
	@if [ "$(ENGINES)" = "1" ]; then \
	  echo "installing engines: nixl (no deps: no CUDA torch), ucxx, mooncake (non-CUDA build)"; \
	  $(BIN)/python -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 && \
	  $(BIN)/python -m pip install -q ucxx-cu12 mooncake-transfer-engine-non-cuda || \
	  echo "warning: an engine did not install; its rows will say unavailable" >&2; \
	  $(BIN)/python setup.py -q build_ext --inplace >/dev/null 2>&1 || \
	  echo "warning: kvbench._ucx (ucx's one-sided mode, built against ucxx's UCX) did not build; -O mode=tag runs" >&2; \
	fi
	@if $(BIN)/python -c "import ctypes; ctypes.CDLL('libcuda.so.1')" 2>/dev/null; then \
	  x=$$($(BIN)/python -c "import ctypes; v = ctypes.c_int(); ctypes.CDLL('libcuda.so.1').cuDriverGetVersion(ctypes.byref(v)); print('gpu' if v.value >= 13000 else 'gpu-cu12')"); \
	  echo "CUDA driver found: installing kvbench[$$x] (torch, cupy, cuda-bindings)"; \
	  $(BIN)/python -m pip install -q -e ".[$$x]" || echo "warning: kvbench[$$x] did not install" >&2; \
	else \
	  echo "no CUDA driver: installing CPU torch==$(TORCH_CPU) so the device layer's tests run on CPU tensors"; \
	  $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_CPU) cuda-bindings || \
	  echo "warning: torch or cuda-bindings did not install; the device tests will skip" >&2; \
	fi
	@touch $@

install: $(STAMP)

# kvbench's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as in many CI images), every rank of every
# launch would compile kvbench's sources again (a third of a small run's CPU time)
pyc: $(STAMP)
	@$(BIN)/python -m compileall -q kvbench benchmarks tests >/dev/null

bench: pyc benchdeps
	$(MPIRUN) -n $(NP) $(BIN)/kvbench run $(SUITE) $(ARGS)

# exposed time against the model over several P/T ratios (shm, tcp; push, pull; serial, streaming)
bench-overlap: pyc
	$(BIN)/python benchmarks/overlap.py --mpirun $(MPIRUN)

# measurement fidelity: every path's bulk and paged GB/s next to plain library references, ratio per size
bench-fidelity: pyc benchdeps
	$(BIN)/python benchmarks/fidelity.py --mpirun "$(MPIRUN)" $(if $(QUICK),--quick) $(if $(CACHE),--cache $(CACHE)) $(if $(AA),--aa)

# engines vs their own tools: nixl, ucx, mooncake bulk and hot GB/s next to nixl_reference, ucx_perftest,
# transfer_engine_bench; then nixl bulk vs nixl_reference on 4k and thp pages (the same scattered 1 MiB blocks)
bench-engines: pyc benchdeps
	$(BIN)/python benchmarks/engines.py --mpirun "$(MPIRUN)"

# honest runs beside two busy loops end OK (RUNS of shm,tcp -n 8 and of make bench's job), the liars still caught
bench-underload: pyc
	$(BIN)/python benchmarks/underload.py --mpirun "$(MPIRUN)" $(if $(RUNS),--runs $(RUNS))

# the bootstrap storm: each transport's connect against its peers, all-pairs on RANKS (default 2,4,8) ranks here
bench-connect: pyc benchdeps
	$(BIN)/python benchmarks/connect.py --mpirun "$(MPIRUN)" $(if $(RANKS),--ranks $(RANKS))

# control plane: build + coalesce 1M descriptors, sorting per layer (old) vs runs from the block tables (new); < 50 ms
bench-descriptors: pyc
	$(BIN)/python benchmarks/descriptors.py

# leaks: RSS growth after warm-up < 50 MB and unchanged open file descriptors per rank, across transports
soak: pyc benchdeps
	$(BIN)/python benchmarks/soak.py --mpirun $(MPIRUN)

# proof of the timing (needs root): two network namespaces, a veth shaped with tc tbf (RATE, default 1gbit),
# one rank in each; bulk GB/s against iperf3 and the shaped rate, a streaming row against the model
selftest: pyc
	$(BIN)/python -m kvbench.selftest --rate $(or $(RATE),1gbit) $(ARGS)

# the fabric (needs root): a lab of 4 namespaces x 2 rails shaped at RATE; each result as a ratio to that rate
lab: pyc
	$(BIN)/python benchmarks/lab.py --rate $(or $(RATE),1gbit) $(ARGS)

# the buyer's sweep: suites/procurement.yaml (bandwidth) and procurement-overlap.yaml (exposed time), one launch
# each, then `kvbench report` and `kvbench plan` written beside the results; ARGS go to both launches, LABEL (the
# machine in words) heads the report and the plan.  Ctrl-C keeps the finished cases and reports them; the next
# `make procurement` resumes the newest set when it is incomplete, RESUME=<stamp>_procurement.set.json names a set,
# FRESH=1 starts a new one; QUICK=1: a first answer in minutes (llama-3-8b, fp16, 16- and 256-token blocks)
procurement: pyc benchdeps
	$(BIN)/python benchmarks/procurement.py --mpirun $(MPIRUN) --np $(NP) $(if $(ARGS),--kvbench-args "$(ARGS)") \
	  $(if $(LABEL),--label "$(LABEL)") $(if $(RESUME),--resume "$(RESUME)") $(if $(FRESH),--fresh) $(if $(QUICK),--quick)

# Two test files at a time (pytest-xdist, each file whole on one worker: ~25% sooner than one at a time on 2 cores;
# TEST_JOBS=0: one at a time), then the tests marked `alone`, one at a time (times judged against prefills or
# arrival processes measured beside them, liars' leads against the copies beside them, the fault matrix's
# parallel runs).  An honest row's verdicts hold under the other worker's load: its bounds are measured beside it.
# pytest's 5 is "no test selected" (PYTEST_ARGS="-k ..." may pick none of one part).  Bytecode is written for the
# tests even where PYTHONDONTWRITEBYTECODE is set: pytest's rewritten test modules, cached, are not rewritten by
# every pytest process again (~8 s of CPU each)
TEST_JOBS ?= 2
PYTEST = PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q
test: pyc sysdeps
	@rc=0; \
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile -m "not alone" $(PYTEST_ARGS) || rc=$$?; \
	$(PYTEST) -m alone $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	[ $$rc = 5 ] && rc=0; exit $$rc

# The five-minute tier, in the same two parts: every test that starts no process (tests/conftest.py marks them
# inprocess) and the launches marked check: a checked push and pull and conformance on shm and tcp, one liar per
# check (the liar matrix's push and pull launches, the clock, the wake-up and path bounds, the wire count, every
# iteration under -c all), the fault matrix at one phase x stop/kill/raise, the exit path's own deadline
check: pyc sysdeps
	@rc=0; \
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile -m "(inprocess or check) and not alone" $(PYTEST_ARGS) || rc=$$?; \
	$(PYTEST) -m "(inprocess or check) and alone" $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	[ $$rc = 5 ] && rc=0; exit $$rc

# make check against each honesty mechanism taken out, one at a time (tools/mutants.py): the per-iteration check,
# the path bound, the wake-up bound, the exit path's deadline, the poison; exit 0 only when make check failed on each
check-mutants: pyc
	$(BIN)/python tools/mutants.py $(if $(MUTANTS),--only $(MUTANTS))

# The probe lists (tests/probes/<category>.yaml) against kvbench's doors: hostile flags and files, faults at named
# steps, kvbench probe's deadline, kvbench lab's bad arguments, planted links.  Each probe in a mount and pid
# namespace of its own (a private /dev/shm: leftovers are its own), judged on its exit code, its one `kvbench:` line,
# no traceback, its time limit, nothing left behind or written outside its scratch folder (docs/reliability.md)
fuzz: pyc
	$(BIN)/python tools/fuzz $(if $(LIST),--list $(LIST))

# system packages, installed when root with apt-get; otherwise what needs one skips (a test) or reports its row
# unavailable (a bench), naming the package. The benches need libibverbs1 (Mooncake's wheel links it even without
# an RDMA device; not checked where the library is already there or ENGINES=0); the tests also chromium (the report
# page's rendering test), iperf3 and iproute2 (selftest's reference, namespaces and tc), and python3-pyverbs
# (rdma-core's real pyverbs objects, which the verbs tests build against a fake device).
BENCHPKGS ?= libibverbs1
SYSPKGS ?= chromium iperf3 iproute2 python3-pyverbs $(BENCHPKGS)
sysdeps:
	@missing=$$(for p in $(SYSPKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done 2>/dev/null); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing system packages: $$missing"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1; } || \
	  echo "warning: could not install $$missing; what needs them will skip or report unavailable, saying so" >&2; \
	else echo "note: not installed: $$missing (needs root and apt-get); what needs them will skip or report unavailable" >&2; fi

benchdeps:
	@[ "$(ENGINES)" = 0 ] || ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || \
	  $(MAKE) --no-print-directory sysdeps SYSPKGS="$(BENCHPKGS)"

lint: $(STAMP)
	$(BIN)/ruff check kvbench tests tools benchmarks
	$(BIN)/python tools/layout.py --check

clean-results:
	@echo "results are never deleted by make; your runs are in results/runs/ (ignored by git): remove files there by hand if you must"

# codecs on the path: shm, tcp over loopback, tcp over a shaped veth (root; RATE, default 1gbit): effective GB/s
# measured next to the model's prediction and break-even link rates (docs/codecs.md)
bench-codecs: pyc
	$(BIN)/python benchmarks/codecs.py --mpirun $(MPIRUN) --rate $(or $(RATE),1gbit)

# The GPU half on a GPU machine, bare or not (docs/gpu.md#gpu-check): that machine's own python with the packages a
# CUDA image ships, plus the wheels `make gpu-wheels` fetched beforehand where there is a network (pydantic and
# its typing deps; mpich for a launcher: such images have mpi4py but no mpiexec; mpi4py built for that MPICH).  They install with no index into
# .gpucheck/<device>/ (a prefix of their own: the image is not touched); the C extension builds in place; then
# every step runs under its budget.  DEVICE=cpu is the rehearsal here: a fresh venv holding only the image's
# packages that exist for a CPU (GPU_IMAGE_CPU; torch is the CPU build) plus the same wheels folder.
DEVICE        ?= cuda
GPU_WHEELS    ?= wheels/gpu
GPU_PY        ?= 3.12
# mpi4py too: the image's own may be built for another MPI; this pair is the one the tests run
GPU_WHEEL_REQS ?= pydantic==2.14.4 mpich==5.0.2 mpi4py==4.1.2
GPU_IMAGE_CPU ?= numpy pandas pyarrow pyyaml psutil tqdm mpi4py setuptools typing-extensions torch==$(TORCH_CPU)
GPU_PLATFORMS  = --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux2014_x86_64 \
                 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
GPU_PREFIX     = .gpucheck/$(DEVICE)
GPU_VENV       = .gpucheck/venv-cpu

gpu-wheels:
	@mkdir -p $(GPU_WHEELS)
	@for v in $(GPU_PY) $$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); do \
	  echo "gpu-wheels: $(GPU_WHEEL_REQS) and their needs, for Python $$v (manylinux x86_64)"; \
	  $(PYTHON) -m pip download -q --only-binary=:all: --python-version $$v --implementation cp $(GPU_PLATFORMS) \
	    -d $(GPU_WHEELS) $(GPU_WHEEL_REQS) 2>&1 | grep -v "^WARNING: Location" ; \
	  test $${PIPESTATUS[0]:-0} = 0 || exit 1; \
	done
	@kib=$$(du -sk $(GPU_WHEELS) | cut -f1); ls $(GPU_WHEELS); echo "gpu-wheels: $$((kib / 1024)) MiB in $(GPU_WHEELS)"; \
	  test $$kib -le 65536 || { echo "gpu-wheels: over 64 MiB: a device call carries at most that" >&2; exit 1; }

gpu-check: SHELL := /bin/bash
gpu-wheels: SHELL := /bin/bash
gpu-check:
	@test -d $(GPU_WHEELS) || { echo "gpu-check: no $(GPU_WHEELS)/: run make gpu-wheels first, where there is a network" >&2; exit 1; }
	@if [ "$(DEVICE)" = cpu ]; then \
	  echo "gpu-check DEVICE=cpu: a fresh venv with the CUDA image's CPU-installable packages only"; \
	  rm -rf $(GPU_VENV) && $(PYTHON) -m venv $(GPU_VENV) && \
	  $(GPU_VENV)/bin/python -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(GPU_IMAGE_CPU) 2>&1 | \
	    grep -v '^WARNING: Location'; test $${PIPESTATUS[0]} = 0 || exit 1; \
	fi
	@py=$(if $(filter cpu,$(DEVICE)),$(GPU_VENV)/bin/python,$(PYTHON)); t0=$$(date +%s); \
	  rm -rf $(GPU_PREFIX) && \
	  $$py -m pip install -q --no-index --find-links $(GPU_WHEELS) --prefix $(GPU_PREFIX) --ignore-installed \
	    --no-warn-script-location --disable-pip-version-check --root-user-action=ignore $(GPU_WHEEL_REQS) || exit 1; \
	  $$py setup.py -q build_ext --inplace > .gpucheck/build-$(DEVICE).log 2>&1 || \
	    { tail -20 .gpucheck/build-$(DEVICE).log; echo "gpu-check: the C extension did not build" >&2; exit 1; }; \
	  site=$$(find $$PWD/$(GPU_PREFIX) -type d \( -name site-packages -o -name dist-packages \) | head -1); \
	  mpiexec=$$(find $$PWD/$(GPU_PREFIX) -name mpiexec -type f | head -1); libmpi=$$(find $$PWD/$(GPU_PREFIX) -name libmpi.so.12 | head -1); \
	  echo "gpu-check: installed and built in $$(( $$(date +%s) - t0 )) s"; \
	  PYTHONPATH=$$site:$$PWD PATH=$$(dirname $$mpiexec):$$PATH LD_LIBRARY_PATH=$$(dirname $$libmpi)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} \
	  MPI4PY_LIBMPI=$$libmpi PYTHONUNBUFFERED=1 $$py -m kvbench.gpucheck --device $(DEVICE) --mpirun $$mpiexec $(ARGS)

# staged over tcp on torch-cpu pools: the pipeline against -O pipeline=off, alternating launches, per-stage times
bench-staged: pyc
	$(BIN)/python benchmarks/staged.py --mpirun $(MPIRUN) $(ARGS)
