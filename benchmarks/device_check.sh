#!/usr/bin/env bash
# One call of the `device` tool (H200 machine: torch with CUDA present, nothing of ours installed,
# no network): build the kernel, run the CUDA tests, the compact-moment step on the host's cores,
# partial offload (benchmarks/partial_offload_gpu.py: tokens/s at offload_fraction 1.0, 0.5, 0.0
# and "auto" beside the GPU-resident baseline), FSDP2 (benchmarks/fsdp2_gpu.py under torchrun, one
# process per GPU over NCCL: the engine under fully_shard against FSDP2 + fused torch AdamW, and
# with the weights on the host, CPUOffloadPolicy, the host step overlapped and not), then
# benchmarks/gpu_e2e.py, all inside 8 minutes (each part has a time limit; gpu_e2e gets whatever
# time is left). Everything lands in $OUT: device_check.log, pytest_cuda.xml,
# cpu_adam_moments.json, partial_offload_gpu.json/.md, fsdp2_gpu.json/.md, gpu_e2e.json,
# gpu_e2e.md. Ends with benchmarks/device_summary.py: a one-screen summary for
# benchmarks/RESULTS.md, and exit 1 naming every job that failed or came back without its figures.
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=540)
#
# --rehearse runs every step the same way on a CPU-only machine (CI does, so the check cannot
# rot): the kernel build, the same pytest selection (the cuda-marked tests that can run on the
# CPU run on the emulated device, the rest must collect and skip), the same benchmark jobs
# through the same arguments and child processes; only the device (the CPU, the engine on the
# emulated asynchronous device: LZO_EMULATED_DEVICE_SEED), the sizes and the time budget (under
# 6 minutes on 2 cores) differ. $PYTHON is the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REHEARSE=0
case "${1:-}" in
    --rehearse) REHEARSE=1 ;;
    "") ;;
    *) echo "usage: bash benchmarks/device_check.sh [--rehearse]" >&2; exit 2 ;;
esac
OUT="${OUT:-benchmarks/out}"
mkdir -p "$OUT"
rm -f "$OUT"/{pytest_cuda.xml,cpu_adam_moments.json,partial_offload_gpu.{json,md},fsdp2_gpu.{json,md}}
rm -f "$OUT"/gpu_e2e.{json,md}
# (no stale figures)
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export LZO_KERNEL=cpp  # the C++ kernel or a loud failure
if ((REHEARSE)); then
    TOTAL_S="${TOTAL_S:-310}" BUILD_S="${BUILD_S:-150}" TESTS_S="${TESTS_S:-90}" \
        MOMENTS_S="${MOMENTS_S:-45}" PARTIAL_S="${PARTIAL_S:-90}" FSDP2_S="${FSDP2_S:-120}"
    # (each can be raised when busy)
    MOMENTS=(--sizes 1M --parts d --threads 1 --repeats 2)
    PARTIAL=(--rehearse)  # the tiny GPT, each engine on the emulated device with a 1 GiB capacity
    FSDP2=(--rehearse)  # gloo on 2 CPU processes, a tiny GPT, the engine on the emulated device
    FSDP2_PROCS=2
    GPU_E2E=(--rehearse)  # LZO_BUILD_DIR: the caller's, else the default (CI: `tasks.py test`'s)
    export LZO_DEVICE_CHECK=rehearse LZO_EMULATED_DEVICE_SEED="${LZO_EMULATED_DEVICE_SEED:-1}"
else
    TOTAL_S="${TOTAL_S:-470}" BUILD_S="${BUILD_S:-100}" TESTS_S="${TESTS_S:-120}" \
        MOMENTS_S="${MOMENTS_S:-75}" PARTIAL_S="${PARTIAL_S:-90}" FSDP2_S="${FSDP2_S:-150}"
    # (8 minutes less a margin)
    MOMENTS=(--sizes 50M --parts d --threads 1,8,16 --repeats 5)
    PARTIAL=()  # GPT 350m, batch 8 x 1024
    FSDP2=()  # GPT 350m, batch 8 x 1024, NCCL: every GPU (one is a world of one)
    FSDP2_PROCS=$($PY -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null \
        || echo 1)
    GPU_E2E=()
    export LZO_BUILD_DIR="${LZO_BUILD_DIR:-/tmp/lzo-build}"
fi
T0=$SECONDS
FAILED=()
exec > >(tee "$OUT/device_check.log") 2>&1
TEE=$!
step() { echo; echo "=== [$((SECONDS - T0))s] $*"; }
# check NAME CMD...: run CMD; a non-zero exit (124: its time limit) marks the job NAME failed
check() {
    local name=$1 rc
    shift
    "$@"
    rc=$?
    if ((rc)); then
        echo "!!! $name failed: rc=$rc$( ((rc == 124)) && echo ' (time limit)')"
        FAILED+=("$name: rc=$rc")
    fi
    return "$rc"
}

step "environment$( ((REHEARSE)) && echo ' (rehearsal on the CPU)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"
$PY -c 'import os, torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
"cores", len(os.sched_getaffinity(0)))'
free -g | head -2

step "build the kernel (limit $BUILD_S s)"
if ! check "kernel build" timeout "$BUILD_S" $PY -m lightning_zero_offload.ops._build; then
    # a build killed by its limit leaves torch's build lock behind: every later load would wait
    # on it forever
    $PY -c 'from lightning_zero_offload.ops import _build as b
(b.build_root() / b.cache_key() / "lock").unlink(missing_ok=True)' || true
fi

step "CUDA tests (limit $TESTS_S s)"
check "CUDA tests" timeout "$TESTS_S" $PY -m pytest -q -m cuda -p no:cacheprovider -o addopts="-ra" \
    --junitxml="$OUT/pytest_cuda.xml" tests/test_engine_cuda.py tests/test_delayed_update.py \
    tests/test_profile.py tests/test_planner.py tests/test_tensor_parallel.py tests/test_lion.py

# Issue 11: the compact moments pay off where the step is memory-bound, which a 2-core machine
# is not (int8 1.35-1.48x, bf16 0.80-0.84x of fp32 moments there); this host's 16 cores are.
step "compact moments on the host's cores (limit $MOMENTS_S s)"
check "compact moments" timeout "$MOMENTS_S" $PY benchmarks/cpu_adam.py "${MOMENTS[@]}" \
    --out "$OUT/cpu_adam_moments.json"

# Issue 28: what keeping part (or all) of the optimizer state on the device costs and saves.
step "partial offload (limit $PARTIAL_S s)"
check "partial offload" timeout "$PARTIAL_S" $PY benchmarks/partial_offload_gpu.py "${PARTIAL[@]}" \
    --out "$OUT" --budget-s "$((PARTIAL_S - 10))"

# Issue 46: FSDP2 (fully_shard) shards the weights, the engine steps each rank's shards.
# Issue 47: the same with the weights on the host (CPUOffloadPolicy: pinned on CUDA, not in the
# rehearsal), the engine stepping FSDP2's host shards, overlapped and unoverlapped.
step "FSDP2, $FSDP2_PROCS process(es) (limit $FSDP2_S s)"
check "fsdp2" timeout "$FSDP2_S" $PY -m torch.distributed.run --standalone \
    --nproc_per_node "$FSDP2_PROCS" benchmarks/fsdp2_gpu.py "${FSDP2[@]}" --out "$OUT" \
    --budget-s "$((FSDP2_S - 30))"

LEFT=$((TOTAL_S - (SECONDS - T0)))
LEFT=$((LEFT < 45 ? 45 : LEFT))  # `timeout 0` would mean no limit at all
step "GPU end to end (budget $((LEFT - 25)) s)"
check "gpu_e2e" timeout "$LEFT" $PY benchmarks/gpu_e2e.py "${GPU_E2E[@]}" --out "$OUT" \
    --budget-s "$((LEFT - 25))"

step "summary"
$PY benchmarks/device_summary.py --out "$OUT" --wall-s "$((SECONDS - T0))" \
    $( ((REHEARSE)) && echo --rehearse) --failed "${FAILED[@]}"
RC=$?
exec >&- 2>&-  # let tee write the last lines before the exit status is reported
# (for at most 5 s: a process a job left behind may hold the pipe open, and a plain `wait`
# would then wait for it forever)
for _ in {1..50}; do kill -0 "$TEE" 2>/dev/null || break; sleep 0.1; done
exit "$RC"
