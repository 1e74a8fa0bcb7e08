# The two commands of README.md. Both set up .venv first (scripts/setup-venv), once per change
# of what it installs.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cloudtrain-installed
INSTALL_INPUTS := pyproject.toml setup.py $(CONSTRAINTS) scripts/setup-venv scripts/install-horovod \
	$(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/*.h)

.PHONY: demo test install lint clean

install: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	scripts/setup-venv "$(PYTHON)" "$(VENV)" "$(CONSTRAINTS)"
	touch $@

demo: install
	$(PY) -m cloudtrain.tools.bench

test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) build *.egg-info cloudtrain/*.so
