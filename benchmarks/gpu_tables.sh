#!/usr/bin/env bash
# The open issues' GPU tables, a part per device call (each under its 10 minutes on one H100/H200 with
# 16 cores), results under $OUT. Run from the repository root with gpufeed and the optional wheels on
# PYTHONPATH (e.g. PYTHONPATH=src:/tmp/site:/tmp/dsite: nvImageCodec, DALI, PyAV, py-spy's bin on PATH):
#
#   bash benchmarks/gpu_tables.sh cuda     # tests/cuda under -X faulthandler, and where a worker's start goes
#   bash benchmarks/gpu_tables.sh start    # a fresh Loader's start (profiled) and a training row against its ceiling
#   bash benchmarks/gpu_tables.sh 65       # issue 65 at 10k: the folder and the store against DALI, fresh processes too
#   bash benchmarks/gpu_tables.sh 65-50k   # issue 65 at 50k, the steady passes watched by py-spy
#   bash benchmarks/gpu_tables.sh 66       # issue 66 at 10 Gbit/s through four servers, downloads in the process and apart
#   bash benchmarks/gpu_tables.sh 67       # issue 67: the 568x320 training table with PyAV and DALI
#
# Photos are made once per machine under /tmp (the first part that needs them pays for it).
set -u
case "${1:-}" in
  cuda|start|65|65-50k|66|67) ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
OUT=${OUT:-/tmp/gpu-tables}
mkdir -p "$OUT"
py=${PYTHON:-python3}
case "$1" in
  cuda)
    $py -X faulthandler -m pytest tests/cuda -q -p no:cacheprovider -rs > "$OUT/cuda.txt" 2>&1
    tail -15 "$OUT/cuda.txt"
    $py benchmarks/worker_start_bench.py --repeats 3 --out "$OUT/worker_start.json" | tail -30 ;;
  start)
    $py benchmarks/start_bench.py --n 20000 --workdir /tmp/gpufeed-tb --profile 25 --out "$OUT/start.json" | tail -40
    $py benchmarks/train_bench.py --n 20000 --workdir /tmp/gpufeed-tb --models resnet18 --rows "synthetic;jpeg;folder" \
      --rounds 2 --out "$OUT/train.json" | tail -15 ;;
  65)
    $py benchmarks/folder_bench.py --n 10000 --root /tmp/gpufeed-fb10 --rounds 2 --fresh --out "$OUT/folder10k.json" | tail -30 ;;
  65-50k)
    $py benchmarks/folder_bench.py --n 50000 --root /tmp/gpufeed-fb50 --rounds 2 --pyspy --out "$OUT/folder50k.json" | tail -30 ;;
  66)
    $py benchmarks/remote_bench.py --n 10000 --workdir /tmp/gpufeed-rb --link 10gbit --latency 5ms --servers 4 --ranks 2 \
      --fetch-process --compare "" --out "$OUT/remote10.json" | tail -30 ;;
  67)
    $py benchmarks/video_bench.py --videos 96 --seconds 4 --rounds 1 --batches 20 --steps 40 --warmup 8 --decode-rows 16 \
      --train-workers 16 --train-others pyav,dali --compare dali --out "$OUT/video.json" | tail -30 ;;
esac
