# The two README commands. Both create .venv when it is missing and install what they need.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo prove test sanitize lint format clean proto

$(STAMP): pyproject.toml setup.py $(wildcard src/durable_sessions/*.c) $(wildcard collector/pyproject.toml collector/setup.py collector/src/*/*/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	if [ -f collector/pyproject.toml ]; then $(BIN)/python -m pip install --quiet -e './collector[test]'; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# Kill the resumable example agent at every action boundary, resume it, check it came back.
prove: $(STAMP)
	$(BIN)/durable-sessions prove -- $(BIN)/python examples/agents/resumable_trip.py

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m pytest -q

# The tests that feed the C extensions, against copies built with ASan and UBSan (CI runs it).
sanitize: $(STAMP)
	scripts/sanitize

lint: $(STAMP)
	$(BIN)/python -m ruff check .

format: $(STAMP)
	$(BIN)/python -m ruff format .
	$(BIN)/python -m ruff check --fix .

# Regenerate the gRPC API's Python code from proto/ (committed; a test checks it is current).
proto: $(STAMP)
	$(BIN)/python collector/scripts/generate_api.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
