#!/usr/bin/env bash
# The GPU suite (issues 17 and 27), one command on a GPU machine, from the repository root:
#
#     bash benchmarks/gpu_suite.sh
#
# It fits 9 minutes on one H100/H200: every part has its own time limit, runs in order of importance, and
# writes into the results folder as it goes, so a part that fails or runs out of time costs only itself.
#
#  1. the device (nvidia-smi, torch.cuda.get_device_name), torch's CUDA version, the host's CPUs and memory;
#  2. makes the project importable without a network: wheels found in .whl/ are installed into a private
#     folder on PYTHONPATH, then the project itself (`pip install --no-index --no-deps --no-build-isolation
#     -e .`: the plugins/ folder installs as trainer.plugins, so PYTHONPATH alone is not enough);
#  3. the gpu test tier: `python -m pytest -m gpu` (tests/test_gpu.py), junit XML kept;
#  4. benchmarks/gpu_throughput.py at the planner's layer count, bf16, compiled, with a profiler kernel table;
#  5. recipe=llama2_7b_1xh100_offload for a few steps: Llama 2 7B on one GPU with ZeRO-Offload, and the
#     planner's report (`mode=plan`) of the same run, whose memory the table puts beside the measured peak;
#  6. the throughput benchmark with precision=fp8, compiled;
#  7. this trainer against benchmarks/hf_reference.py's plain Hugging Face loop, 4 layers, compiled, no AC (the
#     trainer's run with a kernel table too);
#  8. benchmarks/gpu_memory.py: the planner's device memory against the allocator's peak, Llama 3 8B width,
#     2 and 4 layers x activation checkpointing none/selective/full;
#  9. bf16 and fp8 again with 8 micro-batches per optimizer step (`--accumulation 8`): the optimizer's work
#     per token of a multi-GPU run, where each GPU steps a shard of the parameters, or of any run with a
#     global batch of several sequences per GPU (last: they run in what is left of the budget);
# 10. benchmarks/gpu_table.py: ONE markdown table (table.md) and ONE JSON object (suite.json); the logs,
#     the kernel table and the junit XML are packed into logs.tar.gz beside them.
# Without CUDA it still runs: the tests skip and the benchmarks say "no CUDA device".
#
# A machine without internet must be given hydra-core, omegaconf, antlr4-python3-runtime and torchao as
# wheels in .whl/ at the repository root (../shared/gpu/README.md; made elsewhere with
# `pip download --no-deps --only-binary=:all: -d .whl hydra-core==1.3.2 omegaconf==2.3.0 torchao` and
# `pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3`).
#
# Environment: PYTHON (default python3), GPU_SUITE_OUT (the results folder; default /tmp/gpu_suite),
# GPU_SUITE_SECONDS (the whole suite's time limit, default 540: 9 minutes).
# The exit status is pytest's (0 when every gpu test passed or skipped).

set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${GPU_SUITE_OUT:-/tmp/gpu_suite}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
START=$(date +%s)

# The whole suite's limit: a part gets at most what is left of it, less 20 s kept for the table.
BUDGET=${GPU_SUITE_SECONDS:-540}

# part NAME SECONDS COMMAND...: run a part with its time limit, its output in $RESULTS/NAME.log
part() {
    local name=$1 limit=$2
    shift 2
    local left=$(( BUDGET - 20 - ($(date +%s) - START) ))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -le 5 ]; then
        echo "== $name: not run (the suite's ${BUDGET} s are spent)" | tee "$RESULTS/$name.log"
        return 124
    fi
    echo "== $name (limit ${limit} s, at $(( $(date +%s) - START )) s)"
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local status=$?
    grep -v '^{' "$RESULTS/$name.log" | grep -v '^warning\|Warning\|warn(' | tail -n 4
    echo "   $name: exit status $status"
    return $status
}

echo "== device"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
    "$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
    echo "host: $(nproc) CPUs, $(free -g 2>/dev/null | awk '/Mem:/ {print $2}') GiB"
} | tee "$RESULTS/device.log"

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

part gpu_tests 200 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml "$RESULTS/junit.xml"
TESTS=$?
part throughput_bf16 150 "$PY" benchmarks/gpu_throughput.py --modes compile --steps 5 --warmup 3 \
    --profile "$RESULTS/kernels_bf16.txt"
OFFLOAD_RUN=(recipe=llama2_7b_1xh100_offload trainer.global_batch_size=4 trainer.max_steps=4 trainer.log_every=1
    trainer.val_every=0 trainer.val_batches=1 trainer.save_final=false callbacks=none)
part offload 150 "$PY" -m trainer "${OFFLOAD_RUN[@]}" "hydra.run.dir=$RESULTS/offload_run"
part offload_plan 30 "$PY" -m trainer "${OFFLOAD_RUN[@]}" mode=plan plan.format=json "hydra.run.dir=$RESULTS/offload_plan"
part throughput_fp8 120 "$PY" benchmarks/gpu_throughput.py --precision fp8 --modes compile --steps 5 --warmup 3
part throughput_4l 60 "$PY" benchmarks/gpu_throughput.py --layers 4 --ac none --modes compile --steps 5 --warmup 3 \
    --profile "$RESULTS/kernels_4l.txt"
part hf_4l 120 "$PY" benchmarks/hf_reference.py --layers 4 --steps 5 --warmup 3
part memory 75 "$PY" benchmarks/gpu_memory.py --layers 2,4 --ac none,selective,full --json "$RESULTS/memory.json"
# last: what is left of the budget (the optimizer's share at 8 micro-batches per step)
part throughput_bf16_acc8 90 "$PY" benchmarks/gpu_throughput.py --accumulation 8 --modes compile --steps 2 --warmup 2
part throughput_fp8_acc8 90 "$PY" benchmarks/gpu_throughput.py --precision fp8 --accumulation 8 --modes compile \
    --steps 2 --warmup 2

echo "== table (docs/BENCHMARKS.md, section GPU) at $(( $(date +%s) - START )) s"
"$PY" benchmarks/gpu_table.py "$RESULTS"
# Three files in the end (a device tool may bring back only a few): the archive is written outside the
# folder it packs, so tar never reads its own growing output.
ARCHIVE=$(mktemp /tmp/gpu_suite_logs.XXXXXX)
tar czf "$ARCHIVE" -C "$RESULTS" --exclude table.md --exclude suite.json . \
    || echo "tar: exit status $? (a file changed while packing: the archive may lack part of it)"
find "$RESULTS" -mindepth 1 -maxdepth 1 ! -name table.md ! -name suite.json -exec rm -rf {} +
mv "$ARCHIVE" "$RESULTS/logs.tar.gz"
echo "suite: $(( $(date +%s) - START )) s; results in $RESULTS (table.md, suite.json, logs.tar.gz)"
exit "$TESTS"
