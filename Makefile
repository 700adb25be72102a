# Set-up and checks. Every target creates .venv when missing; torch is pinned by constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP_FLAGS := --disable-pip-version-check -q
PYTEST_WORKERS ?= 4

.PHONY: venv chromium demo test soak fuzz bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test,train]'
	touch $@

venv: $(VENV)/.installed

# Headless Chromium (Debian's package) for the status-page browser test; installs only when missing.
chromium:
	@command -v chromium >/dev/null 2>&1 || { s=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$s apt-get update && $$s apt-get install -y --no-install-recommends chromium; }

demo: venv
	$(PY) examples/demo.py

# pytest exits 5 when it collected no test: make treats any non-zero exit as failure.
test: venv chromium
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "not soak" -q -p no:cacheprovider

soak: venv
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

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
