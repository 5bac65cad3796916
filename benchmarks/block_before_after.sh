#!/usr/bin/env bash
# The MoE block benchmark (moe_block.py) of two versions of the library in one GPU run, interleaved:
# the working tree ("after") and an older commit ("before"), so that every figure has its baseline
# from the same machine and minutes. Prepare the older tree on the development machine (the GPU
# machine gets a copy of the working tree, without git history), then run this there:
#
#   mkdir -p gpu_run/before && git archive <REV> lightning_moe benchmarks/__init__.py \
#       benchmarks/_common.py benchmarks/_profile.py benchmarks/moe_block.py | tar -x -C gpu_run/before
#   bash benchmarks/block_before_after.sh [CASES] [ITERS] [ROUNDS] [CONFIGS]
#
# CONFIGS (default "bf16e bf16g fp8e fp8g"): bf16e / bf16g (bf16, eager / whole block CUDA-graphed),
# fp8e / fp8g (``--precision fp8``), and after-only variants: fp8g_unfused (``--fuse-swiglu-backward
# off``, the library default), fp8g_tritoncast (``LIGHTNING_MOE_CAST_CUDA=0``). Logs and JSONs go to
# $OUT/before and $OUT/after (default ./block_before_after).
set -u
CASES=${1:-qwen3_30b_a3b}; ITERS=${2:-50}; ROUNDS=${3:-2}; CONFIGS=${4:-"bf16e bf16g fp8e fp8g"}
ROOT=$(pwd)
BEFORE=${BEFORE:-$ROOT/gpu_run/before}
OUT=${OUT:-$ROOT/block_before_after}
[ -d "$BEFORE/lightning_moe" ] || { echo "no older tree at $BEFORE (see the header)"; exit 2; }
mkdir -p "$OUT/before" "$OUT/after"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
args_for() {
  case $1 in
    bf16e) echo "--precision bf16";;
    bf16g) echo "--precision bf16 --cuda-graph";;
    fp8e) echo "--precision fp8";;
    fp8g|fp8g_tritoncast) echo "--precision fp8 --cuda-graph";;
    fp8g_unfused) echo "--precision fp8 --cuda-graph --fuse-swiglu-backward off";;
    *) echo "unknown config $1" >&2; exit 2;;
  esac
}
for round in $(seq 1 "$ROUNDS"); do
  for config in $CONFIGS; do
    for tree in before after; do
      case $config in *_unfused|*_tritoncast) [ $tree = before ] && continue;; esac
      castenv=""; [ "${config%_tritoncast}" != "$config" ] && castenv="LIGHTNING_MOE_CAST_CUDA=0"
      dir=$ROOT; [ $tree = before ] && dir=$BEFORE
      (cd "$dir" && env $castenv OUT="$OUT/$tree" PYTHONPATH="$dir" python benchmarks/moe_block.py --cases $CASES \
         --iters "$ITERS" $(args_for "$config") --tag "${config}_r${round}" > "$OUT/$tree/${config}_r${round}.log" 2>&1
       grep -E " ms |Error|error" "$OUT/$tree/${config}_r${round}.log" | tail -3 | sed "s/^/$tree $config r$round: /")
    done
  done
done
