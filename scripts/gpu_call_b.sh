export PYTHONPATH=. PYTHONUNBUFFERED=1
set -o pipefail
timeout 150 python3 -m tuning.autotune_tiers --file tuning/configs/NVIDIA_H200.json --headdims 256,512,1024 --seqlens 1024,4096,16384 --causal true --budget-s 120 2>&1 | grep -v -i warn | cut -c1-200
cp tuning/configs/NVIDIA_H200.json $OUT/
python3 -m ffpa_jax.bench --batch 1 --reps 5 --case causal --headdims 512,1024 --seqlens 4096 --peers xla,naive-chunked,ffpa-pallas,ffpa-chunked --json $OUT/bench_causal_4k.json 2>/dev/null | tail -22
timeout 200 python3 scripts/tuned_ab.py --versus pallas --rounds 2 --budget-s 170 --out $OUT/ab_dispatch_vs_pallas_H200.json 2>/dev/null | tail -3
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider tests/test_forward.py tests/test_backward.py -k "chunked and causal" 2>&1 | tail -2
