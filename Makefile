PYTHON ?= python3

.PHONY: install setup test demo demo-bert demo-llama demo-moe clean

# torch first, only if it is missing, and pinned: an unpinned `pip install torch` can pull a
# multi-GB CUDA build. Then the project with its test extras.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[dev]"

# Install only what is missing (fast when everything is there).
setup:
	PYTHON=$(PYTHON) bash tools/demo.sh --setup

# The README's test command (CI runs the same through .ci/run): two pytest-xdist workers, each
# taking whole test files, so that the jobs a module's tests share run once (on this project's
# 2-core machine 562 s against 715 s in one process: docs/performance.md). More workers only
# oversubscribe the cores; `make test TEST_ARGS=` runs one process.
TEST_ARGS ?= -n 2 --dist loadfile
test: setup
	$(PYTHON) -m pytest -q $(TEST_ARGS)

# Corpus, tokenizer and dataset (if absent), then a tiny GPT with (p,t,d) = (2,2,2) on 8 CPU ranks,
# into a new demo/runs/<date-time>/ folder, and a sample of its text.
demo:
	PYTHON=$(PYTHON) bash tools/demo.sh

# The same with the tiny BERT of configs/bert_demo.yaml (masked LM + sentence order, real text).
demo-bert:
	DEMO_MODEL=bert PYTHON=$(PYTHON) bash tools/demo.sh

# The same with the tiny Llama-style decoder of configs/llama_demo.yaml (rotary positions,
# RMSNorm, SwiGLU, grouped-query attention, untied output) on the GPT data.
demo-llama:
	DEMO_MODEL=llama PYTHON=$(PYTHON) bash tools/demo.sh

# The same with the tiny mixture of experts of configs/moe_tiny.yaml (the Llama-style decoder
# with 4 experts per layer, top-2 routing, e = 2 expert ranks folded out of d = 2) on the GPT data.
demo-moe:
	DEMO_MODEL=moe PYTHON=$(PYTHON) bash tools/demo.sh

# Removes the demo's data and run; never runs/ (real jobs' checkpoints go there).
clean:
	rm -rf demo .pytest_cache
