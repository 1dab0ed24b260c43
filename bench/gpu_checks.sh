#!/usr/bin/env bash
# Every GPU check of issue 14 in one run, within about 8 minutes (DRY_RUN: about a minute): the peak the trainer
# assumes for this GPU, the test suite on NCCL, train.py --preset gpt2 for a few steps (tokens/s, MFU), and each
# bench with --device cuda.
#
#     bash bench/gpu_checks.sh                 # logs under $OUT (the device machine's folder) or /tmp/gpu_checks
#     BUDGET_S=900 bash bench/gpu_checks.sh    # more time in all (default 480 s)
#     DRY_RUN=1 bash bench/gpu_checks.sh       # anywhere, no GPU: parse every command's flags, run nothing
#
# Checks run in order of value, each under `timeout` within what is left of the budget (SIGINT first, so pytest
# still prints its summary; then the whole process group is killed). A check that needs more GPUs than are
# visible is skipped, saying so (NCCL runs one rank per GPU: on one GPU only the single-rank checks run). The end
# prints one line per check (ok / FAIL rc / TIMEOUT / SKIP, seconds) and the lines that carry the numbers.
# Full logs: $LOGS/<check>.log; checkpoints and token caches go to $WORK, not to $LOGS.
set -u
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/gpu_checks}
WORK=${WORK:-/tmp/gpu_checks_work}
BUDGET_S=${BUDGET_S:-480}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$LOGS" "$WORK"
START=$(date +%s)
if [[ $DRY_RUN == 1 ]]; then GPUS=8; else
    GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0); fi
SUMMARY=()
rm -f "$WORK/dry_run_commands.jsonl"

argcheck() {  # argcheck FILE: each line of FILE is [NAME, ARGS] (JSON): the script's argparse parser reads ARGS,
    # then it stops. One process for all: the imports (torch, the repository) are paid once, not per command.
    python3 - "$1" <<'EOF'
import argparse, json, os, runpy, sys, time
parse = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
for line in open(sys.argv[1]):
    name, argv = json.loads(line)
    began, sys.argv = time.time(), argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code or 0
    sys.path.pop(0)
    print(f"{'flags ok' if status == 0 else 'FLAGS?  '} {name} ({time.time() - began:.1f} s)", flush=True)
EOF
}

check() {  # check NAME GPUS_NEEDED MAX_SECONDS COMMAND...
    local name=$1 need=$2 max=$3
    shift 3
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if ((GPUS < need)); then SUMMARY+=("SKIP     $name: needs $need GPUs, $GPUS visible"); return; fi
    if [[ $DRY_RUN == 1 ]]; then  # the flags only: from the script (train.py under torchrun too), or pytest's
        local args=("$@")
        while ((${#args[@]})) && [[ ${args[0]} != *.py ]]; do args=("${args[@]:1}"); done
        if ((${#args[@]})); then  # parsed together at the end (argcheck)
            python3 -c 'import json, sys; print(json.dumps([sys.argv[1], sys.argv[2:]]))' "$name" "${args[@]}" \
                >>"$WORK/dry_run_commands.jsonl"
        elif [[ $* == *pytest* ]]; then
            echo "collecting the suite ($name)"
            python3 -m pytest --collect-only -q "${@:4}" >/dev/null && SUMMARY+=("flags ok $name") ||
                SUMMARY+=("FLAGS?   $name: $*")
        else SUMMARY+=("unparsed $name: $*"); fi
        return
    fi
    if ((left < 20)); then SUMMARY+=("SKIP     $name: the ${BUDGET_S} s budget is spent"); return; fi
    local limit=$((max < left ? max : left)) t0 rc status
    echo "=== $name (at most ${limit} s): $*"
    t0=$(date +%s)
    timeout -s INT -k 15 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    if ((rc == 124 || rc == 137)); then status=TIMEOUT; elif ((rc != 0)); then status="FAIL $rc"; else status=ok; fi
    tail -n 20 "$LOGS/$name.log"
    SUMMARY+=("$(printf '%-8s %s (%d s)' "$status" "$name" $(($(date +%s) - t0)))")
}

# Powers of two up to the GPUs (at most 4): the group sizes the multi-rank benches can use here.
SIZES=$(for c in 1 2 4; do ((c <= GPUS)) && printf '%s ' $c; done)
SIZES2=$(for c in 2 4; do ((c <= GPUS)) && printf '%s ' $c; done)
TRAIN="--preset gpt2 --eval-every 0 --eval-batches 1 --sample-tokens 0 --log-every 1 --out-dir $WORK/train"

# 1. The peak: which PEAK_TFLOPS row this GPU gets, per dtype (fp32 with TF32 off and on), or the fallback.
check peak 1 60 python3 - <<'EOF'
import torch, mfu
d = torch.device("cuda", 0)
p = torch.cuda.get_device_properties(d)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {p.name}:"
      f" {p.multi_processor_count} SMs, cc {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB")
print("PEAK_TFLOPS row:", mfu.gpu_row(p.name, p.multi_processor_count))
for dtype in ("bf16", "fp16", "fp8", "fp32"):
    flops, source = mfu.detect_peak_flops(d, dtype, None)
    print(f"peak {dtype}: {flops / 1e12:.1f} TFLOP/s ({source})")
torch.set_float32_matmul_precision("high")
flops, source = mfu.detect_peak_flops(d, "fp32", None)
print(f"peak fp32, TF32 on: {flops / 1e12:.1f} TFLOP/s ({source})")
for dtype in (torch.bfloat16, torch.float32):  # the datasheet against what a matmul loop reaches
    print(f"matmul loop {dtype}: {mfu.measure_matmul_peak(dtype, n=8192, seconds=0.5, device=d) / 1e12:.1f} TFLOP/s")
EOF

# 2. The test suite with NCCL between the ranks (tests needing more GPUs than visible skip themselves).
check pytest_nccl 1 180 python3 -m pytest -q --backend nccl -p no:cacheprovider --durations=10

# 3. The trainer on GPT-2 124M: tokens/s and MFU against the table's peak, bf16 then fp32 (TF32 off: FP32 peak).
check train_gpt2_bf16 1 120 python3 train.py $TRAIN --steps 10 --global-batch 16 --micro-batch 8
check train_gpt2_fp32 1 90 python3 train.py $TRAIN --dtype fp32 --steps 5 --global-batch 8 --micro-batch 8
check train_gpt2_ddp 2 120 torchrun --standalone --nproc_per_node "$GPUS" train.py $TRAIN --steps 10 \
    --global-batch $((8 * GPUS)) --micro-batch 8
# What the stated choices cost: deterministic kernels (bf16, against train_gpt2_bf16), TF32 (against fp32), and
# per-block torch.compile (its first step compiles; the mean excludes it).
check train_gpt2_deterministic 1 90 python3 train.py $TRAIN --steps 10 --global-batch 16 --micro-batch 8 --deterministic
check train_gpt2_fp32_tf32 1 90 python3 train.py $TRAIN --dtype fp32 --tf32 --steps 5 --global-batch 8 --micro-batch 8
check train_gpt2_compile 1 180 python3 train.py $TRAIN --steps 10 --global-batch 16 --micro-batch 8 --compile

# 4. The benches, --device cuda.
check bench_model 1 90 python3 bench/bench_model.py --device cuda --preset gpt2 --batch 8 --steps 4
check bench_fp8 1 120 python3 bench/bench_fp8.py --device cuda --no-compile --steps 10 --batch 8
# shellcheck disable=SC2086  # SIZES: one word per group size
check bench_context_parallel 1 90 python3 bench/bench_context_parallel.py --device cuda --cps $SIZES \
    --seq-len 8192 --n-layer 2 --steps 3
# shellcheck disable=SC2086
check bench_ckpt 1 90 python3 bench/bench_ckpt.py --device cuda --dims $SIZES --saves 2 --root "$WORK/ckpt"
check bench_ddp 2 90 python3 bench/bench_ddp.py --device cuda --preset gpt2 --steps 4 --micro-batch 4
check bench_tp 2 90 python3 bench/bench_tp.py --device cuda --preset gpt2 --seq 1024 --batch 4 --steps 4
check bench_zero 2 120 python3 bench/bench_zero.py --device cuda --skip-table --layers 6 --seq 256 --micro 4 --steps 6
# shellcheck disable=SC2086
check bench_pipeline 2 120 python3 bench/bench_pipeline.py --device cuda --pp $SIZES2 --n-embd 512 --seq 256 \
    --rounds 4
check bench_moe 4 120 python3 bench/bench_moe.py --device cuda --embd 512 --seq 512 --steps 4
check bench_lowbit 2 90 python3 bench/bench_lowbit.py --device cuda --part collective --sizes 1048576,16777216,268435456

echo
if [[ $DRY_RUN == 1 ]]; then
    echo "=== parsing the flags of $(wc -l <"$WORK/dry_run_commands.jsonl") commands in one process"
    while IFS= read -r line; do echo "$line"; SUMMARY+=("$line"); done < <(argcheck "$WORK/dry_run_commands.jsonl")
    echo "=== summary: DRY_RUN, the flags of every command parsed in $(($(date +%s) - START)) s (nothing ran, so no" \
        "budget was spent; a real run has ${BUDGET_S} s)"
else echo "=== summary: $GPUS GPU(s), $(($(date +%s) - START)) s of a ${BUDGET_S} s budget; logs in $LOGS"; fi
printf '%s\n' "${SUMMARY[@]}"
[[ $DRY_RUN == 1 ]] && exit 0
echo "=== the numbers"
grep -H -E "peak|tok/s|MFU|ratio|TFLOP/s|passed|failed|skipped|median step|speed-up" "$LOGS"/*.log | cut -c1-240
