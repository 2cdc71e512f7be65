#!/usr/bin/env bash
# Measure everything the lab publishes for the GPU of this machine into results/<gpu>/, then draw
# the figures and the README table from it. One command for a full set:
#
#     results/publish.sh            # all parts, ~20 minutes on an H200
#     results/publish.sh fp16 bf16  # only some parts (the H200 set was measured in two sessions)
#
# Parts: tests tune fp16 bf16 extras shapes models bwd latency figures. Rows are appended as
# measured and sweeps --resume, so a part that is interrupted can be run again and continues where
# it stopped. shapes: the GQA, head-dim and decode cells of the shape contract (results/<gpu>/shapes/);
# models: the model-shape suite (results/<gpu>/models/); bwd: the backward pass on the FA grid.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
parts=${*:-tests tune fp16 bf16 extras shapes models bwd latency figures}
slug=$($py -c "import torch; from harness.results import slugify; print(slugify(torch.cuda.get_device_name()))")
out=${OUT_DIR:-results/$slug}
mkdir -p "$out"
run() { echo "+ $*" >&2; "$@"; }
has() { [[ " $parts " == *" $1 "* ]]; }

if has tests; then  # the GPU tests first: nothing is published from kernels that fail them
  run $py -m pytest -q -m gpu -p no:warnings tests/ -n 8 2>/dev/null || run $py -m pytest -q -m gpu -p no:warnings tests/
  run $py -m pytest -q -p no:warnings tests/test_stages.py -n 8 -k "candidate or variant"
fi
if has tune; then   # stage C's tile configs for this GPU -> stages/c_optimized/tuned/<slug>.json
  run $py -m stages.c_optimized.tune --N 1024,4096,16384 --dtype fp16 --csv "$out/tuning.csv"
fi
if has fp16; then
  run $py -m harness device --out "$out"
  run $py -m harness sweep --dtype fp16 --out "$out" --resume
fi
if has bf16; then
  run $py -m harness sweep --dtype bf16 --out "$out" --resume
fi
if has extras; then
  # stage C's ablation at the headline size; energy at the headline cell; DRAM bytes by Nsight Compute
  run $py -m harness sweep --stages c --ablation --peers none --N 4096 --D 64,128 --dtype fp16 --out "$out" --resume
  run $py -m harness sweep --energy --N 4096 --D 64 --causal no --dtype fp16 --out "$out"
  run $py -m harness profile --N 1024,4096,16384 --D 64 --causal no --dtype fp16 --peers flash,cudnn --out "$out/profile"
  if $py -c "import stages, sys; sys.exit('c_cuda' not in stages.STAGES)"; then
    run $py -m harness profile --stages b_cuda,c_cuda --ablation --peers none --N 4096 --D 64,128 --dtype fp16 --out "$out/profile"
  fi
fi
if has shapes; then  # GQA prefill, head dims 80/96, decode: stage C against every SDPA backend
  run $py -m harness sweep --stages b,c --B 1 --H 32 --Hkv 8 --N 4096,16384 --D 128 --causal yes --dtype bf16 --out "$out/shapes" --resume
  run $py -m harness sweep --stages b,c --B 8 --H 32 --N 2048 --D 80,96 --causal both --dtype fp16 --out "$out/shapes" --resume
  for B in 1 16 64; do
    run $py -m harness sweep --stages b,c --B $B --H 32 --Hkv 32,8 --N 1 --Nk 4096,32768 --D 128 --causal no --dtype bf16 --out "$out/shapes" --resume
  done
fi
if has models; then  # the model-shape suite, three runs (a stable host path, not a lucky one)
  for i in 1 2 3; do run $py -m harness sweep --suite models --out "$out/models"; done
fi
if has bwd; then     # the backward pass alone on the FA grid
  run $py -m harness sweep --pass bwd --stages c --peers flash,cudnn --dtype fp16,bf16 --out "$out" --resume
  run $py -m harness sweep --pass bwd --stages a,b --peers none --N 1024,4096 --D 64 --dtype fp16 --out "$out" --resume
fi
if has latency; then
  run $py -m harness latency --out "$out/latency.csv"
fi
if has figures; then
  run $py -m harness plot "$out"
  run $py -m harness report "$out" --update
fi
