# timerwheel — one Makefile for setup, run, test, lint, bench and local Kafka / Redis.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
DATA ?= ./data

.PHONY: setup setup-spark run demo test test-fast test-k8s lint docs bench kafka-up redis-up k8s-up k8s-down k8s-image spark-image down clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v $(PY) >/dev/null || { echo "setup: $(PY) not found (Python 3.11 is required)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

## The Spark jobs' extra (PySpark, ~450 MB) and Spark's Kafka connector (scripts/spark.sh, cached in
## ~/.cache/timerwheel/spark or $$TW_CACHE_DIR): make test and make bench need them, make run does not.
setup-spark: $(VENV)/.spark-installed

$(VENV)/.spark-installed: $(VENV)/.installed scripts/spark/pom.xml
	$(BIN)/pip install -q -e '.[dev,spark]'
	PYTHON=$(BIN)/python scripts/spark.sh fetch
	@touch $@

## Command 1: the embedded service in the foreground, data in ./data.
run: setup
	$(BIN)/timerwheel run --embedded --data-dir $(DATA)

demo: setup
	$(BIN)/timerwheel demo

## Command 2: the whole suite. Fixtures start Kafka and Redis through scripts/ when needed.
test: setup-spark
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
k8s-up:
	scripts/k8s.sh up
	scripts/k8s.sh load-image
	@scripts/k8s.sh env

k8s-image:
	scripts/k8s.sh load-image

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
	-TW_REDIS_INSTANCE=secure scripts/redis.sh down

clean: down
	rm -rf $(VENV) .run
