#!/usr/bin/env bash
# One device session: the GPU tests and the benchmarks named as arguments, logs and JSON to $OUT.
#   bash benchmarks/h200.sh tests movement layer e2e profile recompute precision gemm
#   bash benchmarks/h200.sh wheels torchao gpu-suite-1 quack-cache   # every GPU test, no -x,
#   bash benchmarks/h200.sh gpu-suite-2; bash benchmarks/h200.sh gpu-suite-3   # over 3 calls
#   bash benchmarks/h200.sh graph-tests lowering lowering-small   # Inductor and the CUDA-graph step
#   bash benchmarks/h200.sh multigpu ep scaling scale ddp-fsdp   # machines with several GPUs
#   bash benchmarks/h200.sh e2e-moec pp ep-no-inductor overlap     # PP sweep, EP without Inductor, overlap
#   bash benchmarks/h200.sh attention e2e-moec pp-timeline plan-search-pp plan-search
#   bash benchmarks/h200.sh e2e-moec ep-timeline    # where the EP step's time goes, one GPU's beside
#   bash benchmarks/h200.sh rowwise-tests collectives scaling-ep   # NCCL rates; the EP step alone
#   bash benchmarks/h200.sh new-gpu-tests e2e-equal-lr profile-vs-compiled  # #20's honest gap
#   bash benchmarks/h200.sh fp8-tests e2e-fp8 kernels-fp8      # FP8 rowwise experts on sm90
#   bash benchmarks/h200.sh torchao fp8-tests dense-ffn e2e-fp8  # FP8 linears beside torchao's
#   bash benchmarks/h200.sh wheels e2e-fp8-long    # #20's two targets over 20 timed steps
#   bash benchmarks/h200.sh wheels e2e-fp8-graph   # the FP8 step as a CUDA graph, beside #20's baseline
#   bash benchmarks/h200.sh torchao movement-tests lm-head dense-ffn  # the LM head's chunks; FP8 wgrad's anchor
#   bash benchmarks/h200.sh wheels torchao loss-tests lm-head   # the LM head on quack's fused loss
#   bash benchmarks/h200.sh e2e-fp8-loss     # #20's targets with it, its chunks beside, every baseline
#   bash benchmarks/h200.sh wheels fa4-tests attn-bench   # FA4's attention beside SDPA's backends
#   bash benchmarks/h200.sh wheels fa4-tests e2e-warm; bash benchmarks/h200.sh e2e-fa4  # #20 with FA4
#   bash benchmarks/h200.sh wheels e2e-fa4-lean  # the same, on a cold machine: FP8 rows (auto: FA4;
#                                               # sdpa), the baseline
#   (E2E_ARGS: more e2e.py arguments, e.g. --no-fused-loss; BASELINE: compiled-bf16 on an H100)
#   bash benchmarks/h200.sh act-tests glu lm-head-chunks  # GLU tiles and backward; LM-head chunks
#   bash benchmarks/h200.sh e2e-fp8-chunks   # #20's targets, the LM head at 2^30 and 2^31 logits
#   bash benchmarks/h200.sh gaps-fp8              # the FP8 step's device idle time, and the baseline's
#   bash benchmarks/h200.sh torchao e2e-fp8-all  # ... beside every compiled baseline, fp32 and bf16
#                                               # (a call carrying .tao: torchao's wheel, from
#                                               # ../shared/tools/device-wheels .tao torchao==0.18.0)
#   bash benchmarks/h200.sh wheels dense-ffn kmajor-compile-tests e2e-kmajor  # k-major experts
#   bash benchmarks/h200.sh wheels combined-tests layer-combined e2e-combined  # combine in experts
#   bash benchmarks/h200.sh wheels copies-tests e2e-copies  # working copies outside Inductor
#   bash benchmarks/h200.sh wheels plan-search-fold  # the search where only folded experts fit
#   bash benchmarks/h200.sh wheel-part          # a call carrying the split wheel's first part (.wpa)
#   bash benchmarks/h200.sh wheels cute-e2e cute-layer   # the next, carrying .whl and the last
#                                               # part (.wpb): quack-kernels + the CuTe DSL
# (../shared/tools/device-wheels .whl prepares .whl and .whl-parts; one call carries at most
# 64 MiB, so move the .part.aa file into .wpa/ and .part.ab into .wpb/; the two calls go back to
# back, within the 30 s the machine stays warm)
# Stages run in the order given; a failing stage is logged and the next one still runs; each is
# killed after $STAGE_LIMIT seconds (a hung collective must not eat the session).
set -u
export PYTHONPATH=$PWD MOEC_AUTOTUNE=${MOEC_AUTOTUNE:-0} QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-$HOME/quack_cache}
# NVLink multicast stays off: it can take a shared host's GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l)
RUN="torchrun --standalone --nproc-per-node $GPUS"
STAGE_LIMIT=${STAGE_LIMIT:-540}
OUT=${OUT:-/tmp/moec_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
# SM clock, power and temperature every 200 ms while the stages run (slow steps that come with
# clock dips under the power cap show there); summarised at the end over the busy samples
nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu \
  --format=csv,noheader,nounits -lms 200 > "$OUT/clocks.csv" 2>/dev/null &
CLOCKS=$!
trap 'kill $CLOCKS 2>/dev/null' EXIT
# a quack cache a previous session brought back (stage quack-cache) in .qcache: no cold compiles
restore_quack_cache() {
  if [ -f .qcache/quack_cache.tgz ]; then mkdir -p "$QUACK_CACHE_DIR" &&
    tar xzf .qcache/quack_cache.tgz -C "$QUACK_CACHE_DIR" && du -sh "$QUACK_CACHE_DIR"; fi
}
for stage in "$@"; do
  start=$(date +%s)
  case $stage in
    tests) timeout $STAGE_LIMIT python -m pytest -q -x tests/gpu ;;
    # every GPU test, no -x, in three stages: ~17 minutes with a cold CuTe DSL cache
    gpu-suite-1) timeout $STAGE_LIMIT python -m pytest -q -rfE --slow tests/gpu/test_[a-g]*.py ;;
    gpu-suite-2) timeout $STAGE_LIMIT python -m pytest -q -rfE --slow tests/gpu/test_kernels_ops.py ;;
    gpu-suite-3) timeout $STAGE_LIMIT python -m pytest -q -rfE --slow tests/gpu/test_[l-z]*.py ;;
    kernel-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_kernels_ops.py tests/gpu/test_sync_free.py ;;
    sync) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_sync_free.py ;;
    movement) timeout $STAGE_LIMIT python -m benchmarks.movement --json "$OUT/movement.json" ;;
    layer) timeout $STAGE_LIMIT python benchmarks/moe_layer.py --json "$OUT/layer.json" ;;
    e2e) timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 6 --warmup 3 --json "$OUT/e2e.json" ;;
    profile) timeout $STAGE_LIMIT python -m benchmarks.profile_step --shapes --moec-only --rows 30 ;;
    profile-vs-compiled) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --baseline compiled-bf16 --rows 30 ;;
    recompute) timeout $STAGE_LIMIT python -m benchmarks.recompute --full --steps 4 --out "$OUT/recompute_full.json" ;;
    precision) timeout $STAGE_LIMIT python benchmarks/precision_gemm.py --out "$OUT/precision_gemm.json" ;;
    gemm) timeout $STAGE_LIMIT python benchmarks/grouped_gemm.py --json "$OUT/gg.json" ;;
    graph-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_step_graph_gpu.py tests/gpu/test_sync_free.py ;;
    lowering) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 6 --warmup 4 --no-inductor --cuda-graph --json "$OUT/e2e_lowering.json" ;;
    e2e-graph) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --moec-only --cuda-graph --steps 8 --warmup 4 --json "$OUT/e2e_graph.json" ;;
    lowering-small) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --small --steps 30 --warmup 5 --no-inductor --cuda-graph --json "$OUT/e2e_lowering_small.json" ;;
    e2e-moec) timeout $STAGE_LIMIT python benchmarks/e2e.py --moec-only --json "$OUT/e2e.json" ;;
    multigpu) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_multigpu.py ;;
    ep) timeout $STAGE_LIMIT $RUN benchmarks/ep.py --json "$OUT/ep.json" $([ "$GPUS" -gt 1 ] || echo --no-step) ;;
    scaling) single=$([ -f "$OUT/e2e.json" ] && echo "--single $OUT/e2e.json")
      for args in "--ep $GPUS --path rowwise" "--pp $GPUS"; do
        timeout $STAGE_LIMIT $RUN benchmarks/scaling.py $args $single; done ;;
    pp) single=$([ -f "$OUT/e2e.json" ] && echo "--single $OUT/e2e.json")
      timeout $STAGE_LIMIT $RUN benchmarks/scaling.py --pp $GPUS --microbatches 4 8 16 --sync-trace $single --json "$OUT/pp.json" ;;
    ep-no-inductor) single=$([ -f "$OUT/e2e.json" ] && echo "--single $OUT/e2e.json")
      timeout $STAGE_LIMIT $RUN benchmarks/scaling.py --ep $GPUS --path rowwise --inductor false $single --json "$OUT/ep_no_inductor.json" ;;
    pp-inductor) single=$([ -f "$OUT/e2e.json" ] && echo "--single $OUT/e2e.json")
      timeout $STAGE_LIMIT $RUN benchmarks/scaling.py --pp $GPUS --microbatches 8 --inductor true $single --json "$OUT/pp_inductor.json" ;;
    overlap) timeout $STAGE_LIMIT $RUN benchmarks/ep.py --overlap --paths rowwise,a2a_capacity --iters 20 --steps 5 --kernels 8 --json "$OUT/ep_overlap.json" ;;
    pp-timeline) single=$([ -f "$OUT/e2e.json" ] && echo "--single $OUT/e2e.json")
      timeout $STAGE_LIMIT $RUN benchmarks/scaling.py --pp $GPUS --microbatches 16 --timeline "$OUT/tl" --kernels "$OUT/k" $single --json "$OUT/pp_timeline.json" ;;
    ep-timeline) single=$([ -f "$OUT/e2e.json" ] && echo "--single $OUT/e2e.json")
      timeout $STAGE_LIMIT $RUN benchmarks/scaling.py --ep $GPUS --path rowwise --timeline "$OUT/tl" --kernels "$OUT/k" $single --json "$OUT/ep_timeline.json" &&
      timeout $STAGE_LIMIT torchrun --standalone --nproc-per-node 1 benchmarks/scaling.py --timeline "$OUT/tl1" --kernels "$OUT/k1" &&
      python -m benchmarks.timeline_diff "$OUT/tl_pp1_mb4_rank0.json" "$OUT/tl1_pp1_mb4_rank0.json" ;;
    collectives) timeout $STAGE_LIMIT $RUN benchmarks/collectives.py --json "$OUT/collectives.json" ;;
    rowwise-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_multigpu.py -k "one_gpu or every_path" ;;
    scaling-ep) single=$([ -f "$OUT/e2e.json" ] && echo "--single $OUT/e2e.json")
      timeout $STAGE_LIMIT $RUN benchmarks/scaling.py --ep $GPUS --path rowwise $single --json "$OUT/scaling_ep.json" ;;
    plan-search) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT $RUN benchmarks/autoplan_validate.py --json "$OUT/autoplan.json" ;;
    plan-search-top4) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT $RUN benchmarks/autoplan_validate.py --top 4 --no-examples --json "$OUT/autoplan_top4.json" ;;
    plan-search-top2-long) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT $RUN benchmarks/autoplan_validate.py --top 2 --no-examples --steps 12 --warmup 3 --json "$OUT/autoplan_top2_long.json" ;;
    plan-search-fold) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT $RUN benchmarks/autoplan_validate.py --memory-fraction 0.40 --top 3 --no-examples --json "$OUT/autoplan_fold.json" ;;
    plan-search-pp) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT $RUN benchmarks/autoplan_validate.py --pp $GPUS --global-seqs 48 --top 3 --no-examples --json "$OUT/autoplan_pp.json" ;;
    new-gpu-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_symbolic_capture_gpu.py ;;
    e2e-equal-lr) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 8 --warmup 6 --dropless --no-inductor --baselines compiled-bf16 --json "$OUT/e2e_equal_lr.json" ;;
    attention) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 6 --warmup 4 --attention cudnn --baselines compiled-bf16 --json "$OUT/e2e_attention.json" ;;
    scale) timeout $STAGE_LIMIT $RUN benchmarks/scale.py upcycle --json "$OUT/scale_upcycle.json" ;;
    ddp-fsdp) timeout $STAGE_LIMIT $RUN benchmarks/scale.py ddp-vs-fsdp --json "$OUT/ddp_fsdp.json" ;;
    wheel-part) mkdir -p ~/wheelparts && cp -v .whl-parts/* .wp?/* ~/wheelparts/ 2>/dev/null
      restore_quack_cache ;;
    wheels) mkdir -p ~/wheelparts && cp -v .whl-parts/* .wp?/* ~/wheelparts/ 2>/dev/null
      restore_quack_cache
      for w in $(ls ~/wheelparts | sed 's/\.part\...$//' | sort -u); do
        cat ~/wheelparts/"$w".part.* > /tmp/"$w"; done
      # the interpreter of the stages: a bare `pip` there installs for another one
      python -m pip install -q --no-index --no-deps /tmp/*.whl $(ls .whl/*.whl | grep -v torchao) &&
        python -c "import cutlass, quack; print('quack', quack.__version__, cutlass.__file__)" ;;
    cute-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_kernels_ops.py -k "cute or layer_step" ;;
    cute-gemm) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/grouped_gemm.py --m 1024 4096 32768 131072 --json "$OUT/gg_cute.json" ;;
    cute-e2e) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --moec-only --steps 8 --warmup 6 --json "$OUT/e2e_cute.json" ;;
    kernels) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --moec-only --rows 5 --kernels 5 ;;
    op-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_kernels_ops.py -k "expert_mlp_forward or cross_entropy or layer_step or glu" tests/gpu/test_sync_free.py ;;
    e2e-inductor) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 8 --warmup 6 --no-inductor --baselines compiled-bf16 --json "$OUT/e2e_inductor.json" ;;
    kernel-shapes) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --moec-only --rows 40 --shapes --kernels 8 ;;
    sonic-layer) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/moe_layer.py --skip-loop --json "$OUT/layer_sonic.json" ;;
    layer-kernels) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/moe_layer.py --skip-loop --kernels 30 --json "$OUT/layer_kernels.json" ;;
    quack-layouts) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/quack_layouts.py --json "$OUT/quack_layouts.json" ;;
    kmajor-tests) timeout $STAGE_LIMIT python -m pytest -q -x tests/gpu/test_kernels_ops.py -k "k_major" ;;
    layer-kmajor) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/moe_layer.py --skip-loop --layers sorted,moec_k_major,sonic --kernels 12 --json "$OUT/layer_kmajor.json" ;;
    kmajor-compile-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_sync_free.py tests/gpu/test_step_graph_gpu.py tests/gpu/test_kernels_ops.py -k "k_major or adamw or sync or graph or layer_step" ;;
    dense-ffn) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/dense_ffn.py --json "$OUT/dense_ffn.json" ;;
    e2e-kmajor) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --moec-only --n-major --steps 8 --warmup 6 --json "$OUT/e2e_kmajor.json" ;;
    e2e-gather) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --gather-up --baselines compiled-bf16 --steps 8 --warmup 6 --json "$OUT/e2e_gather.json" ;;
    profile-moec) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --moec-only --rows 30 ;;
    quack-cache) du -sh "$QUACK_CACHE_DIR"; tar czf "$OUT/quack_cache.tgz" -C "$QUACK_CACHE_DIR" . && ls -la "$OUT/quack_cache.tgz" ;;
    combined-tests) timeout $STAGE_LIMIT python -m pytest -q -x tests/gpu/test_combined_experts_gpu.py ;;
    layer-combined) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/moe_layer.py --skip-loop --layers sorted,moec_k_major,moec_combined --kernels 12 --json "$OUT/layer_combined.json" ;;
    e2e-combined) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --moec-only --gather-up --combine-in-experts --steps 8 --warmup 6 --json "$OUT/e2e_combined.json" ;;
    e2e-copies) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --copies-traced --baselines compiled-bf16 --steps 8 --warmup 6 --json "$OUT/e2e_copies.json" ;;
    copies-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_sync_free.py tests/gpu/test_step_graph_gpu.py tests/gpu/test_symbolic_capture_gpu.py ;;
    ce) timeout $STAGE_LIMIT python benchmarks/cross_entropy.py --json "$OUT/cross_entropy.json" ;;
    row-quantizer) timeout $STAGE_LIMIT python benchmarks/row_quantizer.py --json "$OUT/row_quantizer.json" ;;
    fuse-linears) timeout $STAGE_LIMIT python benchmarks/fuse_linears.py --json "$OUT/fuse_linears.json" ;;
    loss-tests) timeout $STAGE_LIMIT python -m pytest -q -rfE tests/gpu/test_kernels_ops.py -k "cross_entropy or fused_loss" &&
      timeout $STAGE_LIMIT python -m pytest -q -rfE tests/gpu/test_sync_free.py ;;
    e2e-fp8-loss) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 8 --warmup 4 --fp8 --chunked-loss --baselines compiled-fp32 compiled-bf16 compiled-bf16-float8 --json "$OUT/e2e_fp8_loss.json" ;;
    lm-head) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/lm_head.py --json "$OUT/lm_head.json" ;;
    movement-tests) timeout $STAGE_LIMIT python -m pytest -q -rfE tests/gpu/test_kernels_ops.py -k "dispatch_combine or cross_entropy or layer_step" tests/gpu/test_sync_free.py ;;
    cute-layer) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/moe_layer.py --pieces --skip-loop --json "$OUT/layer_cute.json" ;;
    e2e-recompute) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 4 --warmup 2 --moec-only --recompute --json "$OUT/e2e_recompute.json" ;;
    recompute-snapshot) timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 2 --warmup 2 --moec-only --recompute --memory-snapshot "$OUT/snapshots" --json "$OUT/e2e_recompute_snapshot.json" ;;
    fp8-tests) timeout $STAGE_LIMIT python -m pytest -q tests/gpu/test_fp8_experts_gpu.py tests/gpu/test_mxfp8_gpu.py ;;
    e2e-fp8) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 6 --warmup 4 --fp8 --baselines compiled-bf16 compiled-bf16-float8 --json "$OUT/e2e_fp8.json" ;;
    e2e-fp8-all) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 8 --warmup 4 --fp8 --baselines compiled-fp32 compiled-fp32-float8 compiled-bf16 compiled-bf16-float8 --json "$OUT/e2e_fp8_all.json" ;;
    torchao) python -m pip install -q --no-index --no-deps .tao/*.whl && python -c "import torchao; print('torchao', torchao.__version__)" ;;
    kernels-fp8) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --moec-only --rows 5 --kernels 5 --fp8 ;;
    profile-fp8-vs-float8) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --baseline compiled-bf16-float8 --fp8 dense_ffn --rows 30 ;;
    e2e-fp8-long) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 20 --warmup 4 --fp8 --baselines compiled-fp32 --json "$OUT/e2e_fp8_long.json" ;;
    e2e-fp8-graph) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 10 --warmup 4 --fp8 --cuda-graph --baselines compiled-fp32 --json "$OUT/e2e_fp8_graph.json" ;;
    gaps-fp8) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --baseline compiled-fp32 --fp8 dense_ffn --rows 5 --gaps 25 --steps 3 ;;
    kernels-fp8-all) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python -m benchmarks.profile_step --moec-only --rows 5 --kernels 5 --fp8 routed_experts shared_expert attn_qkv attn_out ;;
    fa4-tests) timeout $STAGE_LIMIT python -m pytest -q -rfE tests/gpu/test_flash_attention_gpu.py tests/gpu/test_attention_backend_gpu.py ;;
    attn-bench) timeout $STAGE_LIMIT python benchmarks/attention.py --json "$OUT/attention.json" ;;
    e2e-warm) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --moec-only --fp8 --rows "fp8 rowwise dense FFNs$" --steps 1 --warmup 1 ${E2E_ARGS:-} --json "$OUT/e2e_warm.json" ;;
    e2e-fa4) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 20 --warmup 4 --fp8 --attention sdpa --baselines ${BASELINE:-compiled-fp32} ${E2E_ARGS:-} --json "$OUT/e2e_fa4.json" ;;
    e2e-fa4-lean) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 12 --warmup 4 --fp8 --attention sdpa --baselines ${BASELINE:-compiled-fp32} --rows "fp8 rowwise dense FFNs($| \+ sdpa)|compiled" ${E2E_ARGS:-} --json "$OUT/e2e_fa4_lean.json" ;;
    loss-crash) CUDA_LAUNCH_BLOCKING=1 MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/lm_head.py --chunks 30 ;;
    act-tests) timeout $STAGE_LIMIT python -m pytest -q -rfE tests/gpu/test_kernels_ops.py -k "activation or glu" ;;
    glu) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/glu.py --json "$OUT/glu.json" ;;
    lm-head-chunks) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/lm_head.py --chunks 30 31 32 --json "$OUT/lm_head_chunks.json" ;;
    e2e-fp8-chunks) MOEC_AUTOTUNE=1 timeout $STAGE_LIMIT python benchmarks/e2e.py --steps 20 --warmup 4 --fp8 --loss-chunks 31 --baselines compiled-fp32 --json "$OUT/e2e_fp8_chunks.json" ;;
    *) echo "unknown stage $stage"; continue ;;
  esac > "$OUT/$stage.log" 2>&1
  echo "== $stage rc=$? $(( $(date +%s) - start ))s"
  tail -n 25 "$OUT/$stage.log"
done
kill $CLOCKS 2>/dev/null
awk -F', ' '$4 > 300 {n++; c=$3; p=$4; if (n == 1 || c < lo) lo = c; if (c > hi) hi = c;
  if (p > pmax) pmax = p} END {if (n) printf "SM clock while busy (> 300 W) %d-%d MHz, power up to %.0f W (%d samples)\n",
  lo, hi, pmax, n}' "$OUT/clocks.csv"
# the device tool brings back at most 8 files from $OUT: more (profiles, traces) travel as one tarball
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/moec_results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete &&
    mv /tmp/moec_results.tgz "$OUT/results.tgz" && echo "results in $OUT/results.tgz"
fi
