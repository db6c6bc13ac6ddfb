#!/usr/bin/env bash
# The GPU suite of issue 17, in one command on a GPU machine (from the repository root):
#
#     bash benchmarks/gpu_suite.sh
#
# 1. prints the device (nvidia-smi, torch.cuda.get_device_name) and torch's CUDA version;
# 2. makes the project importable without a network: wheels found in .whl/ are installed into a private
#    folder on PYTHONPATH, then the project itself with `pip install --no-index --no-deps
#    --no-build-isolation -e .` (the plugins/ folder installs as trainer.plugins, so PYTHONPATH alone
#    is not enough);
# 3. runs the gpu test tier: `python -m pytest -m gpu -q -rs` (tests/test_gpu.py), junit XML kept;
# 4. runs benchmarks/gpu_throughput.py (Llama 3 8B width, layers from the planner, compile and eager)
#    and benchmarks/precision_speed.py on the GPU (gpt2_small, 1024-token sequences);
# 5. prints ONE markdown table (benchmarks/gpu_table.py) to paste into docs/BENCHMARKS.md's GPU section.
# Without CUDA it still runs: the tests skip, the benchmark runs its CPU --smoke mode, precision_speed is
# left out, and the table says so.
#
# What a machine without internet must be given: torch with CUDA, pytest, lightning, numpy, setuptools,
# safetensors and transformers (for the Hugging Face export test) are usually there; hydra-core,
# omegaconf and antlr4-python3-runtime (omegaconf's parser), and torchao for the fp8 test, often are not.
# Carry them as wheels in .whl/ at the repository root, made on a machine with pip and internet:
#
#     echo /.whl/ >> .git/info/exclude
#     pip download --no-deps --only-binary=:all: -d .whl hydra-core==1.3.2 omegaconf==2.3.0
#     pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3     # published as a source archive only
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#         -d .whl torchao                                           # optional: the fp8 test skips without it
#
# Environment: PYTHON (default python3), GPU_SUITE_OUT (where logs, junit.xml and table.md go; default
# /tmp/gpu_suite), THROUGHPUT_ARGS (extra arguments of gpu_throughput.py, e.g. "--layers 8 --steps 20").
# The exit status is pytest's (0 when every gpu test passed or skipped).

set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${GPU_SUITE_OUT:-/tmp/gpu_suite}
mkdir -p "$RESULTS"

echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi: not available"
"$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" || exit 1
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

echo "== install (no network)"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu_suite_site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/gpu_suite_site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import trainer.plugins, trainer.run" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
if ! "$PY" -c "import hydra, omegaconf, lightning, trainer.run"; then
    echo "missing packages: carry them as wheels in .whl/ (see this script's header)"
    exit 1
fi

echo "== gpu tests: python -m pytest -m gpu -q -rs"
export PYTHONUNBUFFERED=1
"$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml "$RESULTS/junit.xml" 2>&1 | tee "$RESULTS/pytest.log"
TESTS=${PIPESTATUS[0]}

echo "== benchmarks"
if [ "$CUDA" = 1 ]; then
    # shellcheck disable=SC2086  # THROUGHPUT_ARGS holds several arguments
    "$PY" benchmarks/gpu_throughput.py ${THROUGHPUT_ARGS:-} 2>&1 | tee "$RESULTS/gpu_throughput.log"
    "$PY" benchmarks/precision_speed.py --model gpt2_small --seq-len 1024 --batch 8 --steps 10 --warmup 3 \
        --repeats 2 2>&1 | tee "$RESULTS/precision_speed.log"
else
    "$PY" benchmarks/gpu_throughput.py --smoke 2>&1 | tee "$RESULTS/gpu_throughput.log"
    echo "precision_speed: not run (no CUDA device; on a CPU see docs/BENCHMARKS.md)" | tee "$RESULTS/precision_speed.log"
fi

echo "== table (docs/BENCHMARKS.md, section GPU)"
"$PY" benchmarks/gpu_table.py --junit "$RESULTS/junit.xml" --throughput "$RESULTS/gpu_throughput.log" \
    --precision "$RESULTS/precision_speed.log" | tee "$RESULTS/table.md"
exit "$TESTS"
