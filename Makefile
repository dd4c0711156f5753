PYTHON ?= python3

.PHONY: install test demo clean

install:
	$(PYTHON) -m pip install "torch>=2.1" 2>/dev/null || true
	$(PYTHON) -m pip install -e ".[dev]"

# The README's test command (CI runs the same through .ci/run).
test:
	$(PYTHON) -m pytest -q

demo:
	bash tools/demo.sh

clean:
	rm -rf demo runs .pytest_cache
