#!/usr/bin/env bash
# Everything we run on the lent GPU, in one call: environment, GPU tests, benchmark.
# Results land in $OUT (or ./gpu_out). Stages are chosen by arguments: env multigpu
# mosaic tests fuzz mosaicfuzz autotune ab resources lsecost bench features largehd (default: env
# tests bench). On a
# machine of several GPUs, run two lists side by side with CUDA_VISIBLE_DEVICES set
# per list (each stage sees its GPUs).
# TEST_PATHS narrows the tests stage (default: tests/; TEST_TAG names its log). Example,
# on the device tool:
#   bash scripts/gpu_run.sh env tests bench
set -u
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Several pytest workers share the one GPU: no preallocation of 75% per process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=${*:-env tests bench}
for stage in $stages; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
      python3 -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, jax.devices())"
      ;;
    multigpu)
      # The tests that need two GPUs: pmap/sharded training step, sharded calls, --num-gpus 2.
      python3 -m pytest -m gpu -q -p no:cacheprovider -k "two_gpus or pmap_and_sharded or gpu_sharded_calls" tests/ 2>&1 | tee "$OUT/pytest_multigpu.log" | tail -15
      ;;
    mosaic)
      # The shared matrix on the Mosaic tier (a case using a feature it lacks is a skip that
      # names it), the API around it (vmap), its kernels' own GPU tests (sequence lengths)
      # and the fast backward's rerun spread.
      python3 -m pytest -m gpu -q -n ${WORKERS:-4} -p no:cacheprovider -rf -k "mosaic or fast_backward" tests/test_forward.py tests/test_backward.py tests/test_features.py tests/test_dropout.py tests/test_mosaic.py tests/test_vmap.py tests/test_determinism.py 2>&1 | tee "$OUT/pytest_mosaic.log" | tail -30
      ;;
    tests)
      python3 -m pytest -m gpu -q -n ${TEST_WORKERS:-4} -p no:cacheprovider --durations=15 -k "not test_fuzz_gpu and not test_fuzz_mosaic_gpu" ${TEST_PATHS:-tests/} 2>&1 | tee "$OUT/pytest_gpu${TEST_TAG:-}.log" | tail -40
      ;;
    fuzz)
      # 2000 examples in four parts (FUZZ_PARTS narrows, e.g. "0 or 1"); each prints its rerun.
      python3 -m pytest -m gpu -q -n ${FUZZ_WORKERS:-4} -p no:cacheprovider -rA tests/test_fuzz.py -k "test_fuzz_gpu and (${FUZZ_PARTS:-0 or 1 or 2 or 3})" 2>&1 | tee "$OUT/fuzz_gpu${FUZZ_TAG:-}.log" | grep -E "fuzz seed|passed|failed|Error|FFPA_FUZZ" | tail -30
      ;;
    mosaicfuzz)
      # The Mosaic tier forced over the GPU pool as it serves it (sm90): 300 examples.
      python3 -m pytest -m gpu -q -p no:cacheprovider -p no:xdist -rA tests/test_fuzz.py -k test_fuzz_mosaic_gpu 2>&1 | tee "$OUT/fuzz_mosaic.log" | grep -E "fuzz seed|passed|failed|Error|FFPA_FUZZ" | tail -30
      ;;
    autotune)
      # Tune (or, with --resume, finish) this device's file in AUTOTUNE_DIR (default: the
      # packaged tuning/configs); AUTOTUNE_SEED is copied in first when the file is absent.
      dir=${AUTOTUNE_DIR:-tuning/configs}; mkdir -p "$dir"
      name=$(python3 -c "import tuning; print(tuning.sanitize_device_name(tuning.current_device()[0]))")
      [ -n "${AUTOTUNE_SEED:-}" ] && [ ! -f "$dir/$name.json" ] && cp "$AUTOTUNE_SEED" "$dir/$name.json"
      python3 -m tuning.autotune --output-dir "$dir" ${AUTOTUNE_ARGS:---mode fast --directions both --headdims 64,128,256,512,1024 --seqlens 1,1024,4096,16384 --resume} 2>&1 | tee "$OUT/autotune.log" | tr '\r' '\n' | tail -8
      cp "$dir/$name.json" "$OUT/" 2>/dev/null
      ;;
    ab)
      python3 scripts/tuned_ab.py --out "$OUT/tuned_ab.json" ${AB_ARGS:-} 2>&1 | tee "$OUT/tuned_ab.log" | tail -12
      ;;
    resources)
      python3 scripts/kernel_resources.py --out "$OUT/kernel_resources.json" 2>&1 | tee "$OUT/kernel_resources.log" | tail -40
      ;;
    lsecost)
      python3 scripts/lse_grad_cost.py --out "$OUT/lse_grad_cost.json" ${LSECOST_ARGS:-} 2>&1 | tee "$OUT/lse_grad_cost.log" | tail -6
      ;;
    bench)
      python3 -m ffpa_jax.bench --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -80
      ;;
    features)
      # The language-model features against their targets (docs/benchmarks.md): packed
      # documents, the sliding window against full causal, soft cap and sinks against
      # neither, paged decode against contiguous decode (pages of 16 and 64 keys).
      b="python3 -m ffpa_jax.bench --reps 5"
      { $b --case packed --headdims 128 --seqlens 8192 --batch 4 --peers pallas-mha,ffpa-dense-mask --json "$OUT/packed.json"
        $b --case window,causal --headdims 256 --seqlens 16384 --batch 1 --peers none --json "$OUT/window.json"
        $b --case self,softcap,sinks --headdims 128 --seqlens 4096 --batch 4 --peers none --json "$OUT/softcap_sinks.json"
        $b --case paged-decode,decode --headdims 128 --seqlens 8192 --batch 8 --kv-heads 8 --page-size 16 --peers ffpa-contiguous,pallas-paged,pallas-decode --json "$OUT/paged16.json"
        $b --case paged-decode --headdims 128 --seqlens 8192 --batch 8 --kv-heads 8 --page-size 64 --peers ffpa-contiguous,pallas-paged --json "$OUT/paged64.json"
      } 2>&1 | tee "$OUT/features.log" | grep -v "^  \[" | tail -60
      ;;
    largehd)
      # Issue 26's N=4096 table: the tiers at D=512/1024 against XLA and the naive composition.
      python3 -m ffpa_jax.bench --reps 5 --batch 1 --case self,causal --headdims 512,1024 --seqlens 4096 --peers xla,naive-chunked --json "$OUT/large_d.json" 2>&1 | tee "$OUT/large_d.log" | grep -v "^  \[" | tail -40
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
