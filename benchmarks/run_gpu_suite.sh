#!/usr/bin/env bash
# Everything that needs a GPU, in one command (device time is scarce): the GPU tests, then the
# benchmarks whose JSON the README quotes. Results land in benchmarks/results/ and in $OUT.
#   bash benchmarks/run_gpu_suite.sh            # 1 or 2 H200s (EP=2 parts need 2)
#   WITH_TE=1 bash benchmarks/run_gpu_suite.sh  # after installing Transformer Engine: TE backend + FP8 recipes
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export LIGHTNING_MOE_COMMIT="${LIGHTNING_MOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
OUT="${OUT:-benchmarks/results}"
python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -15
python3 benchmarks/moe_block.py --iters 20 2>&1 | grep -v -i warn | tail -5
if [ "${WITH_TE:-0}" = 1 ]; then
  python3 benchmarks/moe_block.py --backend te --iters 20 2>&1 | grep -v -i warn | tail -5
  for recipe in tensorwise blockwise delayed; do
    python3 benchmarks/moe_block.py --precision "$recipe" --iters 20 --tag "grouped_mm_$recipe" 2>&1 | grep -v -i warn | tail -4
  done
fi
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python3 benchmarks/ep_scaling.py --ep 1 2 2>&1 | grep -E "EP=|rror" | tail -6
fi
python3 benchmarks/train_step.py --steps 15 2>&1 | grep -E "ms/step|overhead|rror"
cp benchmarks/results/*.json "$OUT"/ 2>/dev/null || true
