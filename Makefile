# worldserve: `make serve` runs the server on the built-in model; `make test` runs every check.
# Both create and fill .venv on first use (and again whenever pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: venv lint test conformance bench serve browser services ts

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build lies on disk; a looser pin pulls a CUDA build.
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[all,dev]'
	touch $@

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy --strict src

serve: venv
	$(BIN)/worldserve serve $(ARGS)

# The browser test drives Debian's Chromium (a test tool's own browser download is never used).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

# The service tests put Debian's nginx in front of two front-ends (tests/test_front_ends.py, worldserve.tools.topology)
# and keep a Ray head's state in Debian's Redis, so that a head can come back (tests/test_front_ends_head_return.py).
services:
	@{ command -v nginx || [ -x /usr/sbin/nginx ]; } >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q nginx-light redis-server; }

# The TypeScript client (clients/ts, @worldserve/client): its locked packages from the npm registry,
# its types generated from docs/protocol.schema.json, its tests (Node's runner) against a real server.
ts: venv
	cd clients/ts && npm ci --no-audit --no-fund --silent && WORLDSERVE_PYTHON=$(abspath $(BIN)/python) npm test --silent

# Three pytest processes on this 2-core box: the suite waits on sockets, subprocesses and a browser much
# of the time (with two it kept 1.3 cores busy: 15:00 against 12:42 with three, every test passing);
# the Ray tests share one of them (xdist group "ray": they use this machine's Ray address file).
test: lint browser services ts
	$(BIN)/pytest -n 3 --dist loadgroup

conformance: venv
	PYTHON=$(BIN)/python bash ../shared/conformance/run

bench: venv
	$(BIN)/python bench/control_plane.py
	$(BIN)/python bench/runtime.py
	$(BIN)/python bench/chunk_parts.py
	$(BIN)/python bench/tinyworld.py
	$(BIN)/python bench/capacity.py
	$(BIN)/python bench/media.py
	$(BIN)/python bench/leads.py
	$(BIN)/python bench/page_latency.py
	$(BIN)/python bench/service.py
