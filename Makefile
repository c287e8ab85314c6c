# The two commands of the README: `make demo` (set up, then the main job) and `make test`.
VENV ?= .venv
CLUSTER_DIR ?= /tmp/kvfleet-cluster
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: setup demo demo-offline test lint unit cluster-bins prom-bins cluster-test bench cluster-up cluster-down clean

# The CPU C++ ops are built here (cached by version outside the repo), not when an engine first needs them.
setup: $(STAMP)
	$(PY) -m kvfleet_kernels.build_cpu

# Reinstalls only when pyproject.toml changes; pip's own cache (outside the repo) serves the wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# The full demo: local control plane, operator, an InferenceDeployment, agents answering. `make cluster-down` ends it.
demo: setup
	bash e2e/build.sh >/dev/null
	$(PY) e2e/demo.py --run-dir $(CLUSTER_DIR)

# The runtime alone, offline: a tiny checkpoint, four prompts, no cluster.
demo-offline: setup
	$(VENV)/bin/kvfleet-agent demo

lint: setup
	@test ! -e operator/__init__.py || { echo "operator/__init__.py must not exist: it shadows the standard library's operator module"; exit 1; }
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	cd e2e && $(abspath $(VENV))/bin/mypy --strict *.py  # not a package: its own run

unit: setup prom-bins
	$(PY) -m pytest -q

# The control-plane binaries (and kubectl), built once: about 10 min cold, cached by version outside the repo; and
# helm (about 4 min cold), for the chart's tests.
cluster-bins:
	bash e2e/build.sh >/dev/null
	bash e2e/build_helm.sh >/dev/null

# Prometheus and promtool (Debian's package, unpacked into a version-keyed cache; no service): the observability tests.
prom-bins:
	bash e2e/prometheus.sh >/dev/null

# The cluster tier: e2e/ against a real API server, with the process kubelet running real agents.
cluster-test: setup cluster-bins
	$(PY) -m pytest e2e -m cluster -q -p no:cacheprovider

# Binaries before the unit tests: the kustomize and Helm rendering tests use the kubectl and helm built with them.
test: lint cluster-bins prom-bins unit cluster-test

bench: setup
	$(PY) ../shared/bench/compare_throughput.py

# A local Kubernetes control plane with fake GPU nodes (binaries built once from the Go module proxy).
cluster-up: setup
	bash e2e/build.sh >/dev/null
	$(PY) e2e/cluster.py up --run-dir $(CLUSTER_DIR)

cluster-down:
	$(PY) e2e/cluster.py down --run-dir $(CLUSTER_DIR)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
