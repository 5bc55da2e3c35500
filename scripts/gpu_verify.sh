#!/usr/bin/env bash
# The GPU verification on a machine of several GPUs. Parts (arguments, default both):
#   tests  the GPU tests in one lane per GPU of TEST_GPUS (default "0 1"; "0 1 2 3" on four
#          GPUs: four lanes of file groups sized so that they end together), then the
#          two-GPU tests on GPUs 0 and 1;
#   fuzz   the 2000-example GPU fuzz (four parts) over the GPUs of FUZZ_GPUS (default
#          "2 3"), seed FFPA_FUZZ_SEED or a fresh one, and the Mosaic fuzz (sm90, 200
#          examples) beside the last part.
# On 4 GPUs run `tests` with TEST_GPUS="0 1 2 3" as one call (about 7 minutes) and `fuzz`
# with FUZZ_GPUS="0 1 2 3" as another (about 7); on 2 GPUs `tests`, then `fuzz` with
# FUZZ_GPUS="0 1".
# Logs land in $OUT/logs and $OUT/gpu_logs<parts>.tgz; the summary lines
# are printed at the end.
set -u
OUT=${OUT:-./gpu_out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
parts=${*:-tests fuzz}
SEED=${FFPA_FUZZ_SEED:-$(python3 -c "import random; print(random.SystemRandom().randrange(2**31))")}
read -r -a TEST_GPU_LIST <<< "${TEST_GPUS:-0 1}"
read -r -a FUZZ_GPU_LIST <<< "${FUZZ_GPUS:-2 3}"
# A lane starts no test after LANE_LIMIT seconds (tests/conftest.py skips the rest, saying
# so), so that its summary comes back inside a device call.
DEADLINE=$(( $(date +%s) + ${LANE_LIMIT:-420} ))
# File groups by the GPU time they took (the backward-heavy files apart): two lanes or four.
if [ "${#TEST_GPU_LIST[@]}" -ge 4 ]; then
  LANES=("tests/test_backward.py tests/test_long_sequences.py tests/test_training.py"
         "tests/test_features.py tests/test_numerics.py tests/test_paged.py"
         "tests/test_forward.py tests/test_flax.py tests/test_decode.py tests/test_vmap.py"
         "REST")
else
  LANES=("tests/test_backward.py tests/test_dropout.py tests/test_long_sequences.py tests/test_training.py tests/test_flax.py"
         "REST")
fi
# "REST": every file that no other lane names.
named=""
for lane in "${LANES[@]}"; do [ "$lane" = REST ] || named="$named $lane"; done
IGNORE_NAMED=$(for f in $named; do printf -- "--ignore=%s " "$f"; done)
run() { OUT="$LOGS" bash scripts/gpu_run.sh "$@"; }
summaries=()
for part in $parts; do
  case $part in
    tests)
      for i in "${!LANES[@]}"; do
        paths=${LANES[$i]}
        [ "$paths" = REST ] && paths="tests/ $IGNORE_NAMED"
        CUDA_VISIBLE_DEVICES=${TEST_GPU_LIST[$i]} TEST_TAG=_$i TEST_PATHS="$paths" \
          FFPA_TEST_DEADLINE=$DEADLINE run tests > "$LOGS/lane_$i.txt" 2>&1 &
        summaries+=("pytest_gpu_$i.log")
      done
      summaries+=(pytest_multigpu.log) ;;
    fuzz)
      # The four parts spread over the fuzz GPUs (one part each on four, two on two), the
      # Mosaic fuzz beside the last of them.
      n=${#FUZZ_GPU_LIST[@]}
      for i in "${!FUZZ_GPU_LIST[@]}"; do
        sel=$(for p in 0 1 2 3; do [ $((p % n)) -eq "$i" ] && printf "%s or " "$p"; done)
        CUDA_VISIBLE_DEVICES=${FUZZ_GPU_LIST[$i]} FUZZ_PARTS="${sel% or }" FUZZ_WORKERS=$((4 / n)) \
          FUZZ_TAG=_$i FFPA_FUZZ_SEED=$SEED run fuzz > "$LOGS/fuzz_$i.txt" 2>&1 &
        summaries+=("fuzz_gpu_$i.log")
      done
      CUDA_VISIBLE_DEVICES=${FUZZ_GPU_LIST[$((n - 1))]} FFPA_FUZZ_SEED=$SEED \
        FFPA_FUZZ_MOSAIC_EXAMPLES=${FFPA_FUZZ_MOSAIC_EXAMPLES:-200} run mosaicfuzz \
        > "$LOGS/fuzz_mosaic.txt" 2>&1 &
      summaries+=(fuzz_mosaic.log)
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
