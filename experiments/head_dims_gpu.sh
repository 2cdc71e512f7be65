#!/usr/bin/env bash
# The head-dim sweep on one GPU: stage C against cuDNN and FlashAttention-2 (SDPA's CUDNN and FLASH
# backends) at every multiple of 8 from 32 to 256, N = 4096, bf16, causal and not, forward, at the
# FlashAttention-paper sizes (B·N = 16384 tokens, H·D = 2048: the harness takes B = 16384 / N and
# H = 2048 / D rounded down), into results/<gpu>/runs.csv. Stage C pads D inside its kernel, to the
# next power of two or to half that plus a narrow tail (hopper_ws.tile_widths); the sweep shows what
# that costs (figures/head_dims.png, the results page's head_dims block). First the GPU tests of the padded head dims, then stage C's ablation at D 64 and
# 128 (its -warp_specialization rows are the tl kernel's rate at the widths the other head dims are
# padded to: the figure's "padding alone" line), then the sweep in four parts of head dims, each well
# under ten minutes, so a part can be rerun alone. The whole sweep is one command:
#
#     python -m harness sweep --stages c --peers flash,cudnn --N 4096 --D 32,40,...,256 --causal both --dtype bf16
#
#     experiments/head_dims_gpu.sh                  # everything (an estimate: ~15-20 minutes on an H200)
#     experiments/head_dims_gpu.sh d32 d96          # some parts: tests tl d32 d96 d160 d224 wspad
#
# The part `wspad` (not in the default set) runs the GPU tests of the warp-specialized kernel at the
# padded head dims (hopper_ws.PADDED_HEAD_DIMS, on by default; LAB_WS_PADDED_HEAD_DIMS=0 turns it off,
# and the parts d32/d96 then time the tl kernel there), forward and the Hopper backward kernels, then
# the forward sweep at D 40-56 and 72-120.
#
# Then, on any machine: `python -m harness plot results/<gpu>` and
# `python -m harness report results/<gpu> --update` (the block is filled once runs.csv holds the sweep).
# Logs go to ${LOG:-head_dims_gpu.log}. Rows are appended as measured, so an interrupted part loses only
# the row it was measuring; rerun that part (without --resume: the grid's older rows at D 64 and 128 would
# count as done, and the sweep's cells should be timed in one run, side by side).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
parts=${*:-tests tl d32 d96 d160 d224}
log=${LOG:-head_dims_gpu.log}
has() { [[ " $parts " == *" $1 "* ]]; }
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" | tail -${TAIL:-40}; }
sweep() {  # one part of the sweep: the head dims given, every flag as in the one command above
  run timeout ${DIMS_S:-540} $py -m harness sweep --stages c --peers flash,cudnn --N 4096 --D "$1" --causal both \
      --dtype bf16
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv >> "$log" 2>&1
$py -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())" \
    >> "$log" 2>&1
if has tests; then
  run timeout ${TEST_S:-300} $py -m pytest -q -p no:cacheprovider tests/test_stage_c_shapes.py \
      -k "padded_inside_the_kernel or gpu_extended_shapes"
fi
if has tl; then
  # before the sweep: this run times stage C without its peers, and the sweep's rows should be the latest
  run timeout ${TL_S:-420} $py -m harness sweep --stages c --ablation --peers none --N 4096 --D 64,128 --causal both \
      --dtype bf16
fi
if has d32; then sweep 32,40,48,56,64,72,80,88; fi
if has d96; then sweep 96,104,112,120,128,136,144,152; fi
if has d160; then sweep 160,168,176,184,192,200,208,216; fi
if has d224; then sweep 224,232,240,248,256; fi
if has wspad; then
  export LAB_WS_PADDED_HEAD_DIMS=1
  run timeout ${TEST_S:-300} $py -m pytest -q -p no:cacheprovider tests/test_stage_c_shapes.py \
      tests/test_stage_c_backward.py -k "ws_padded or padded_head_dims"
  sweep 40,48,56,72,80,88,96,104,112,120
  unset LAB_WS_PADDED_HEAD_DIMS
fi
