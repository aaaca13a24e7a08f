#!/usr/bin/env bash
# One device call that runs the named stages in order and leaves logs and results under $OUT:
#   PYTHONPATH=src bash benchmarks/gpu_run.sh tests convergence bench16 fsdp12b
# tests        the CUDA test suite (tests/gpu and the CPU files with CUDA variants; GPU_TESTS="files" for a
#              subset). The whole suite runs ~20 minutes, more than one call allows: run it as `tests1`
#              (the tests/gpu files before test_gemm_cuda.py), `tests3` (test_gemm_cuda.py and the tests/gpu
#              files after it but the packers': tests1 whole no longer fit the 570 s limit) and `tests2` (the
#              packer tests and the CPU files with CUDA variants, about 7 min), one call each; logs
#              $OUT/gpu_tests1.log, gpu_tests2.log, gpu_tests3.log.
#              GPU_TESTS is split at spaces; GPU_TESTS_K="a or b" is passed whole as pytest's -k
# kernels      benchmarks/bench_kernels.py: every packer and GEMM at the Flux-12B shapes
# onepass      benchmarks/bench_onepass.py: the one-pass row packer against the two-pass one at every Flux
#              activation and gradient width, M = 16384 and 32768, bits checked ($OUT/bench_onepass.json; ONEPASS_ARGS)
# ncuonepass   Nsight Compute on the two passes and the one-pass kernel, X at NCU_ONEPASS_SHAPES (default
#              "32768,3072 32768,12288"): DRAM bytes, L2 hit rates, stalls; $OUT/ncu_onepass_MxC.txt
# layers       benchmarks/bench_layers.py: MXFP6Linear / FusedMXFP6MLP / peer vs bf16
# layerprofile per-kernel times of single linears (LAYER_PROFILE="proj 16384 proj 32768")
# convergence  benchmarks/convergence.py: bf16 vs MXFP6, same seed, width 768
# erefdrift    benchmarks/probe_eref_drift.py: the columns' e_ref drift step to step at width 768, batch 64 (the demo data)
# bench16      `mxflux bench step --proxy` at micro-batch 16: bf16, fp8-tensorwise, fp8-rowwise, mxfp6,
#              each in its own process, with the bare loop and one profiled step (BENCH_SETTINGS,
#              BENCH_ARGS to change; the memory settings: BENCH_SETTINGS=mxfp6,mxfp6-repack,mxfp6-repack-sac,
#              the last with activation_checkpointing: mx_packers; all in src/mxflux/bench/compare.py
#              SETTINGS; the trainer's step captured as one CUDA graph: BENCH_SETTINGS=bf16,bf16-graph,
#              fp8-tensorwise,fp8-tensorwise-graph,mxfp6,mxfp6-graph; torchao at MXFP6's accumulation, no
#              fast accumulation in its forward GEMM: fp8-tensorwise-exact); JSON $OUT/bench_step_mbs16.json
# bench32, bench64  the same at micro-batch 32, 64 ($OUT/bench_step_mbs32.json, ...)
# memory       `--memory` breakdown of one step at micro-batch 16 for bf16, fp8-tensorwise, mxfp6
#              ($OUT/memory_mbs16.json, tables in $OUT/memory_mbs16.log; MEMORY_MBS, MEMORY_SETTINGS to change)
# fsdp12b      flux-12b with FSDP2 over every visible GPU (`mxflux bench step` under torchrun)
# deep         the flux-12b width at DEEP_BLOCKS (double,single; default 6,12) and micro-batch DEEP_MBS (8),
#              DEEP_SETTINGS (bf16-graph,mxfp6-graph) alternated DEEP_ROUNDS (3) times: MXFP6 / bf16 within each
#              round, mean and range (issue 13's deep-model check; ~5 min at 6+12); $OUT/deep_mbs$DEEP_MBS.json.
#              DEEP_ARGS adds arguments. The step without graphs, device idle time profiled, the eager bare loop:
#              DEEP_SETTINGS=bf16,fp8-tensorwise,mxfp6 DEEP_ROUNDS=1 DEEP_ARGS="--profile-steps 1 --bare-loop"
#              (mxfp6-inline-pack: the opt-in inline packers, MXFLUX_INLINE_PACK=1)
# lora         benchmarks/bench_lora.py: the 12B LoRA step at 1024², LORA_IMPLS (mxfp6,peft) each in its own process
# userloop     benchmarks/bench_user_loop.py: the proxy in a loop of one's own at USERLOOP_MBS (64): bf16, torchao FP8
#              and MXFP6 with torch's AdamW, MXFP6 with mxflux.optim.AdamW; JSON $OUT/bench_user_loop_mbs*.json
# fp8seq       benchmarks/probe_fp8_in_process.py: torchao tensorwise then rowwise in one process
# host         benchmarks/bench_host.py: host time per MX op call (op dispatch, our Python, Triton launch), and
#              benchmarks/bench_host_linear.py: per compiled linear fwd+bwd against nn.Linear and torchao FP8
# gemmtune     benchmarks/probe_scaled_mm_autotune.py: cuBLAS's row-wise scaled FP8 GEMM against inductor's
#              autotuned Triton templates at the Flux shapes, contract checked (GEMMTUNE_ARGS)
# rowgemm      benchmarks/probe_rowwise_gemm.py: every cuBLASLt algorithm for the row-wise scaled GEMM at the Flux
#              shapes (ctypes), timed beside torch's row-wise and tensor-wise, with and without fast accumulation,
#              and CUTLASS's row-wise grouped GEMM inside torch (`torch._scaled_grouped_mm`, one group)
# optimizer    benchmarks/bench_optimizer.py: the AdamW step alone, torch's fused kernel (clip pass, grad_scale)
#              against the Triton kernel at several launch shapes (OPTIM_ARGS, e.g. "--blocks 6,12")
# passes       benchmarks/probe_pack_passes.py: the row-granularity packer's two passes timed apart;
#              PACK_VARIANTS="ab_x.py ..." also times those copies of operands_cuda.py (another branch's:
#              `git show BRANCH:src/mxflux/kernels/operands_cuda.py > ab_x.py` here), each in its own
#              process, the tree's before and after them ($OUT/pack_passes_*.json)
# sweepcomm    benchmarks/sweep_comm.py: FSDP2 blocks per unit for SWEEP_RECIPE on every visible GPU
# cutedsl      installs CuTe DSL from .cutedsl/a, b or c (whichever are there) into /tmp/site-cute;
#              benchmarks/cutedsl_carry.sh says how the three parts come over in two calls
# cuterow      benchmarks/probe_cute_rowwise_gemm.py: the CuTe-DSL row-scaled FP8 GEMM against cuBLAS's
#              row-scaled and tensor-wise GEMMs at the Flux fprop, dgrad and wgrad shapes, contract checked
#              (CUTEROW_ARGS, e.g. "--configs 128x256-2x1"; "--operands packed --clock": operands packed as the
#              step packs them, the SM clock and power recorded); needs the `cutedsl` stage's three parts
# quackgemm    benchmarks/probe_quack_gemm.py: quack's Hopper FP8 GEMM (promoted sums, ping-pong and cooperative)
#              beside ours and cuBLAS at the Flux shapes, on operands packed as the step packs them (QUACKGEMM_ARGS,
#              e.g. "--m 16384,32768"); needs the `cutedsl` stage's three parts (quack-kernels is in .cutedsl/a)
# ncugemm      benchmarks/probe_gemm_ncu.py under Nsight Compute: our GEMM (fp32, fp32h) and cuBLAS's (tensor-wise with
#              and without fast accumulation, row-scaled), one profiled launch each at NCU_ARGS' problems (default
#              "--problems linear1:fprop,linear2:dgrad,linear1:wgrad"); $OUT/ncu_gemm.json; needs the `cutedsl` stage
# Stages that run a kernel not yet run on a GPU stop at a time limit (TESTS_TIMEOUT 570 s, KERNELS_TIMEOUT
# 400, CUTEROW_TIMEOUT 300) rather than spend the call on a hang; pytest -v logs each test as it ends.
# Two GPUs, one call (background job + `wait`, never a pgrep on a pattern the command line contains):
#   export OUT; CUDA_VISIBLE_DEVICES=1 bash benchmarks/gpu_run.sh convergence >$OUT/conv.log 2>&1 &
#   CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_run.sh bench16 >$OUT/bench16.log 2>&1; wait
#   bash benchmarks/gpu_run.sh fsdp12b >$OUT/fsdp12b.log 2>&1
# The results record the commit they measured (mxflux.bench.provenance); the device's copy of the tree may
# carry a stale .git (the session's first commit), so pass the commit sent: MXFLUX_GIT_COMMIT=$(git rev-parse HEAD) MXFLUX_GIT_DIRTY=$(git diff --quiet HEAD && echo 0 || echo 1)
# Wheels in .whl/ (pydantic for torch 2.11's Python 3.12, torchao, ...: ~7 MiB; `bash benchmarks/gpu_wheels.sh`
# writes them) are installed to /tmp/site, and those in .whl-lora/ (diffusers, transformers, tokenizers, hf_xet:
# ~31 MiB, only `lora` needs them) when carried: apart, .whl fits beside CuTe DSL's first part
# (benchmarks/cutedsl_carry.sh).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for folder_marker in .whl:pydantic .whl-lora:diffusers; do  # each folder once per machine (its marker package)
  folder=${folder_marker%:*}
  if ls "$folder"/*.whl >/dev/null 2>&1 && [ ! -d "/tmp/site/${folder_marker#*:}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$folder"/*.whl
  fi
done
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site  # every invocation, not only the installing one
# CuTe DSL's packages sit one level down (its wheel adds them by a .pth file, which a --target folder skips)
cute_on_path() {
  case ":$PYTHONPATH:" in *:/tmp/site-cute:*) ;;
    *) export PYTHONPATH=$PYTHONPATH:/tmp/site-cute:/tmp/site-cute/nvidia_cutlass_dsl/dsl_packages ;; esac
}
[ -d /tmp/site-cute/nvidia_cutlass_dsl ] && cute_on_path
python3 -c "import pydantic, yaml, rich, safetensors" || { echo "missing Python packages (carry .whl/)"; exit 3; }
[ -n "${MXFLUX_GIT_COMMIT:-}" ] || echo "warning: no MXFLUX_GIT_COMMIT: results name whatever commit a .git here says"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests|tests1|tests2|tests3)
      packer_tests="tests/gpu/test_operands_cuda.py tests/gpu/test_operands_interpreted.py tests/gpu/test_operands_inline.py tests/gpu/test_triton_compile.py"
      case $stage in
        tests) files="tests/gpu tests/test_saved_tensors.py tests/test_nn_repack_weights.py" ;;
        tests1|tests3)  # the tests/gpu files but the packers', split at test_gemm_cuda.py
          files=$(ls tests/gpu/test_*.py | grep -vxF -f <(tr ' ' '\n' <<<"$packer_tests") |
                  awk -v later=$([ $stage = tests3 ] && echo 1 || echo 0) '($0 >= "tests/gpu/test_gemm_cuda.py") == later') ;;
        tests2) files="$packer_tests tests/test_saved_tensors.py tests/test_nn_repack_weights.py" ;;
      esac
      log="$OUT/gpu_$stage.log"
      # (-v: one line per test as it ends, line-buffered, so a call cut by its time limit still
      # names what ran and passed)
      # GPU_TESTS_WORKERS=N: N pytest workers share the GPU, a file each at a time (most of the suite's time
      # is compiling kernels on the CPU; the device has 16 cores)
      timeout ${TESTS_TIMEOUT:-570} python3 -m pytest -v --tb=short --durations=10 --slow ${GPU_TESTS:-$files} \
        ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ${GPU_TESTS_WORKERS:+-n $GPU_TESTS_WORKERS --dist loadfile} -p no:cacheprovider 2>&1 | grep --line-buffered -v "^W11" > "$log"
      grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$log" | tail -40 ;;
    kernels)
      timeout ${KERNELS_TIMEOUT:-400} python3 benchmarks/bench_kernels.py --out "$OUT" 2>&1 | grep -v "^W11" | tail -120 ;;
    onepass)
      timeout ${ONEPASS_TIMEOUT:-300} python3 benchmarks/bench_onepass.py --out "$OUT" ${ONEPASS_ARGS:-} 2>&1 |
        grep -v "^W11" | tail -24 ;;
    ncuonepass)
      for shape in ${NCU_ONEPASS_SHAPES:-32768,3072 32768,12288}; do
        f="$OUT/ncu_onepass_${shape/,/x}.txt"
        timeout ${NCU_TIMEOUT:-250} ncu --clock-control none -k "regex:_pack_kernel|_onepass_kernel" -c 3 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
          --section SchedulerStats --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
          python3 benchmarks/bench_onepass.py --profile-one "$shape" > "$f" 2>&1
        echo "ncu $shape rc $?"
        grep -E "_pack_kernel|_onepass_kernel|Duration|DRAM Throughput|dram__bytes|hit_rate|Registers Per|Achieved Occ" \
          "$f" | head -40
      done ;;
    layerprofile)  # per-kernel time of single linears' fwd+bwd (LAYER_PROFILE="proj 16384 qkv 32768 ...")
      set -- ${LAYER_PROFILE:-proj 16384 proj 32768}; a=()
      while [ $# -ge 2 ]; do a+=(--profile "$1" "$2"); shift 2; done
      python3 benchmarks/bench_layers.py "${a[@]}" 2>&1 | grep -v "^W11" | tail -60 ;;
    layers)
      python3 benchmarks/bench_layers.py --json "$OUT/bench_layers.json" ${LAYERS_ARGS:-} 2>&1 | grep -v "^W11" | tail -40 ;;
    convergence)
      python3 benchmarks/convergence.py --out "$OUT" ${CONVERGENCE_ARGS:-} 2>&1 | grep -v "^W11" | tail -8 ;;
    erefdrift)  # benchmarks/probe_eref_drift.py at the width-768 convergence model (EREFDRIFT_STEPS, default 1000)
      timeout ${EREFDRIFT_TIMEOUT:-540} python3 benchmarks/probe_eref_drift.py --steps ${EREFDRIFT_STEPS:-1000} \
        --set "model.overrides={hidden_size: 768, num_heads: 12, depth: 2, depth_single_blocks: 4}" \
        --set batch.global_batch_size=64 --set batch.micro_batch_size=64 --json "$OUT/eref_drift_width768.json" \
        2>&1 | grep -v "^W11" | tail -16 ;;
    bench16|bench32|bench64)
      # Budget: a setting compiles the proxy in ~1-2 min (the bare loop reuses the trainer's
      # compiled code), so 4 settings fit the 10-minute call only with the per-setting timeout.
      mbs=${stage#bench}
      timeout ${BENCH_TIMEOUT:-550} python3 -m mxflux.cli bench step --proxy --mbs $mbs \
        --settings ${BENCH_SETTINGS:-bf16,fp8-tensorwise,fp8-rowwise,mxfp6} --setting-timeout ${SETTING_TIMEOUT:-130} \
        ${BENCH_ARGS:---steps 6 --warmup 2 --profile-steps 1 --bare-loop} \
        --json "$OUT/bench_step_mbs$mbs.json" > "$OUT/bench$mbs.log" 2>&1
      grep -v "^\[" "$OUT/bench$mbs.log" | grep -v "^W11" | tail -60 ;;
    memory)
      timeout ${BENCH_TIMEOUT:-550} python3 -m mxflux.cli bench step --proxy --mbs ${MEMORY_MBS:-16} \
        --settings ${MEMORY_SETTINGS:-bf16,fp8-tensorwise,mxfp6} --setting-timeout ${SETTING_TIMEOUT:-170} \
        --steps 2 --warmup 2 --memory "$OUT/memory_mbs${MEMORY_MBS:-16}.json" \
        --json "$OUT/bench_step_memory_mbs${MEMORY_MBS:-16}.json" > "$OUT/memory_mbs${MEMORY_MBS:-16}.log" 2>&1
      grep -vE "W11|I11" "$OUT/memory_mbs${MEMORY_MBS:-16}.log" | tail -150 ;;
    fsdp12b)  # the full flux-12b under FSDP2 on all visible GPUs, MXFP6 then bf16 (same recipe otherwise)
      n=$(nvidia-smi -L | wc -l)
      for prec in mxfp6 bf16; do
        mbs=${FSDP_MBS:-8}
        timeout ${FSDP_TIMEOUT:-300} python3 -m torch.distributed.run --nproc_per_node $n -m mxflux.cli bench step --recipe flux12b-mxfp6-dev \
          --synthetic --steps ${FSDP_STEPS:-4} --warmup 2 --profile-steps ${FSDP_PROFILE:-1} --json "$OUT/fsdp12b_$prec.json" --settings $prec \
          ${FSDP_ARGS:-model.compile=false model.activation_checkpointing=true} batch.micro_batch_size=$mbs \
          batch.global_batch_size=$((mbs * n)) data.num_workers=2 2>&1 | grep -v "^W11" | tail -22
      done ;;
    deep)
      IFS=, read -r nd ns <<<"${DEEP_BLOCKS:-6,12}"; mbs=${DEEP_MBS:-8}
      timeout ${BENCH_TIMEOUT:-560} python3 -m mxflux.cli bench step --recipe flux12b-mxfp6-dev --synthetic \
        --set "model.overrides={depth: $nd, depth_single_blocks: $ns}" --set model.compile=true --mbs $mbs \
        --settings ${DEEP_SETTINGS:-bf16-graph,mxfp6-graph} --rounds ${DEEP_ROUNDS:-3} --setting-timeout ${SETTING_TIMEOUT:-150} \
        --steps 8 --warmup 3 ${DEEP_ARGS:-} --json "$OUT/deep_mbs$mbs.json" > "$OUT/deep_mbs$mbs.log" 2>&1
      grep -v "^\[" "$OUT/deep_mbs$mbs.log" | grep -v "^W11" | tail -40 ;;
    lora)  # benchmarks/bench_lora.py: the 12B LoRA step, ours (the recipe's checkpointing) against diffusers + peft
      timeout ${LORA_TIMEOUT:-500} python3 benchmarks/bench_lora.py --impls ${LORA_IMPLS:-mxfp6,peft} --steps 8 \
        --timeout 150 --out "$OUT" > "$OUT/lora.log" 2>&1; grep -v "^W11" "$OUT/lora.log" | grep -v device_time | tail -20 ;;
    userloop)  # benchmarks/bench_user_loop.py: a loop of one's own, torch's AdamW against mxflux.optim.AdamW
      timeout ${USERLOOP_TIMEOUT:-550} python3 benchmarks/bench_user_loop.py --mbs ${USERLOOP_MBS:-64} --timeout 130 \
        --out "$OUT" > "$OUT/userloop.log" 2>&1; grep -v "^W11" "$OUT/userloop.log" | tail -20 ;;
    cutedsl)  # a: the small wheels; b, c: the CUDA-13 library wheel's files (benchmarks/cutedsl_carry.sh)
      if ls .cutedsl/a/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-cute .cutedsl/a/*.whl
      fi
      for part in .cutedsl/b/*.tar.xz .cutedsl/c/*.tar.xz; do
        [ -f "$part" ] && mkdir -p /tmp/site-cute && tar -xJf "$part" -C /tmp/site-cute
      done
      cute_on_path
      python3 -c "import cutlass.cute; print('CuTe DSL', cutlass.__version__ if hasattr(cutlass, '__version__') else '')" \
        || echo "CuTe DSL not complete yet: carry the next part (.cutedsl/a, b, c) in the next call" ;;
    quackgemm)
      timeout ${QUACKGEMM_TIMEOUT:-300} python3 benchmarks/probe_quack_gemm.py --json "$OUT/quack_gemm.json" \
        ${QUACKGEMM_ARGS:-} 2>&1 | grep -vE "W11|I11" | tail -40 ;;
    ncugemm)
      timeout ${NCU_TIMEOUT:-400} ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats --csv --page details \
        python3 benchmarks/probe_gemm_ncu.py ${NCU_ARGS:-} --labels "$OUT/ncu_labels.json" \
        > "$OUT/ncu_gemm.csv" 2> "$OUT/ncu_gemm.log"; echo "ncu rc $?"; grep -v "^W11" "$OUT/ncu_gemm.log" | tail -5
      python3 benchmarks/probe_gemm_ncu.py --summarize "$OUT/ncu_gemm.csv" --labels "$OUT/ncu_labels.json" \
        --json "$OUT/ncu_gemm.json" 2>&1 | tail -20 ;;
    cuterow)
      timeout ${CUTEROW_TIMEOUT:-300} python3 benchmarks/probe_cute_rowwise_gemm.py --json "$OUT/cute_rowwise_gemm.json" \
        ${CUTEROW_ARGS:-} 2>&1 \
        | grep -v "^W11" | tail -40 ;;
    fp8seq)  # torchao tensorwise then rowwise in ONE process, launches blocking (issue: the in-process crash)
      CUDA_LAUNCH_BLOCKING=1 timeout ${FP8SEQ_TIMEOUT:-300} python3 benchmarks/probe_fp8_in_process.py ${FP8SEQ_ARGS:-} \
        > "$OUT/fp8seq.log" 2>&1; echo "rc $?"; grep -vE "W11|I11" "$OUT/fp8seq.log" | tail -40 ;;
    passes)  # the packer's passes apart, the tree's and PACK_VARIANTS' (benchmarks/probe_pack_passes.py)
      tree=src/mxflux/kernels/operands_cuda.py; i=0
      for v in $tree ${PACK_VARIANTS:-} $( [ -n "${PACK_VARIANTS:-}" ] && echo $tree ); do
        i=$((i + 1))
        python3 benchmarks/probe_pack_passes.py --variant $v ${PASSES_ARGS:---grids auto --calls 20} \
          --json "$OUT/pack_passes_${i}_$(basename $v .py).json" 2>&1 | grep "^grid" | sed "s|^|$(basename $v .py) |"
      done ;;
    gemmtune)  # row-wise scaled FP8 GEMM: cuBLAS against max-autotune (benchmarks/probe_scaled_mm_autotune.py)
      timeout ${GEMMTUNE_TIMEOUT:-540} python3 benchmarks/probe_scaled_mm_autotune.py ${GEMMTUNE_ARGS:-} \
        --json "$OUT/scaled_mm_autotune.json" > "$OUT/gemmtune.log" 2>&1
      grep -E "cuBLAS|Error" "$OUT/gemmtune.log" | tail -30 ;;
    rowgemm)  # cuBLASLt's candidates and CUTLASS's grouped GEMM for the row-wise scaled GEMM
      # (benchmarks/probe_rowwise_gemm.py; ROWGEMM_ARGS="--count 1" for torch's kernels and CUTLASS's alone)
      timeout ${ROWGEMM_TIMEOUT:-300} python3 benchmarks/probe_rowwise_gemm.py ${ROWGEMM_ARGS:-} --json "$OUT/rowwise_gemm.json" 2>&1 \
        | grep -v "^W11" | tail -40 ;;
    optimizer)  # the optimizer step alone (benchmarks/bench_optimizer.py)
      python3 benchmarks/bench_optimizer.py ${OPTIM_ARGS:-} --json "$OUT/bench_optimizer.json" 2>&1 | grep -v "^W11" | tail -15 ;;
    host)  # host time per op call (benchmarks/bench_host.py)
      python3 benchmarks/bench_host.py --json "$OUT/bench_host.json" 2>&1 | grep -v "^W11" | tail -15
      python3 benchmarks/bench_host_linear.py --json "$OUT/bench_host_linear.json" 2>&1 | grep -v "^W11" | tail -16 ;;
    sweepcomm)  # FSDP2 blocks per unit (communication granularity), SWEEP_RECIPE on all visible GPUs
      n=$(nvidia-smi -L | wc -l)
      timeout ${SWEEP_TIMEOUT:-540} python3 -m torch.distributed.run --nproc_per_node $n benchmarks/sweep_comm.py \
        --recipe ${SWEEP_RECIPE:-flux12b-mxfp6-mlperf} ${SWEEP_ARGS:---units 1,2,4 --mbs 64 --steps 4 --warmup 2} \
        --json "$OUT/sweep_comm.json" 2>&1 | grep -v "^W11" | tail -40 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
