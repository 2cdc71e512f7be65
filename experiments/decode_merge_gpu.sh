#!/usr/bin/env bash
# The split-KV merge kernel's two shapes on one GPU (decode.MERGE_SHAPES: "wide", the default, and
# "serial", LAB_DECODE_MERGE=serial, the first version): the GPU tests of the split path with the wide merge, then stage C's
# decode cells at every split count under each merge beside cuDNN (experiments/suite_configs.py, GPU
# time of CUDA-graph replay), then the decode cells of the shape contract with the wide merge
# (results/<gpu>/shapes/), so the results page's decode block can compare. The entry that reads it:
# docs/performance-log/model-shapes.md, entries 45 and 47.
#
#     experiments/decode_merge_gpu.sh               # everything (an estimate: ~5 minutes on an H200)
#     experiments/decode_merge_gpu.sh tests time    # some parts: tests time shapes
#
# Logs go to ${LOG:-decode_merge_gpu.log}.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
parts=${*:-tests time shapes}
log=${LOG:-decode_merge_gpu.log}
has() { [[ " $parts " == *" $1 "* ]]; }
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" | tail -${TAIL:-40}; }
slug=$($py -c "import torch; from harness.results import slugify; print(slugify(torch.cuda.get_device_name()))")
day=$(date -u +%Y-%m-%d)
cells=decode-gqa,decode-long,decode-b1-gqa-4k,decode-b1-gqa-32k,mistral-decode

nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv >> "$log" 2>&1
if has tests; then
  LAB_DECODE_MERGE=wide run timeout ${TEST_S:-300} $py -m pytest -q -p no:cacheprovider tests/test_stage_c_shapes.py \
      -k "split or decode or extended_shapes"
fi
if has time; then
  for merge in serial wide; do
    LAB_DECODE_MERGE=$merge run timeout ${TIME_S:-300} $py experiments/suite_configs.py --cells $cells \
        --out results/$slug/experiments/${day}_decode_merge_$merge.csv
  done
fi
if has shapes; then
  for B in 1 16 64; do
    LAB_DECODE_MERGE=wide run timeout ${SHAPES_S:-300} $py -m harness sweep --stages c --peers flash,cudnn --B $B --H 32 \
        --Hkv 32,8 --N 1 --Nk 4096,32768 --D 128 --causal no --dtype bf16 --out results/$slug/shapes
  done
fi
