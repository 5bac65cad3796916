#!/usr/bin/env bash
# Everything that needs a GPU, in as few commands as possible (device time is scarce): the GPU
# tests, then the benchmarks whose JSON the README quotes. Results land in benchmarks/results/;
# when $OUT is set, they also come back packed as $OUT/results.tgz with the log $OUT/suite.log.
#
#   bash benchmarks/run_gpu_suite.sh                       # every part (EP parts need 2 GPUs)
#   PARTS="tests ep train" bash benchmarks/run_gpu_suite.sh
#   PARTS="tetests te fp8 curves" bash benchmarks/run_gpu_suite.sh  # after installing Transformer Engine
#
# Parts: tests (tests/gpu), block (moe_block bf16), ep (ep_scaling EP=1,2), probe (EP link:
# NCCL vs copy engine, overlap with GEMMs; 2 GPUs), train (train_step MFU at two batch shapes),
# tetests (the TE tests alone, verbose), te (moe_block with TE experts), fp8native (native FP8:
# GEMM ceilings, block with per-expert GEMMs / fast accumulation / cached weights), fp8
# (fp8_gemm + moe_block FP8 recipes on TE experts and native rowwise), curves (300-step FP8 vs
# BF16 loss curves on the embedded corpus, TE tensorwise at micro-batch 1, native rowwise at 4),
# noise (after curves: the bf16 micro-batch-4 curve against the same steps as 2 x 2 micro-batches),
# fp8ratio (the FP8 block's ratio to bf16 in both parameter modes, bf16 and fp32 masters: qwen3 in
# interleaved rounds of bf16, FP8 and FP8 with graphed weight casts over 50 steps, as its host-bound
# timing drifts between calls, then the others; RATIO_ROUNDS (default 2) rounds per mode, RATIO_MASTERS
# (default "bf16 fp32") the modes),
# casttune (the delayed cast's launch shapes for its plain, gathered and SwiGLU operands at the three
# benchmark shapes: registers and spills per shape, then GB/s per shape with the outputs checked equal;
# where best_cast_tiles.py finds a faster launch, qwen3 FP8 with and without it, interleaved twice: its
# shape, fold and register cap set in fp8_delayed_triton's TILE_SHAPES / AMAX_FOLD_ROWS / MAX_REGISTERS
# by the statements best_cast_tiles.py prints, run in that module before moe_block.py),
# cudagraph (the whole block captured in CUDA graphs, capture_moe_layer: its GPU tests, then qwen3 in
# rounds of bf16 eager, bf16 graphed and FP8 graphed per parameter mode (CUDAGRAPH_VARIANTS), then
# mixtral and deepseek in bf16 and FP8 (CUDAGRAPH_OTHERS; empty: skipped)),
# trainratio (train_step.py FP8 against bf16 at accumulate 8, qwen3 and mixtral interleaved over RATIO_ROUNDS
# rounds; TRAIN_FP8_EXTRA: a third run per round with those flags), traingraph (the CUDAGraphs callback's
# full_iteration scope against eager at micro-batch 1, bf16 and FP8), curvesdelayed (the 300-step curves of the
# FP8 defaults against bf16 at micro-batch 4, as the curves part does for the TE tensorwise and rowwise recipes),
# trainmulti (4 or more GPUs: train_step.py on all of them, a qwen3-shaped model of $TRAIN_LAYERS
# layers, default 16, under EP=N and under TP2 x EP=N/2; the Lightning run only),
# cudacast (the CUDA C cast, kernels/cuda/fp8_delayed_cast.cu: its GPU tests against the Triton kernel's bytes,
# cast_backends.py at the three shapes, then qwen3 graphed in two rounds of bf16, FP8 and FP8 with the Triton
# casts, LIGHTNING_MOE_CAST_CUDA=0, the escape hatch docs/reference.md lists).
# The parts that A/B-timed the retired environment switches (wgradtma, tmareads, castregs) are gone; their
# results and history are in benchmarks/NOTES.md. Kernel choices are module constants now (docs/benchmarking.md).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export LIGHTNING_MOE_COMMIT="${LIGHTNING_MOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PARTS="${PARTS:-tests block ep train te fp8 curves}"  # tests already include the TE tests
RETURN_DIR="${OUT:-}"
unset OUT  # the scripts would copy every JSON there; only 8 files may come back, so pack them
LOG=/tmp/gpu_suite.log
touch "$LOG"  # appended to: several invocations in one device call share it
has() { [[ " $PARTS " == *" $1 "* ]]; }
say() { echo "== $* ($(date +%T))" | tee -a "$LOG"; }
run() { "$@" 2>&1 | grep -v -i "warn" | tee -a "$LOG"; }
num_gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')

# qwen3 CUDA-graphed in two interleaved rounds of bf16, FP8 and FP8 as VARIANT (50 steps each):
# qwen3_rounds TAG VARIANT "VARIANT_ENV"; the variant's run takes VARIANT_ENV (tags TAG_bf16_N, TAG_fp8_N,
# TAG_fp8_VARIANT_N).
qwen3_rounds() {
  local tag="$1" name="$2" extra="$3" pair variant
  for pair in 1 2; do
    for variant in bf16 fp8 "fp8_$name"; do
      say "moe_block qwen3 $variant, CUDA-graphed, round $pair"
      # shellcheck disable=SC2086  # the environment is a list of assignments
      run env $([ "$variant" = "fp8_$name" ] && echo "$extra") python3 benchmarks/moe_block.py \
        --cases qwen3_30b_a3b --precision "${variant%_"$name"}" --cuda-graph --iters 50 --tag "${tag}_${variant}_$pair"
    done
  done
}

# moe_block_with_launches FILE ARGS...: moe_block.py ARGS after running the statements in FILE (what
# best_cast_tiles.py prints: TILE_SHAPES.update(...) and the like) in lightning_moe.kernels.fp8_delayed_triton;
# the JSON's meta.command shows them ahead of the script.
moe_block_with_launches() {
  local launches="$1"; shift
  python3 -c 'import sys
sys.path.insert(0, ".")
import lightning_moe.kernels.fp8_delayed_triton as fd
from benchmarks.moe_block import main
statements = open(sys.argv[1]).read().strip()
exec(statements, vars(fd))
sys.argv = ["-c " + repr("; ".join(statements.splitlines())) + " benchmarks/moe_block.py"] + sys.argv[2:]
main(sys.argv[1:])' "$launches" "$@"
}

if has tests; then
  say "GPU tests"
  run python3 -m pytest -q -p no:cacheprovider tests/gpu
  run python3 -m pytest -q -p no:cacheprovider -m gpu tests/distributed
fi
if has block; then say "moe_block bf16"; run python3 benchmarks/moe_block.py --iters 20; fi
if has ep && [ "$num_gpus" -ge 2 ]; then say "ep_scaling"; run python3 benchmarks/ep_scaling.py --ep 1 2 --chunks 1 2 --dispatchers alltoall allgather --transports nccl copy_engine; fi
if has train; then
  say "train_step micro-batch 2"
  run python3 benchmarks/train_step.py --steps 15
  say "train_step micro-batch 4 x accumulate 2"
  run python3 benchmarks/train_step.py --steps 10 --micro-batch 4 --accumulate 2 --tag qwen3_30b_a3b_4l_mb4x2
fi
if has tetests; then say "TE tests"; run python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_te_backend_gpu.py; fi
if has te; then say "moe_block TE experts"; run python3 benchmarks/moe_block.py --backend te --iters 20; fi
if has fp8native; then  # without Transformer Engine: our FP8 GEMMs beside bf16
  say "fp8_gemm (native)"; run python3 benchmarks/fp8_gemm.py --tag fp8_gemm_native
  say "FP8 GEMM ceilings"; run python3 benchmarks/fp8_gemm_ceiling.py
  say "moe_block bf16 and native rowwise, same session"
  run python3 benchmarks/moe_block.py --iters 20 --tag grouped_mm_bf16_same_session
  run python3 benchmarks/moe_block.py --precision rowwise --iters 20 --tag grouped_mm_rowwise_per_expert
  run python3 benchmarks/moe_block.py --precision rowwise --fast-accumulation fprop dgrad wgrad --iters 20 \
    --tag grouped_mm_rowwise_fast
  run python3 benchmarks/moe_block.py --precision rowwise --fast-accumulation fprop dgrad wgrad --cache-weights \
    --iters 20 --tag grouped_mm_rowwise_fast_cached
  say "moe_block --precision fp8 (native delayed scaling, fast accumulation)"
  run python3 benchmarks/moe_block.py --precision fp8 --iters 20 --tag fp8_delayed_fast
  say "moe_block over an optimizer step of 4 micro-batches (gradient accumulation), bf16 and FP8"
  run python3 benchmarks/moe_block.py --accumulate 4 --iters 10 --tag window_bf16_x4
  run python3 benchmarks/moe_block.py --precision fp8 --cache-weights --accumulate 4 --iters 10 --tag window_fp8_cached_x4
fi
if has fp8ratio; then
  for master in ${RATIO_MASTERS:-bf16 fp32}; do
    for pair in $(seq 1 "${RATIO_ROUNDS:-2}"); do
      for precision in bf16 fp8 fp8_graphed; do
        say "moe_block qwen3 $precision, $master parameters, round $pair"
        graphed=(); [ "$precision" = fp8_graphed ] && graphed=(--graph-weight-casts)
        run python3 benchmarks/moe_block.py --cases qwen3_30b_a3b --precision "${precision%_graphed}" \
          --master-weights "$master" ${graphed[@]+"${graphed[@]}"} --iters 50 --tag "ratio_${precision}_${master}master_qwen3_$pair"
      done
    done
    for precision in bf16 fp8 fp8_graphed; do
      say "moe_block mixtral and deepseek $precision, $master parameters"
      graphed=(); [ "$precision" = fp8_graphed ] && graphed=(--graph-weight-casts)
      run python3 benchmarks/moe_block.py --cases mixtral_8x7b deepseek_v3_slice --precision "${precision%_graphed}" \
        --master-weights "$master" ${graphed[@]+"${graphed[@]}"} --iters 20 --tag "ratio_${precision}_${master}master"
    done
  done
fi
if has casttune; then
  say "delayed-cast launch shapes: registers and spills (offline compile), then the fused operands timed"
  run python3 benchmarks/cast_registers.py
  rm -f benchmarks/results/fp8_quant_tune_delayed_fused.json  # never choose from an earlier tune
  run python3 benchmarks/fp8_quant_tune.py --delayed-fused
  # the whole launch (shape, fold, cap) as the tune ran it, not the shape alone
  launches=/tmp/casttune_launches.py
  python3 benchmarks/best_cast_tiles.py >"$launches" 2>>"$LOG" || { say "best_cast_tiles.py failed (see the log)"; : >"$launches"; }
  if [ ! -s "$launches" ]; then
    say "no launch beats the library's by the margin: no A/B"
  else
    say "launches to A/B: $(tr '\n' ' ' <"$launches")"
    for pair in 1 2; do
      say "moe_block qwen3 fp8, library launches, round $pair"
      run python3 benchmarks/moe_block.py --cases qwen3_30b_a3b --precision fp8 --iters 50 --tag "casttune_library_$pair"
      say "moe_block qwen3 fp8, tuned launches, round $pair"
      run moe_block_with_launches "$launches" --cases qwen3_30b_a3b --precision fp8 --iters 50 \
        --tag "casttune_tuned_$pair"
    done
  fi
fi
if has cudagraph; then
  say "CUDA-graphed MoE layer tests"; run python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_cuda_graph_gpu.py
  for master in ${RATIO_MASTERS:-bf16 fp32}; do
    for pair in $(seq 1 "${RATIO_ROUNDS:-2}"); do
      for variant in ${CUDAGRAPH_VARIANTS:-bf16 bf16_cudagraph fp8_cudagraph}; do
        say "moe_block qwen3 $variant, $master parameters, round $pair"
        graph=(); [[ "$variant" == *_cudagraph ]] && graph=(--cuda-graph)
        run python3 benchmarks/moe_block.py --cases qwen3_30b_a3b --precision "${variant%_cudagraph}" \
          --master-weights "$master" ${graph[@]+"${graph[@]}"} --iters 50 --tag "ratio_${variant}_${master}master_qwen3_$pair"
      done
    done
  done
  for precision in ${CUDAGRAPH_OTHERS-bf16 fp8}; do
    say "moe_block mixtral and deepseek $precision, CUDA-graphed, fp32 parameters"
    run python3 benchmarks/moe_block.py --cases mixtral_8x7b deepseek_v3_slice --precision "$precision" \
      --master-weights fp32 --cuda-graph --iters 20 --tag "ratio_${precision}_cudagraph_fp32master"
  done
fi
if has cudacast; then
  say "CUDA cast GPU tests"
  python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/gpu/test_fp8_cast_cuda_gpu.py 2>&1 | tail -15 | tee -a "$LOG"
  say "the CUDA and Triton casts on the block's operands"
  run python3 benchmarks/cast_backends.py
  qwen3_rounds cudacast triton LIGHTNING_MOE_CAST_CUDA=0
fi
if has trainmulti && [ "$num_gpus" -ge 4 ]; then
  layers="${TRAIN_LAYERS:-16}"
  say "train_step on $num_gpus GPUs, EP=$num_gpus"
  run python3 benchmarks/train_step.py --skip-bare --devices "$num_gpus" --expert-parallel "$num_gpus" \
    --layers "$layers" --steps 10 --tag "qwen3_${layers}l_${num_gpus}gpu_ep${num_gpus}"
  say "train_step on $num_gpus GPUs, TP2 x EP=$((num_gpus / 2))"
  run python3 benchmarks/train_step.py --skip-bare --devices "$num_gpus" --tensor-parallel 2 \
    --expert-parallel "$((num_gpus / 2))" --layers "$layers" --steps 10 \
    --tag "qwen3_${layers}l_${num_gpus}gpu_tp2_ep$((num_gpus / 2))"
fi
# trainratio: the whole training step's FP8 (`FP8Precision()` defaults, delayed) against bf16, qwen3 (4 layers)
# and mixtral (2 layers) at accumulate 8, interleaved over RATIO_ROUNDS rounds on one machine (the FP8 step
# moves between machines more than bf16's: compare only pairs from one call); TRAIN_FP8_EXTRA: the flags of
# a third run per round (an experiment toggle, e.g. "--wgrad-prefetch-old off"), tagged fp8_variant.
if has trainratio; then
  for pair in $(seq 1 "${RATIO_ROUNDS:-2}"); do
    for model in qwen3 mixtral2l; do
      shape=(); [ "$model" = mixtral2l ] && shape=(--preset mixtral_8x7b --layers 2)
      for variant in bf16 fp8 ${TRAIN_FP8_EXTRA:+fp8_variant}; do
        flags=(); [ "$variant" != bf16 ] && flags=(--precision delayed)
        # shellcheck disable=SC2206  # TRAIN_FP8_EXTRA is a list of flags
        [ "$variant" = fp8_variant ] && flags+=($TRAIN_FP8_EXTRA)
        say "train_step $model $variant, accumulate 8, round $pair"
        run python3 benchmarks/train_step.py ${shape[@]+"${shape[@]}"} --accumulate 8 --steps 3 --warmup 1 \
          --skip-bare ${flags[@]+"${flags[@]}"} --tag "ratio_${model}_acc8_${variant}_$pair"
      done
    done
  done
fi
# traingraph: the CUDAGraphs callback's whole step (scope full_iteration) against the eager step in the same
# process, qwen3 at micro-batch 1, bf16 and FP8 delayed
if has traingraph; then
  for precision in bf16 delayed; do
    say "train_step CUDA graphs full_iteration, micro-batch 1, $precision"
    run python3 benchmarks/train_step.py --cuda-graph full_iteration --micro-batch 1 --accumulate 1 --steps 10 \
      --warmup 3 --skip-bare --precision "$precision" --tag "graph_full_iteration_mb1_$precision"
  done
fi
if has probe && [ "$num_gpus" -ge 2 ]; then say "EP link probe"; run python3 benchmarks/ep_comm_probe.py; fi
if has fp8; then
  say "fp8_gemm"; run python3 benchmarks/fp8_gemm.py
  for recipe in tensorwise blockwise delayed; do
    say "moe_block TE experts $recipe"
    run python3 benchmarks/moe_block.py --backend te --precision "$recipe" --iters 20 --tag "te_$recipe"
  done
  say "moe_block native rowwise"
  run python3 benchmarks/moe_block.py --precision rowwise --iters 20 --tag "grouped_mm_rowwise"
fi
# curve_pair MICRO_BATCH SUFFIX NAME FP8_FLAGS...: 300 steps in bf16 and in FP8 on the corpus,
# then compared (train_step_curve_{bf16,NAME}SUFFIX.json, curves_fp8_NAME_vs_bf16SUFFIX.json)
curve_pair() {
  local mb="$1" suffix="$2" name="$3"; shift 3
  local common="--data corpus --skip-bare --steps 300 --warmup 0 --micro-batch $mb --layers 2"
  say "curves bf16, micro-batch $mb"; run python3 benchmarks/train_step.py $common --tag "curve_bf16$suffix"
  say "curves $name, micro-batch $mb"; run python3 benchmarks/train_step.py $common "$@" --tag "curve_$name$suffix"
  run python3 benchmarks/compare_curves.py "benchmarks/results/train_step_curve_bf16$suffix.json" \
    "benchmarks/results/train_step_curve_$name$suffix.json" --tag "fp8_${name}_vs_bf16$suffix"
}
if has curves; then
  curve_pair 1 "" tensorwise --precision tensorwise --expert-backend te
  curve_pair 4 "_mb4" rowwise --precision rowwise --fp8-backend torch
fi
# curvesdelayed: the 300-step curves of the FP8 defaults (delayed scaling, native kernels) against bf16
if has curvesdelayed; then curve_pair 4 "_mb4_defaults" delayed --precision delayed; fi
# noise: the bf16 curve against itself with each step's 4 sequences split into 2 x 2 micro-batches
# (same sequences per step, another summation order): how far two bf16 runs drift apart
if has noise; then
  common="--data corpus --skip-bare --steps 300 --warmup 0 --layers 2"
  say "curves bf16, 2 x 2"; run python3 benchmarks/train_step.py $common --micro-batch 2 --accumulate 2 --tag curve_bf16_mb2x2
  run python3 benchmarks/compare_curves.py benchmarks/results/train_step_curve_bf16_mb4.json \
    benchmarks/results/train_step_curve_bf16_mb2x2.json --tag bf16_mb2x2_vs_bf16_mb4
fi
say "done"
if [ -n "$RETURN_DIR" ]; then
  tar czf "$RETURN_DIR/results.tgz" benchmarks/results/*.json
  cp "$LOG" "$RETURN_DIR/suite.log"
fi
