# timerwheel — one Makefile for setup, run, test, lint, bench and local Kafka / Redis.

## Any Python 3.11 or newer: PYTHON=/path/to/python picks one (PY, its former name, still works);
## else the first of python3.14 ... python3.11, python3 on PATH that is 3.11 or newer.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(or $(PY),$(shell for p in python3.14 python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && \
	{ command -v $$p; break; }; done))
endif
VENV := .venv
BIN := $(VENV)/bin
DATA ?= ./data
## pip, quiet, without setuptools' boxed notice about editable installs (the checkout is the package).
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q

.PHONY: setup setup-run assets setup-spark run demo test test-fast test-k8s lint docs bench kafka-up redis-up k8s-up k8s-down k8s-image image spark-image down clean

## What running needs (make run, make demo, the production quick start): timerwheel and its
## dependencies, ~160 MB. make setup adds the developer extras (tests, lint, the operator's
## Kubernetes clients: ~410 MB more); make test and make lint add PySpark too.
setup-run: $(VENV)/.run-installed

setup: $(VENV)/.installed

## The console's browser libraries (uPlot), fetched with npm into ~/.cache/timerwheel/npm and copied
## into libs/timerwheel/console/static/vendor/ (scripts/assets.sh; cached, integrity-checked): make
## test, bench and the image need them; make run does not (the console then draws no charts).
assets:
	@scripts/assets.sh fetch

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "setup: no Python 3.11 or newer on PATH (looked for python3.14 ... python3.11 and python3): install one, or name it with PYTHON=/path/to/python3 (e.g. make run PYTHON=/opt/python3.12/bin/python3)" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup: PYTHON=$(PYTHON) is $$($(PYTHON) -V 2>&1), not Python 3.11 or newer" >&2; exit 1; }
	@echo "setup: making $(VENV) with $(PYTHON) ($$($(PYTHON) -V 2>&1))"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip

$(VENV)/.run-installed: pyproject.toml | $(BIN)/python
	@echo "setup: installing timerwheel and what it needs to run into $(VENV) (~160 MB; a minute the first time)"
	@$(PIP) -e .
	@touch $@

$(VENV)/.installed: $(VENV)/.run-installed pyproject.toml
	@echo "setup: adding the developer extras to $(VENV): tests, lint, the operator's Kubernetes clients (~410 MB)"
	@$(PIP) -e '.[dev]'
	@touch $@

## The Spark jobs' extra (PySpark, ~450 MB) and Spark's Kafka connector (scripts/spark.sh, cached in
## ~/.cache/timerwheel/spark or $$TW_CACHE_DIR): make test and make bench need them, make run does not.
setup-spark: $(VENV)/.spark-installed assets

$(VENV)/.spark-installed: $(VENV)/.installed scripts/spark/pom.xml
	@echo "setup: adding PySpark and the Spark jobs' extras to $(VENV) (~450 MB)"
	@$(PIP) -e '.[dev,spark]'
	PYTHON=$(BIN)/python scripts/spark.sh fetch
	@touch $@

## Command 1: the embedded service in the foreground, data in ./data.
run: setup-run
	$(BIN)/timerwheel run --embedded --data-dir $(DATA)

demo: setup-run
	$(BIN)/timerwheel demo

## Command 2: the whole suite. Fixtures start Kafka and Redis through scripts/ when needed.
test: setup-spark
	scripts/prebuild.sh --background  # helm, Prometheus, the registry, Kubernetes: built while the first tests run
	$(BIN)/pytest -q -p no:cacheprovider

test-fast: setup-spark
	$(BIN)/pytest -q -p no:cacheprovider tests

## The tests on the real local Kubernetes cluster only (the first run builds it: ~30 min).
test-k8s: setup
	$(BIN)/pytest -q -p no:cacheprovider -m k8s e2e

lint: setup-spark
	$(BIN)/ruff check $(wildcard libs tests e2e bench services operator)
	$(BIN)/mypy

## The reference tables of docs/ written from the code's tables (tests/test_docs.py checks them).
docs: setup
	$(BIN)/python -m timerwheel.docs

bench: setup-spark
	$(BIN)/python -m bench

kafka-up:
	scripts/kafka.sh up

redis-up:
	scripts/redis.sh up

## A single-node Kubernetes v1.34 cluster on this machine (scripts/k8s.sh; builds cached in
## ~/.cache/timerwheel or $$TW_CACHE_DIR), with the timerwheel:dev image loaded.
k8s-up: assets
	scripts/k8s.sh up
	scripts/k8s.sh load-image
	@scripts/k8s.sh env

k8s-image: assets
	scripts/k8s.sh load-image

## The image of the operator and the stages (services/Dockerfile) as an OCI archive,
## dist/timerwheel-<appVersion>.oci.tar, built without Docker by scripts/image.py (root; Debian's
## debootstrap, umoci and skopeo; layers cached in ~/.cache/timerwheel/image). Push it to your
## registry with skopeo and install the chart with image.repository (docs/helm.md, "The image").
IMAGE_VERSION := $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*/\1/p' charts/timerwheel/Chart.yaml)
image:
	python3 scripts/image.py build --tag timerwheel:$(IMAGE_VERSION) --oci-archive dist/timerwheel-$(IMAGE_VERSION).oci.tar

## The Spark image (services/spark/Dockerfile: the stage package plus Java 17, PySpark and Spark's
## Kafka connector) as timerwheel-spark:dev, built without Docker by scripts/image.py (layers cached
## in ~/.cache/timerwheel/image or $$TW_CACHE_DIR); prints the docker-archive's path.
spark-image:
	python3 scripts/image.py build --dockerfile services/spark/Dockerfile --tag timerwheel-spark:dev

k8s-down:
	scripts/k8s.sh down

down:
	-scripts/k8s.sh down
	-scripts/kafka.sh down
	-scripts/redis.sh down
	-TW_KAFKA_INSTANCE=secure scripts/kafka.sh down
	-TW_KAFKA_INSTANCE=noauto scripts/kafka.sh down
	-TW_REDIS_INSTANCE=secure scripts/redis.sh down

clean: down
	rm -rf $(VENV) .run
