#!/bin/bash
# Run bench/gpu_kernels.py on the GPU machine (an H100 reached through the session's `run`
# tool, which copies the main checkout's working tree there; it reaches no registry).
#
# 1. Here, once: stage MLX's CUDA build (wheels split into parts under .gpu/, git-ignored):
#        ../shared/gpu/prepare.sh                       # in the main checkout
# 2. Here: copy the code under test beside it (.gpuwork/ is git-excluded too):
#        bash bench/gpu.sh stage [MAIN_CHECKOUT]        # default: this checkout
# 3. Two `run` calls in quick succession (an idle machine is given back after ~30 s and its
#    /tmp is lost; at most 64 MiB travels per call, so one wheel part each):
#        carry [".gpu/part-aa", ".gpuwork"]
#            mkdir -p /tmp/w && cp .gpu/part-aa /tmp/w/
#        carry [".gpu/part-ab", ".gpu/install.sh", ".gpuwork"]
#            mkdir -p /tmp/w && cp .gpu/part-ab /tmp/w/ && bash .gpuwork/bench/gpu.sh run
#    Later calls while the machine is warm: `bash .gpuwork/bench/gpu.sh bench [ARGS]`.
#    The JSON comes back under the run's $OUT; the tables are in its output.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  stage)
    main=${2:-$here}
    grep -qx '/.gpuwork/' "$main/.git/info/exclude" 2>/dev/null \
      || echo '/.gpuwork/' >> "$main/.git/info/exclude"
    rm -rf "$main/.gpuwork" && mkdir -p "$main/.gpuwork"
    cp -r "$here/mtpkit" "$here/bench" "$main/.gpuwork/"
    git -C "$here" rev-parse --short HEAD > "$main/.gpuwork/COMMIT"
    rm -rf "$main/.gpuwork/bench/out"
    find "$main/.gpuwork" -name __pycache__ -prune -exec rm -rf {} +
    du -sh "$main/.gpuwork"
    ;;
  run)
    bash .gpu/install.sh
    shift
    exec bash "$here/bench/gpu.sh" bench "$@"
    ;;
  bench)
    shift
    cd "$here"
    export PYTHONPATH=/tmp/site:$here
    commit=$(cat COMMIT 2>/dev/null || echo unknown)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 bench/gpu_kernels.py --commit "$commit" --out "${OUT:-bench/out}" "$@"
    ;;
  *)
    sed -n '2,16p' "$0"
    exit 2
    ;;
esac
