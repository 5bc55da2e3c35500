export PYTHONPATH=. PYTHONUNBUFFERED=1
set -o pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 280 python3 -m tuning.autotune_tiers --file tuning/configs/NVIDIA_H100_80GB_HBM3.json --headdims 128,256,512,1024 --seqlens 1024,4096,16384 --causal both --budget-s 250 2>&1 | grep -v -i warn | cut -c1-120
cp tuning/configs/NVIDIA_H100_80GB_HBM3.json $OUT/
python3 -m ffpa_jax.bench --batch 1 --reps 5 --case self,causal --headdims 512,1024 --seqlens 4096 --peers xla,naive-chunked,ffpa-pallas --json $OUT/bench_H100_large_4k.json 2>/dev/null | grep -E "^(self|causal)|xla|naive|pallas" | cut -c1-150
