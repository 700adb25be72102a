# Set-up and checks. Every target creates .venv when missing; torch is pinned by constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP_FLAGS := --disable-pip-version-check -q
PYTEST_WORKERS ?= 3
# Bytecode is written and kept (__pycache__, ignored by git) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): else every agent, server and worker the suite starts compiles our packages again,
# and each pytest worker rewrites every test module (collecting: 18 s a worker, 10 s with it kept).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv chromium deploy-tools netns-tools etcd demo test multihost soak fuzz bench bench-fresh-memory bench-faults bench-scale bench-blip bench-progress \
	bench-leftovers bench-console bench-hangs bench-places bench-node-loss bench-copy-faults bench-copy-speed bench-snapshot-speed bench-common-step bench-framework-restart bench-suspects bench-snapshot-blocking bench-request-path \
	bench-failover bench-first-step gpu-check gpu-hangs bench-gpu-restart test-oldest clean

# `make demo` installs what the demo runs (the package and torch); the test tools and the frameworks (Lightning,
# transformers, accelerate) come with `make test` and every other target.
$(VENV)/.demo-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[train]'
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed pyproject.toml constraints.txt
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test,train,frameworks]'
	touch $@

venv: $(VENV)/.installed

# Headless Chromium (Debian's package) for the status-page browser test; installs only when missing.
chromium:
	@command -v chromium >/dev/null 2>&1 || { s=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$s apt-get update && $$s apt-get install -y --no-install-recommends chromium; }

# nft (Debian's nftables) for the multi-host tests' firewall faults; installs only when missing, and only
# as root: the tests need root for network namespaces and skip, saying so, without it.
netns-tools:
	@[ "$$(id -u)" -ne 0 ] || command -v nft >/dev/null 2>&1 || \
		{ apt-get update && apt-get install -y --no-install-recommends nftables; }

# etcd (Debian's etcd-server) for the replicated-server tests, which start their own clusters on free
# loopback ports; installs only when missing.
etcd:
	@PATH="$$PATH:/usr/sbin:/sbin" command -v etcd >/dev/null 2>&1 || { s=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$s apt-get update && $$s env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends etcd-server; }

demo: $(VENV)/.demo-installed
	$(PY) examples/demo.py

# Debian tools for tests/deploy (a one-machine Slurm, shellcheck, systemd-analyze, sqlite3); installs only
# what is missing. The Python ones (kubectl, hadolint, kubernetes-validate) come with the test extra.
deploy-tools:
	@missing=""; for pair in shellcheck:shellcheck slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client \
		systemd-analyze:systemd sqlite3:sqlite3; do \
		PATH="$$PATH:/usr/sbin:/sbin" command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -n "$$missing" ]; then s=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$s apt-get update && $$s env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; fi

# pytest exits 5 when it collected no test: make treats any non-zero exit as failure. The multi-host
# tests run after the rest, PYTEST_WORKERS at a time: their fault timings (a cut host fenced within the lease
# + 2 s) are what they check, and four workers of other tests beside them on 2 cores stretched those past it.
# Alone they mostly wait (~40 s of CPU in 2 minutes): three at a time took 1:58 against 2:33 two at a time.
# --dist worksteal: a worker that runs out takes queued tests from the others; xdist's default hands each
# worker a fixed first quarter of the suite, whose long end-to-end tests then ran on alone (11:10 -> 8:11).
# --durations: the slowest tests, printed where CI's log shows them (the suite stays under 15 minutes).
XDIST := -n $(PYTEST_WORKERS) --dist worksteal
test: venv chromium deploy-tools netns-tools etcd
	$(PY) -m pytest $(XDIST) -m "not soak and not multihost" -q -p no:cacheprovider --durations=30
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "multihost and not soak" -q -p no:cacheprovider tests/multihost

# The suite (the multi-host tests aside) on the oldest Python and dependency versions pyproject allows
# (constraints-oldest.txt): a floor that is too low breaks a user's install, not ours. Not part of `make test`.
PYTHON_OLDEST ?= python3.10
OLDEST := .venv-oldest
$(OLDEST)/.installed: pyproject.toml constraints.txt constraints-oldest.txt
	@command -v $(PYTHON_OLDEST) >/dev/null 2>&1 && $(PYTHON_OLDEST) -c 'import sys' 2>/dev/null || \
		{ echo "make test-oldest: no $(PYTHON_OLDEST) here; name one with PYTHON_OLDEST=/path/to/python3.10"; exit 1; }
	$(PYTHON_OLDEST) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install $(PIP_FLAGS) -c constraints.txt -c constraints-oldest.txt -e '.[test,train,frameworks]'
	touch $@

test-oldest: $(OLDEST)/.installed chromium deploy-tools netns-tools etcd
	$(OLDEST)/bin/python -m pytest $(XDIST) -m "not soak and not multihost" -q -p no:cacheprovider

# The multi-host tests alone (tests/multihost: hosts as network namespaces, faults on their links).
multihost: venv netns-tools
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "multihost and not soak" -q -p no:cacheprovider tests/multihost

soak: venv netns-tools etcd
	$(PY) -m pytest -m soak -q -p no:cacheprovider -s

# 100,000+ hostile and malformed requests against a real server with a durable store (tests/fuzz/soak.py):
# prints counts by status, RSS and state dir size before/after; exits 1 on any 5xx, hang, crash or state
# change from a refused request. FUZZ_ARGS passes options, e.g. FUZZ_ARGS="--requests 20000 --keep".
fuzz: venv
	$(PY) -m tests.fuzz.soak $(FUZZ_ARGS)

bench: venv
	$(PY) benchmarks/bench_rendezvous.py
	$(PY) benchmarks/bench_recovery.py
	$(PY) benchmarks/bench_elastic.py

# The fault table of docs/benchmarks.md (needs root and network namespaces; about 10 minutes).
bench-faults: venv netns-tools
	$(PY) benchmarks/bench_faults.py --repeat 3

# Fleet scale (issue 14): one job of 100 ... 10,000 simulated nodes, 100 jobs x 1,000, overload; writes
# docs/bench-scale.json and docs/bench-scale-*.png. BENCH_SCALE_ARGS=--quick for a short run, --full for 10 min.
$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test,train,bench]'
	touch $@

bench-scale: venv $(VENV)/.bench-installed
	$(PY) benchmarks/bench_scale.py $(BENCH_SCALE_ARGS)

# A 5 s blip of the server's port (nftables on loopback, root) under 500, 3,000 and 10,000 simulated nodes
# that check the path as the agent does (issue 26): time until every node polls again, the server's stall,
# losses. A fleet over net.core.somaxconn (4,096 by default) needs it raised: see docs/benchmarks.md.
bench-blip: venv netns-tools $(VENV)/.bench-installed
	$(PY) benchmarks/bench_scale.py --nodes 500,3000,10000 --blip 5 --out docs/bench-blip.json $(BENCH_BLIP_ARGS)

# Crash -> every rank training again (issue 22): node-agent cold and warm, torchrun with the plugin, torchrun
# c10d, 2 nodes x 2 real torch DDP workers, interleaved; writes docs/bench-first-step.json and .png (about 10
# minutes). BENCH_FIRST_STEP_ARGS passes options, e.g. "--pairs 5" or "--snapshot-mb 0".
bench-first-step: venv $(VENV)/.bench-installed
	$(PY) benchmarks/bench_first_step.py $(BENCH_FIRST_STEP_ARGS)

# A crash with DataLoader workers alive: multiprocessing's pymp-* directories left in TMPDIR (issue 37).
# BENCH_LEFTOVERS_ARGS passes options, e.g. "--runs 3" or "--code ../old-checkout" (alternated).
bench-leftovers: venv
	$(PY) benchmarks/bench_leftovers.py $(BENCH_LEFTOVERS_ARGS)

# A console nobody reads (issue 44): 2 nodes x 2 gloo workers printing 100 lines a second each for 10 minutes,
# node a's stdout a pipe never read: the job finishes, no lease lost, log files complete, drops counted.
# BENCH_CONSOLE_ARGS passes options, e.g. "--minutes 1".
bench-console: venv
	$(PY) benchmarks/bench_console.py $(BENCH_CONSOLE_ARGS)

# Training progress seen without code changes (issue 39): the probe's cost per step, 20 runs of each certain
# hang case (SIGSTOP, exit 0, a deadlock), a 3x slow node, goodput against the script's own step times and 30 min
# with no false alarm; 2 nodes x 2 gloo workers, writes docs/bench-progress.json (about 75 minutes).
# BENCH_PROGRESS_ARGS replaces the options, e.g. "--runs 3 --cases stop,deadlock" or "--cost".
BENCH_PROGRESS_ARGS ?= --cost --runs 20 --slow --ettr --false-alarm-min 30
bench-progress: venv
	$(PY) benchmarks/bench_progress.py $(BENCH_PROGRESS_ARGS)

# Hang detection that never kills a healthy job (issue 44): legitimate solo work of eight kinds (60 s alone on
# rank 0, twice per job), the ambiguous hangs at --hang-alone-timeout 30, and a 4 x 2 job in long all-gathers;
# writes docs/bench-hangs.json (about 35 minutes). BENCH_HANGS_ARGS replaces the options.
BENCH_HANGS_ARGS ?= --solo http,poll,metrics,torchops,numpy,save,dataloader,eval --ambiguous sleep,spin --runs 3 \
	--gather
bench-hangs: venv
	$(PY) benchmarks/bench_hangs.py $(BENCH_HANGS_ARGS)

# A spare takes a lost node's place (issue 45): who holds which ranks after a lost node, two lost with one spare,
# and how long a running node stands stopped when a second joins; about 5 minutes. BENCH_PLACES_ARGS replaces them.
BENCH_PLACES_ARGS ?= --lost 3 --lost2 3 --scale-up 3
bench-places: venv
	$(PY) benchmarks/bench_places.py $(BENCH_PLACES_ARGS)

# A lost node costs one snapshot (issue 46): 3 x 2 + a spare, the node of group rank 1 SIGKILLed with its memory
# (alternated with a worker crash), its host cut off in network namespaces (root), both peers lost together, and
# the step-time cost of copies (about 15 minutes).
BENCH_NODE_LOSS_ARGS ?= --netns 3 --lost 3 --pair 1 --cost 2
bench-node-loss: venv
	$(PY) benchmarks/bench_node_loss.py $(BENCH_NODE_LOSS_ARGS)

# Issue 53's faults on the snapshot path: an agent restarted under its own id (memory kept, and removed), idle and
# long-lined connections by the thousand, a far-future push, late request lines on busy cores (about 6 minutes).
BENCH_COPY_FAULTS_ARGS ?= --restart 10 --flood 15 --lines --ahead --busy 1000
bench-copy-faults: venv
	$(PY) benchmarks/bench_copy_faults.py $(BENCH_COPY_FAULTS_ARGS)

# Crash -> every rank stepping in Lightning and the HF Trainer, 2 x 2 gloo: from memory, from the framework's own disk
# checkpoint, and warm workers preloading torch only, alternated (about 3 minutes; BENCH_FRAMEWORK_RESTART_ARGS).
bench-framework-restart: venv
	$(PY) benchmarks/bench_framework_restart.py $(BENCH_FRAMEWORK_RESTART_ARGS)

# One peer copy's cost: push and fetch of 64 MiB-1 GiB snapshots over loopback with sha256 (about 1 minute).
bench-copy-speed: venv
	$(PY) benchmarks/bench_copy_speed.py $(BENCH_COPY_SPEED_ARGS)

# Suspect nodes: an exit 16 with a spare, at every try without one, a flipped bit under DDP (about 2 minutes).
bench-suspects: venv
	$(PY) benchmarks/bench_suspects.py $(BENCH_SUSPECTS_ARGS)

# Snapshot write and restore speed at 1 GiB of model + AdamW state, new process per measure, checkouts in
# --roots alternated (BENCH_SNAPSHOT_SPEED_ARGS="--roots /tmp/old,."; about 3 minutes).
bench-snapshot-speed: venv
	$(PY) benchmarks/bench_snapshot_speed.py $(BENCH_SNAPSHOT_SPEED_ARGS)

# How often a node's ranks hold no snapshot step in common while one rank's writes run long, and what they hold
bench-common-step: venv
	$(PY) benchmarks/bench_common_step.py $(BENCH_COMMON_STEP_ARGS)

# What fresh memory costs a CPU restore: torch.empty + copy_ against huge pages and pre-populated mappings
bench-fresh-memory: venv
	for how in empty populate huge huge-populate; do $(PY) benchmarks/fresh_memory.py $$how; done
	THP_MEM_ALLOC_ENABLE=1 $(PY) benchmarks/fresh_memory.py thp-env

# What protect's snapshot holds the training step, against the plain torch.save into memory it replaces
# (alternated), at 32 and 512 MiB of state; BENCH_SNAPSHOT_BLOCKING_ARGS="--device cuda" on a GPU node.
bench-snapshot-blocking: venv
	$(PY) benchmarks/bench_snapshot_blocking.py $(BENCH_SNAPSHOT_BLOCKING_ARGS)

# The files a failure report enters at run time, route to woken agent (BENCH_REQUEST_PATH_ARGS="--roots .,OLD").
bench-request-path: venv
	$(PY) benchmarks/bench_request_path.py $(BENCH_REQUEST_PATH_ARGS)

# Replicas on etcd: failover time with 1,000 simulated agents, acknowledged changes over 50 failovers,
# formation on etcd vs SQLite (docs/benchmarks.md; about 10 minutes).
bench-failover: venv etcd
	$(PY) benchmarks/bench_failover.py

# On a node with an NVIDIA GPU: the built-in GPU check on the real NVML (its time), --numa-binding node, and
# NCCL DDP under node-agent with a crash and the time until it steps again (docs/benchmarks.md). Without a
# GPU it says so and exits 0; not part of `make test`. GPU_PYTHON: a Python with CUDA torch and nvidia-ml-py
# (the venv's torch is the CPU build), e.g. `make gpu-check GPU_PYTHON=/usr/bin/python3`.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/gpu_check.py

# On a node with a GPU: issue 54's restart, crash -> every rank stepping again, one worker per GPU over NCCL,
# 4x Linear(4096) + AdamW (805 MB of state): node-agent with `protect` (memory), node-agent with the script's own
# disk checkpoint, and torchrun beside them, interleaved. Writes docs/bench-gpu-restart.json (about 3 minutes).
GPU_RESTART_ARGS ?= --device cuda --nodes 1 --nproc 1 --width 4096 --steps 40 --crash-step 25 --snapshot-every 10 \
	--disk-every 10 --step-s 0.3 --pairs 2 --snapshot-mb 0 --name bench-gpu-restart \
	--launchers "node-agent (defaults),node-agent (own disk),torchrun c10d"
bench-gpu-restart:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/bench_first_step.py $(GPU_RESTART_ARGS)

# On a node with a GPU: issue 44's hang cases with the model on the GPU (every rank shares GPU 0 over gloo, as a
# node with one GPU can): a rank's long CUDA kernels waited for while the others wait (must not be decided: its
# GPU is busy), an evaluation, a rank stopped, and a deadlock with the GPUs idle. GPU_HANGS_BACKEND=nccl on a
# node with a GPU per rank. Writes docs/bench-hangs-gpu.json (about 4 minutes).
GPU_HANGS_BACKEND ?= gloo
GPU_HANGS_ARGS ?= --solo kernel,eval --solo-s 30 --certain stop,deadlock --runs 1 --out docs/bench-hangs-gpu.json
gpu-hangs:
	DEVICE=cuda BACKEND=$(GPU_HANGS_BACKEND) PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/bench_hangs.py $(GPU_HANGS_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST) *.egg-info .pytest_cache .hypothesis
