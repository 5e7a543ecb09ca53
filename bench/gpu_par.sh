#!/bin/bash
# gpu_bench.sh's targets on a machine of several GPUs, one queue per GPU, side by side: one
# sitting of one machine measures in a quarter of the time on four GPUs. Each queue runs its
# jobs in turn on its own GPU (CUDA_VISIBLE_DEVICES), its own CPU cores (taskset: the cores
# divided evenly among the GPUs) and its own copy of MLX's CUDA JIT cache (TMPDIR), so no two
# processes share a device, a core or a cache file. Every figure is still a ratio against
# stock mlx-lm re-run in the same trial of the same process.
#
# After staging and installing as gpu_bench.sh says (steps 1-2), in one call:
#   bash bench/gpu_par.sh start 'GPU|ENV|TARGETS' ... && bash bench/gpu_par.sh wait SECONDS
# JOB = GPU index | environment for gpu_bench.sh (space-separated K=V, may be empty) |
# gpu_bench.sh targets; e.g. '0|PROMPT_TOKENS=4096 TRIALS=5|qwen3_5-9b'. The queues run
# detached (setsid), so a job may outlive the call that started it: a later call on the same
# warm machine runs `bash bench/gpu_par.sh wait SECONDS` again (a machine idle for ~30 s is
# given back, and its queues with it). `wait` returns when every queue is done or after
# SECONDS, prints each job's state and its log's last lines, and packs what every job has
# written so far (out/<job name>/: its log, its JSON, its table) into $OUT/par.tgz.
# A job cut off before its JSON: `python bench/log_table.py` reads its log's trials.
set -uo pipefail
cd "$(dirname "$0")/.."
PAR=/tmp/mtpkit-par
OUT=${OUT:-/tmp/mtpkit-bench-out}

job_name() {  # 0|PROMPT_TOKENS=4096|qwen3_5-9b -> g0-qwen3_5-9b-PROMPT_TOKENS4096
  local gpu=${1%%|*} rest=${1#*|}
  local env=${rest%%|*} targets=${rest#*|}
  echo "g$gpu-${targets// /_}${env:+-${env//[= ]/}}"
}

start() {
  bash bench/gpu_bench.sh bench >/dev/null  # installs MLX's CUDA build
  PYTHONPATH=/tmp/site python3 -c "import mlx.core, mlx_lm" || { echo "install failed" >&2; exit 1; }
  local gpus cores per
  gpus=$(nvidia-smi -L | wc -l)
  cores=$(nproc)
  per=$((cores / gpus))
  mkdir -p "$PAR"
  local gpu
  for gpu in $(seq 0 $((gpus - 1))); do
    local queue=() job
    for job in "$@"; do [ "${job%%|*}" = "$gpu" ] && queue+=("$job"); done
    [ ${#queue[@]} -eq 0 ] && continue
    mkdir -p "$PAR/tmp$gpu"
    [ -d /tmp/mlx ] && [ ! -d "$PAR/tmp$gpu/mlx" ] && cp -r /tmp/mlx "$PAR/tmp$gpu/"
    local script="$PAR/queue$gpu.sh"
    {
      echo "cd $PWD"
      for job in "${queue[@]}"; do
        local rest=${job#*|} name
        name=$(job_name "$job")
        echo "mkdir -p $PAR/out/$name; echo running > $PAR/out/$name/state"
        echo "env CUDA_VISIBLE_DEVICES=$gpu TMPDIR=$PAR/tmp$gpu OUT=$PAR/out/$name ${rest%%|*}" \
          "taskset -c $((gpu * per))-$((gpu * per + per - 1)) bash bench/gpu_bench.sh bench ${rest#*|}" \
          "> $PAR/out/$name/run.log 2>&1; echo \"done rc \$?\" > $PAR/out/$name/state"
      done
    } > "$script"
    setsid nohup bash "$script" > "$PAR/queue$gpu.log" 2>&1 < /dev/null &
    echo "GPU $gpu (cores $((gpu * per))-$((gpu * per + per - 1))): ${queue[*]}"
  done
}

wait_jobs() {
  local deadline=$(($(date +%s) + ${1:-570}))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    pgrep -f "$PAR/queue" >/dev/null || break
    sleep 5
  done
  mkdir -p "$OUT"
  local dir
  for dir in "$PAR"/out/*/; do
    [ -d "$dir" ] || continue
    echo "== $(basename "$dir"): $(cat "$dir/state" 2>/dev/null)"
    tail -4 "$dir/run.log" 2>/dev/null
  done
  # One file back, not dozens (a call brings back a limited count of files).
  tar czf "$OUT/par.tgz" -C "$PAR" out && ls -la "$OUT/par.tgz"
  pgrep -f "$PAR/queue" >/dev/null && echo "queues still running" || echo "every queue done"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  wait) wait_jobs "${2:-570}" ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
