# The two commands of README.md. Both set up .venv first (scripts/setup-venv), once per change
# of what it installs.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cloudtrain-installed
INSTALL_INPUTS := pyproject.toml setup.py $(CONSTRAINTS) scripts/setup-venv scripts/install-horovod \
	$(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/*.h)

# What this machine supports and `make test` must therefore test (tests/conftest.py fails the run
# when one is missing, instead of skipping): horovod always (setup-venv installs it), the native
# ops where a C++ compiler is, the WAN emulator as root with ip and tc. Override on the command
# line: make test CLOUDTRAIN_REQUIRE=native
comma := ,
CLOUDTRAIN_REQUIRE ?= horovod$(if $(shell command -v c++ || command -v g++),$(comma)native)$(if $(and $(filter 0,$(shell id -u)),$(shell command -v ip),$(shell command -v tc)),$(comma)netem)

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
	CLOUDTRAIN_REQUIRE="$(CLOUDTRAIN_REQUIRE)" $(PY) -m pytest

lint: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) build *.egg-info cloudtrain/*.so
