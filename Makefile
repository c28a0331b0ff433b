# timerwheel — one Makefile for setup, run, test, lint, bench and local Kafka / Redis.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
DATA ?= ./data

.PHONY: setup run demo test test-fast lint bench kafka-up redis-up down clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v $(PY) >/dev/null || { echo "setup: $(PY) not found (Python 3.11 is required)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

## Command 1: the embedded service in the foreground, data in ./data.
run: setup
	$(BIN)/timerwheel run --embedded --data-dir $(DATA)

demo: setup
	$(BIN)/timerwheel demo

## Command 2: the whole suite. Fixtures start Kafka and Redis through scripts/ when needed.
test: setup
	$(BIN)/pytest -q -p no:cacheprovider

test-fast: setup
	$(BIN)/pytest -q -p no:cacheprovider tests

lint: setup
	$(BIN)/ruff check $(wildcard libs tests e2e bench services operator)
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m bench

kafka-up:
	scripts/kafka.sh up

redis-up:
	scripts/redis.sh up

down:
	-scripts/kafka.sh down
	-scripts/redis.sh down
	-TW_KAFKA_INSTANCE=secure scripts/kafka.sh down
	-TW_REDIS_INSTANCE=secure scripts/redis.sh down

clean: down
	rm -rf $(VENV) .run
