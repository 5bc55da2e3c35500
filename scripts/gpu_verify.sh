#!/usr/bin/env bash
# The GPU verification on a machine of several GPUs. Parts (arguments, default both):
#   tests  the GPU tests in two lanes (GPU 0: the backward-heavy files; GPU 1: the rest),
#          then the two-GPU tests on GPUs 0 and 1;
#   fuzz   the GPU fuzz in two halves on the GPUs of FUZZ_GPUS (default "2 3"), seed
#          FFPA_FUZZ_SEED or a fresh one.
# On 4 GPUs both parts run side by side (about 7 minutes); on 2, run them as two calls
# (FUZZ_GPUS="0 1" for the second). Logs land in $OUT/logs and $OUT/gpu_logs<parts>.tgz;
# the summary lines are printed at the end.
set -u
OUT=${OUT:-./gpu_out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
parts=${*:-tests fuzz}
SEED=${FFPA_FUZZ_SEED:-$(python3 -c "import random; print(random.SystemRandom().randrange(2**31))")}
LANE_A="tests/test_backward.py tests/test_dropout.py tests/test_long_sequences.py tests/test_training.py tests/test_flax.py"
IGNORE_A=$(for f in $LANE_A; do printf -- "--ignore=%s " "$f"; done)
read -r FUZZ_GPU_1 FUZZ_GPU_2 <<< "${FUZZ_GPUS:-2 3}"
run() { OUT="$LOGS" bash scripts/gpu_run.sh "$@"; }
summaries=()
for part in $parts; do
  case $part in
    tests)
      CUDA_VISIBLE_DEVICES=0 TEST_TAG=_A TEST_PATHS="$LANE_A" run tests > "$LOGS/lane_a.txt" 2>&1 &
      CUDA_VISIBLE_DEVICES=1 TEST_TAG=_B TEST_PATHS="tests/ $IGNORE_A" run tests \
        > "$LOGS/lane_b.txt" 2>&1 &
      summaries+=(pytest_gpu_A.log pytest_gpu_B.log pytest_multigpu.log) ;;
    fuzz)
      CUDA_VISIBLE_DEVICES=$FUZZ_GPU_1 FUZZ_PARTS="0 or 1" FUZZ_WORKERS=2 FUZZ_TAG=_01 \
        FFPA_FUZZ_SEED=$SEED run fuzz > "$LOGS/fuzz_01.txt" 2>&1 &
      CUDA_VISIBLE_DEVICES=$FUZZ_GPU_2 FUZZ_PARTS="2 or 3" FUZZ_WORKERS=2 FUZZ_TAG=_23 \
        FFPA_FUZZ_SEED=$SEED run fuzz > "$LOGS/fuzz_23.txt" 2>&1 &
      summaries+=(fuzz_gpu_01.log fuzz_gpu_23.log)
      echo "fuzz seed $SEED" ;;
    *) echo "unknown part $part" ;;
  esac
done
wait
case " $parts " in *" tests "*) CUDA_VISIBLE_DEVICES=0,1 run multigpu > "$LOGS/multigpu.txt" 2>&1 ;; esac
tar czf "$OUT/gpu_logs_${parts// /_}.tgz" -C "$OUT" logs
for f in "${summaries[@]}"; do
  echo "== $f"; grep -E "passed|failed|error" "$LOGS/$f" | tail -4
done
