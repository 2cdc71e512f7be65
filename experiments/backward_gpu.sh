#!/usr/bin/env bash
# Stage C's backward on one GPU: the GPU run of the backward tests (every test of those files runs on
# the GPU, not only the gpu-marked ones), the host time of a small backward piece by piece
# (experiments/backward_host.py), the tuner (stages/c_optimized/tune_backward.py: every tile config of
# each backward kernel, the dQ method per head dim and mask, then on Hopper the Gluon kernels against
# those plans, written to tuned/<gpu>-backward.json),
# and the measurements into results/<gpu>/: the backward grid (fp16 and bf16, N 1k/4k/16k, D 64/128,
# causal both, stages B and C beside cuDNN and FA2), D 256 and the padded head dims, the model-suite
# cells' backward rows, and the small GPT's training run (harness train).
#
#     experiments/backward_gpu.sh                    # everything (~25 minutes on an H200)
#     experiments/backward_gpu.sh tests host grid    # some parts: tests host tune grid dims suite train
#
# Logs go to ${LOG:-backward_gpu.log}. Rows are appended as measured, so an interrupted part loses only
# the row it was measuring. The tuner rewrites tuned/<gpu>-backward.json: commit it with its CSV.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
parts=${*:-tests host tune grid dims suite train}
log=${LOG:-backward_gpu.log}
has() { [[ " $parts " == *" $1 "* ]]; }
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" | tail -${TAIL:-40}; }
day=$(date -u +%Y-%m-%d)
gpu=$($py -c "import stages; from stages.c_optimized.configs import gpu_slug; print(gpu_slug())")

nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv >> "$log" 2>&1
if has tests; then
  run timeout ${TEST_S:-300} $py -m pytest -q -n 8 -p no:cacheprovider tests/test_stage_c_backward.py tests/test_backward.py
fi
if has host; then
  run timeout 120 $py experiments/backward_host.py --calls 300
fi
if has tune; then
  run timeout ${TUNE_S:-600} $py -m stages.c_optimized.tune_backward --budget-s 480 \
      --csv results/$gpu/experiments/${day}_bwd_tuning.csv
  # then, on Hopper, the Gluon kernels raced against the tl plans just tuned (kept where faster)
  run timeout ${HOPPER_S:-420} $py -m stages.c_optimized.tune_backward --hopper --D 64,128,256 --dtype bf16 \
      --csv results/$gpu/experiments/${day}_hopper_bwd_tuning.csv
fi
if has grid; then
  run timeout ${GRID_S:-420} $py -m harness sweep --pass bwd --stages b,c --peers flash,cudnn --N 1024,4096,16384 \
      --D 64,128 --causal both --dtype bf16,fp16
fi
if has dims; then
  run timeout ${DIMS_S:-300} $py -m harness sweep --pass bwd --stages b,c --peers flash,cudnn --N 4096 \
      --D 40,80,96,256 --causal both --dtype bf16
fi
if has suite; then
  run timeout ${SUITE_S:-420} $py -m harness sweep --suite models --pass bwd --stages c --peers flash,cudnn
fi
if has train; then
  run timeout ${TRAIN_S:-420} $py -m harness train --stages a,b,c,sdpa
fi
