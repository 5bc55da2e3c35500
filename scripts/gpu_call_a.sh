export PYTHONPATH=. PYTHONUNBUFFERED=1
set -o pipefail
timeout 230 python3 -m tuning.autotune_tiers --file tuning/configs/NVIDIA_H200.json --headdims 128,256,512,1024 --seqlens 1024,4096,16384 --causal both --budget-s 200 2>&1 | grep -v -i warn | tee $OUT/tiers_H200.log | cut -c1-230
cp tuning/configs/NVIDIA_H200.json $OUT/
B="python3 -m ffpa_jax.bench --batch 1 --reps 5"
$B --case self,causal --headdims 512,1024 --seqlens 4096 --peers xla,naive-chunked,ffpa-pallas --json $OUT/bench_large_4k.json 2>/dev/null | grep -v "^\s*$" | tail -45
$B --case gqa --headdims 512 --seqlens 8192 --kv-heads 8 --peers xla,naive-chunked,ffpa-pallas --json $OUT/bench_gqa_8k.json 2>/dev/null | tail -8
$B --case self --headdims 512 --seqlens 16384 --peers xla,naive-chunked --json $OUT/bench_16k.json 2>/dev/null | tail -8
$B --case self --headdims 512 --seqlens 32768 --heads 8 --peers naive-chunked --json $OUT/bench_32k.json 2>/dev/null | tail -6
