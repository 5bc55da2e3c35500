#!/usr/bin/env bash
# Everything we run on the lent GPU, in one call: environment, GPU tests, variant
# sweep, benchmark. Results land in $OUT (or ./gpu_out). Stages are chosen by
# arguments: env tests fuzz sweep bwdsweep dropvar dropcfg decvar dropout bench (default:
# env tests sweep bwdsweep bench).
# TEST_PATHS narrows the tests stage (default: tests/). Example, on the device tool:
#   bash scripts/gpu_run.sh env tests bench
set -u
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Several pytest workers share the one GPU: no preallocation of 75% per process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=${*:-env tests sweep bwdsweep bench}
for stage in $stages; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
      python3 -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, jax.devices())"
      ;;
    tests)
      python3 -m pytest -m gpu -q -n 4 -p no:cacheprovider -k "not test_fuzz_gpu" ${TEST_PATHS:-tests/} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
      ;;
    fuzz)
      # The 2000-example sweep alone takes most of a 10-minute call; FFPA_FUZZ_SEED reruns one.
      python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/test_fuzz.py -k test_fuzz_gpu 2>&1 | tee "$OUT/fuzz_gpu.log" | tail -30
      ;;
    sweep)
      python3 scripts/fwd_variants.py --out "$OUT/fwd_variants.json" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/fwd_variants.log" | tail -30
      ;;
    bwdsweep)
      python3 scripts/bwd_variants.py --out "$OUT/bwd_variants.json" ${BWD_SWEEP_ARGS:-} 2>&1 | tee "$OUT/bwd_variants.log" | tail -30
      ;;
    dropvar)
      python3 scripts/dropout_variants.py --out "$OUT/dropout_variants.json" ${DROPVAR_ARGS:-} 2>&1 | tee "$OUT/dropout_variants.log" | tail -14
      ;;
    dropcfg)
      python3 scripts/dropout_configs.py --out "$OUT/dropout_configs.json" ${DROPCFG_ARGS:-} 2>&1 | tee "$OUT/dropout_configs.log" | tail -40
      ;;
    decvar)
      python3 scripts/decode_variants.py --out "$OUT/decode_variants.json" ${DECVAR_ARGS:-} 2>&1 | tee "$OUT/decode_variants.log" | tail -16
      ;;
    dropout)
      python3 scripts/dropout_overhead.py --out "$OUT/dropout.json" ${DROPOUT_ARGS:-} 2>&1 | tee "$OUT/dropout.log" | tail -10
      ;;
    bench)
      python3 -m ffpa_jax.bench --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -80
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
