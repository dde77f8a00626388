# `make train` and `make test` do all set-up on a fresh machine: a .venv with requirements.txt (and for
# `make test` requirements-test.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

install: $(VENV)/.installed

# the tests also exercise optional features (LoRA needs peft): their packages, for make test only
$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

# Stockfish scores the chess policy task; Debian puts it at /usr/games/stockfish.
stockfish:
	@command -v stockfish >/dev/null || test -x /usr/games/stockfish || \
	  (apt-get update -qq && apt-get install -y -qq stockfish) || \
	  echo "could not install stockfish (needs root): chess-policy tests will skip"

# The benchmark's peer (TRL) lives in its own venv, never in .venv; torch stays at the pin.
.venv-bench/.installed: requirements.txt requirements-bench.txt
	$(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q -r requirements-bench.txt
	touch $@

bench: install .venv-bench/.installed
	$(PY) bench/run.py --trl-python .venv-bench/bin/python $(ARGS)


# The main job: GRPO on the shipped chess model (models/rook-tiny), offline; the P: reward needs Stockfish. The
# chess task declares --ptx-coef 1 (its A: demonstrations mixed in, so the A: skill RL does not train is kept:
# docs/ptx.md), so this is exactly `python train_lean.py $(ARGS)`; ARGS="--ptx-coef 0" runs GRPO alone.
train: install stockfish
	$(PY) train_lean.py $(ARGS)

# The first five minutes: a tiny random GPT-2 (scripts/make_tiny_model.py) learns to answer
# tasks/add.py's sums, judged on 40 sums it never trains on, then the run's picture
# (scripts/plot_run.py). Offline, no Stockfish; SEED=1 another run, ARGS more flags.
# --overwrite: a second `make demo` starts over.
SEED ?= 0
demo: install
	$(PY) scripts/make_tiny_model.py out/demo-model
	$(PY) train_lean.py --task add --model out/demo-model --seed $(SEED) --out-dir out/demo \
	  --overwrite $(ARGS)
	$(PY) scripts/plot_run.py out/demo/metrics.jsonl out/demo.png

# The memory monitor finds a leak: the toy task with a reward that keeps every completion's data
# (tasks/leaky.py), 60 steps of a tiny model; docs/memory.md says what it prints. The monitor exits
# 1 for LEAK, which is this demo's success.
leak-demo: install
	$(PY) scripts/make_tiny_model.py out/tiny
	$(PY) monitor_memory.py --steps 60 --batch-size 8 --every 20 --warmup 10 --trace \
	  --summary out/leak.json --plot out/leak.png -- --model out/tiny --task tasks/leaky.py:LeakyToy \
	  --group-size 4 --max-new-tokens 8 --out-dir out/leak --device cpu --overwrite; test $$? = 1

# Rebuild models/rook-tiny from its seed, in the three stages that made it (docs/chess.md says what each does
# and BENCHMARKS.md how long it takes).
default-model: install stockfish
	$(PY) tasks/rookworld/build_model.py --out out/rook-tiny-1 --candidate-order rank --unlikelihood 0
	$(PY) tasks/rookworld/build_model.py --continue-training --from out/rook-tiny-1 --out out/rook-tiny-2 \
	  --train-steps 2500 --lr 7.5e-4 --unlikelihood 0
	$(PY) tasks/rookworld/build_model.py --continue-training --from out/rook-tiny-2 --out models/rook-tiny \
	  --train-steps 1500 --lr 5e-4

# two workers (pytest-xdist), a test file each at a time: its module fixtures are built once
XDIST = -n 2 --dist loadfile

test: $(VENV)/.installed-test stockfish
	$(PY) -m pytest -q $(XDIST) tests $(ARGS)

# The fast tier: the math, equivalences, masks, decoders and a few end-to-end runs (no test marked slow).
test-fast: $(VENV)/.installed-test stockfish
	$(PY) -m pytest -q $(XDIST) tests -m "not slow" $(ARGS)

.PHONY: install stockfish train demo leak-demo default-model test test-fast bench
