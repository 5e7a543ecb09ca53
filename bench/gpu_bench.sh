#!/bin/bash
# mtpkit bench on the GPU machine (MLX's CUDA build), every --random shape and the bundled
# tiny example, with --json into $OUT; then one markdown table (bench/bench_table.py).
#
# The exact steps (the GPU machine reaches no registry; at most 64 MiB travels per call):
#
# 1. Here, in the project root, stage the wheels as parts of 52 MB (a call carries the working
#    tree too, ~4.5 MB, within its 64 MiB; 52 leaves room for .gpu/ptx.tgz beside part-aa):
#      PART_MB=52 bash ../shared/gpu/prepare.sh          # .gpu/part-aa, -ab, -ac + .gpu/install.sh
# 2. With the device tool, one call per part, in quick succession (a machine idle for ~30 s
#    is given back and its /tmp is lost; then start again at the first part):
#      run(command="bash bench/gpu_bench.sh stage", carry=[".gpu/part-aa", ".gpu/ptx.tgz"])
#      run(command="bash bench/gpu_bench.sh stage", carry=[".gpu/part-ab"])   # ... every part
#    and the last part's call can install and bench at once:
#      run(command="bash bench/gpu_bench.sh stage && bash .gpu/install.sh && bash
#          bench/gpu_bench.sh bench ...", carry=[".gpu/part-ac", ".gpu/install.sh"])
# 3. Still warm, the benches, a few targets per call (each call must end inside 10 minutes;
#    every target has its own limit, BENCH_LIMIT seconds, default 330; 9b needs ~300 s at 5 trials):
#      run(command="bash bench/gpu_bench.sh bench compile tiny qwen3_5-0.8b", carry=[".gpu/install.sh"])
#      run(command="bash bench/gpu_bench.sh bench qwen3_5-4b", carry=[".gpu/install.sh"])
#      run(command="bash bench/gpu_bench.sh bench qwen3_5-9b", carry=[".gpu/install.sh"])
#      run(command="bash bench/gpu_bench.sh bench qwen3_5_moe-35b-a3b-8l", carry=[".gpu/install.sh"])
#    Each call returns $OUT/bench-<target>.json, its log, and bench-table.md for its targets
#    (target `compile`: bench/compile_verdict.py's output, compile-verdict.txt).
#    Before the machine goes (the first builds of each shape cost minutes on a fresh one):
#      run(command="bash bench/gpu_bench.sh ptx-save")   # $OUT/ptx.tgz comes back
#    and next session copy it to .gpu/ptx.tgz and carry it in a call of its own right after
#    staging: run(command="bash bench/gpu_bench.sh stage", carry=[".gpu/ptx.tgz"]).
# 4. Here, one table of everything that came back:
#      python bench/bench_table.py DIR/bench-*.json     # DIR: where the run tool put $OUT
#
# Environment: DTYPE (scales of the random models, default bfloat16, as published 4-bit
# checkpoints carry), TRIALS (default 5), MAX_TOKENS (default 128), BENCH_LIMIT (default 330),
# ACCEPTANCE (default 0,0.8,0.9: the random shapes run with oracle drafts at these
# acceptances, `mtpkit bench --acceptance`, SYNTHETIC; empty: their random heads), DEPTH (3),
# PROMPT_TOKENS (unset: the default prompt; N: `--prompt-tokens N`, a context of N tokens,
# random ids for the random shapes; the files are then bench-<target>-p<N>.json).
#
# The README "Performance" table (the targets of issue 18) is, per call while warm:
#      run(command="bash bench/gpu_bench.sh bench tiny qwen3_5-0.8b train", ...)
#      run(command="bash bench/gpu_bench.sh bench qwen3_5-4b", ...)   # and 9b, moe
# then bench/bench_table.py over every bench-*.json (synthetic rows: the targets table).
# Target `train`: bench/bench_train.py --random-shape qwen3_5-0.8b (steps/s, train-head).
# Target `ab`: bench/ab_modes.py (serial vs built-ahead rounds, qmv routes on/off, 4b with 8
# layers); `ab-rows2`: its 2-row routes, lm_head-wide only vs every matrix timed (9b);
# target `plain-steps`: bench/plain_steps.py at ${SHAPES:-qwen3_5-9b qwen3_5-4b} (stock, a
# second stock load, --no-mtp with and without mtpkit's taps, the decoder's plain modes,
# per-token times; issue 31);
# target `batch-SHAPE` (issue 30): `mtpkit bench --random SHAPE --batch ${BATCH:-4,8}
# --acceptance ${BATCH_ACCEPTANCE:-0,0.8} --depth 1` into $OUT/batch-SHAPE.json, then
# bench/batch_table.py over every batch-*.json (MTP and adaptive drafting over stock
# batch_generate at each width, in the same trials);
# target `block-SHAPE` (issue 45, SHAPE qwen3-4b or qwen3-8b: Qwen3 dense, drafted by a random
# DFlash drafter of the published shape): `mtpkit bench --random SHAPE --acceptance
# ${BLOCK_ACCEPTANCE:-0,0.6,0.8,0.9} --num-draft-tokens ${BLOCK_DEPTHS:-4,8,15}` into
# $OUT/block-SHAPE.json and its log, then bench/block_table.py over every block-*.json into
# $OUT/block-table.md: per K and oracle acceptance the speedup over stock in the same trials,
# the round's cost in 1-token forwards (verify of K+1 + one drafter pass) and the ceiling,
# adaptive at each acceptance; SYNTHETIC. K stops at 15: a block of 16 drafts 15 (K = 16
# would be a one-line error). One target per call: its limit is BENCH_LIMIT, default 540 here
# (TRIALS=3 if 8b does not fit);
#      run(command="bash bench/gpu_bench.sh bench block-qwen3-4b", carry=[".gpu/install.sh"])
#      run(command="bash bench/gpu_bench.sh bench block-qwen3-8b", carry=[".gpu/install.sh"])
# target `ahead-SHAPE` (issue 30): bench/batch_ahead.py, batched rounds built ahead against
# rounds read first, with stock batch_generate, in the same trials (BATCH, BATCH_ACCEPTANCE);
# (MODES=policy: the decoder's plain steps only, every round, adaptive drafting's two judges,
# stock pinned to one core);
# target `stalls-SHAPE` (issue 30): bench/adaptive_stalls.py, every step of adaptive batched
# runs timed, those over 100 ms printed (TRIALS, BATCH: one width, BATCH_ACCEPTANCE: one);
# target `stall`: bench/batch_stall.py on qwen3_5-0.8b (each join and batched round timed:
# first-use kernel builds), as is, with MTPKIT_KERNELS=0 and with MLX_USE_CUDA_GRAPHS=0;
# target `profile`: bench/profile_stages.py at 0.8b and 9b (a round's stages); `profile-tiny`:
# the same on the bundled example (after target `tiny`, which converts it); `sdpa`:
# bench/sdpa_shapes.py (attention's cost at key lengths never seen, by head size and mask).
# target `batch-equal` (issue 43): bench/batch_equal.py on the bundled example converted at
# 4-bit (bf16 scales, `convert -q`, into /tmp/mtpkit-tiny-q4): how often stock's
# batch_generate, mtpkit's single stream and mtpkit's batch (head, none, and each row as a
# batch of its own) equal stock's single greedy stream, and where a batched row parts from its
# own single stream, over PROMPTS (default 8) mixed-length prompts at MAX_TOKENS; stock's top-2
# margin at each parting (a near-tie: reduction order). Into $OUT/batch-equal.txt and .json;
# BATCH_EQUAL_ARGS adds the tool's flags (e.g. `--no-adaptive --depth 3`);
#      run(command="bash bench/gpu_bench.sh bench batch-equal", carry=[".gpu/install.sh"])
# To run a worktree's code: copy its mtpkit/ (examples included: the random shapes take the
# bundled tokenizer) and bench/ into the main checkout's .gpuwt/ (git-excluded), carry it, and
# call `bash .gpuwt/bench/gpu_bench.sh ...` after `bash .gpu/install.sh` (its install step
# then finds MLX already installed); OUT=$OUT/NAME keeps two runs' files apart in one call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mtpkit-bench-out}
mkdir -p "$OUT"

stage() {
  mkdir -p /tmp/w
  if [ -f .gpu/ptx.tgz ]; then  # MLX's CUDA JIT builds kept from an earlier session (ptx-save)
    tar xzf .gpu/ptx.tgz -C /tmp && du -sh /tmp/mlx
    ls .gpu/part-* >/dev/null 2>&1 || return 0
  fi
  cp .gpu/part-* /tmp/w/ || { echo "no .gpu/part-* carried" >&2; exit 1; }
  ls -la /tmp/w
}

ptx_save() {  # MLX's CUDA JIT builds (/tmp/mlx/<version>/ptx) into $OUT/ptx.tgz
  [ -d /tmp/mlx ] || { echo "no /tmp/mlx: nothing built yet" >&2; exit 1; }
  tar czf "$OUT/ptx.tgz" -C /tmp mlx && ls -la "$OUT/ptx.tgz"
}

install() {
  if PYTHONPATH=/tmp/site python3 -c "import mlx.core, mlx_lm, typer" 2>/dev/null; then
    return 0
  fi
  ls /tmp/w/part-* >/dev/null 2>&1 || {
    echo "no staged parts in /tmp/w: the machine was given back; stage every part again" >&2
    exit 1
  }
  bash .gpu/install.sh || exit 1
}

bench() {
  install
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  local limit=${BENCH_LIMIT:-330} args=(--trials "${TRIALS:-5}" --max-tokens "${MAX_TOKENS:-128}" --depth "${DEPTH:-3}" --json)
  local oracle=() tag=""
  # A target past its limit gets SIGABRT first: faulthandler writes where every thread is to
  # its log (qwen3_5-0.8b and the MoE once sat in "forward and head costs" past any limit).
  local stuck="timeout -s ABRT -k 15 $limit"
  [ -n "${PROMPT_TOKENS:-}" ] && args+=(--prompt-tokens "$PROMPT_TOKENS") && tag="-p$PROMPT_TOKENS"
  [ -n "${ACCEPTANCE-0,0.8,0.9}" ] && oracle=(--acceptance "${ACCEPTANCE-0,0.8,0.9}")
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  git rev-parse HEAD 2>/dev/null >> "$OUT/gpu.txt"
  for target in "$@"; do
    echo "== $target" >&2
    if [ "$target" = compile ]; then  # does mx.compile pay for the acceptance step here?
      timeout "$limit" python3 bench/compile_verdict.py | tee "$OUT/compile-verdict.txt"
      continue
    elif [ "$target" = ab ]; then  # serial vs built-ahead rounds, qmv routes on/off (4b, 8 layers)
      timeout "$limit" python3 bench/ab_modes.py qwen3_5-4b 8 "${TRIALS:-5}" 2>&1 \
        | tee "$OUT/ab-modes.txt" | tail -15 >&2
      continue
    elif [ "$target" = ab-rows2 ]; then  # 2-row routes: lm_head-wide only vs timed (9b)
      timeout "$limit" python3 bench/ab_modes.py qwen3_5-9b 32 "${TRIALS:-5}" rows2 2>&1 \
        | tee "$OUT/ab-rows2.txt" | tail -12 >&2
      continue
    elif [ "$target" = plain-steps ]; then  # per-token times of the plain modes (9b, 4b)
      for shape in ${SHAPES:-qwen3_5-9b qwen3_5-4b}; do
        timeout "$limit" python3 bench/plain_steps.py "$shape" "${TRIALS:-5}" 2>&1 \
          | tee -a "$OUT/plain-steps.txt" | grep -A10 "^medians" >&2
      done
      continue
    elif [ "$target" = sdpa ]; then  # does attention build per new key length? (verify)
      timeout "$limit" python3 bench/sdpa_shapes.py 2>&1 | tee "$OUT/sdpa.txt" >&2
      continue
    elif [ "$target" = batch-equal ]; then  # batched rows against single streams (issue 43)
      python3 -m mtpkit convert mtpkit/examples/tiny-qwen3_5 -o /tmp/mtpkit-tiny-q4 -q --force >&2
      timeout "$limit" python3 bench/batch_equal.py /tmp/mtpkit-tiny-q4 --prompts "${PROMPTS:-8}" \
        --max-tokens "${MAX_TOKENS:-128}" --rows-alone ${BATCH_EQUAL_ARGS:-} \
        --save "$OUT/batch-equal.json" 2>&1 | tee "$OUT/batch-equal.txt" >&2
      continue
    elif [ "${target#batch-}" != "$target" ]; then  # batched MTP over stock's batch_generate
      $stuck python3 -X faulthandler -m mtpkit bench --random "${target#batch-}" --dtype "${DTYPE:-bfloat16}" \
        --batch "${BATCH:-4,8}" --acceptance "${BATCH_ACCEPTANCE:-0,0.8}" --depth 1 \
        --trials "${TRIALS:-5}" --max-tokens "${MAX_TOKENS:-128}" --json \
        ${PROMPT_TOKENS:+--prompt-tokens "$PROMPT_TOKENS"} \
        > "$OUT/$target$tag.json" 2> "$OUT/$target$tag.log"
      echo "rc $? for $target$tag" >&2
      tail -2 "$OUT/$target$tag.log" >&2
      python3 bench/batch_table.py "$OUT"/batch-*.json | tee "$OUT/batch-table.md" >&2
      continue
    elif [ "${target#ahead-}" != "$target" ]; then  # rounds built ahead vs read first (issue 30)
      PROMPT_TOKENS="${PROMPT_TOKENS:-}" timeout "$limit" python3 bench/batch_ahead.py "${target#ahead-}" "${TRIALS:-3}" "${BATCH:-4,8}" \
        "${BATCH_ACCEPTANCE:-0.8}" "${MAX_TOKENS:-128}" 2>&1 | tee "$OUT/$target.txt" | tail -12 >&2
      continue
    elif [ "${target#stalls-}" != "$target" ]; then  # adaptive batched runs, step by step
      timeout "$limit" python3 bench/adaptive_stalls.py "${target#stalls-}" "${TRIALS:-5}" "${BATCH:-8}" \
        "${BATCH_ACCEPTANCE:-0.8}" "${MAX_TOKENS:-128}" 2>&1 | tee "$OUT/$target.txt" | tail -40 >&2
      continue
    elif [ "$target" = stall ]; then  # first-use builds of batched rounds (0.8b, fresh machine)
      for env in "" MTPKIT_KERNELS=0 MLX_USE_CUDA_GRAPHS=0; do
        echo "== stall ${env:-as is}" | tee -a "$OUT/stall.txt" >&2
        env $env timeout "$limit" python3 bench/batch_stall.py qwen3_5-0.8b 24 /tmp/stall-08 1,4,8 \
          $((limit - 10)) 2>&1 | tee -a "$OUT/stall.txt" | awk '$4 != "step" || $6 >= 1000' >&2
      done
      continue
    elif [ "$target" = profile-tiny ]; then  # the bundled example's round (after `tiny`)
      timeout "$limit" python3 bench/profile_stages.py /tmp/mtpkit-tiny 2 24 2>&1 \
        | tee "$OUT/profile-tiny.txt" | tail -40 >&2
      continue
    elif [ "$target" = profile ]; then  # a round's stages against stock's step (0.8b, 9b)
      for shape in qwen3_5-0.8b qwen3_5-9b; do
        timeout "$limit" python3 bench/profile_stages.py "$shape" 3 24 2>&1 | tee -a "$OUT/profile.txt" \
          | grep -E "stock step|round total|routes" >&2
      done
      continue
    elif [ "$target" = train ]; then  # the train-head figure of README (steps/s)
      timeout "$limit" python3 bench/bench_train.py --random-shape qwen3_5-0.8b --dtype bfloat16 2>&1 \
        | tee "$OUT/train.txt" | tail -5 >&2
      continue
    elif [ "${target#block-}" != "$target" ]; then  # a block drafter at oracle blocks (issue 45)
      timeout -s ABRT -k 15 "${BENCH_LIMIT:-540}" python3 -X faulthandler -m mtpkit bench \
        --random "${target#block-}" --dtype "${DTYPE:-bfloat16}" \
        --acceptance "${BLOCK_ACCEPTANCE:-0,0.6,0.8,0.9}" --num-draft-tokens "${BLOCK_DEPTHS:-4,8,15}" \
        --trials "${TRIALS:-5}" --max-tokens "${MAX_TOKENS:-128}" --json \
        ${PROMPT_TOKENS:+--prompt-tokens "$PROMPT_TOKENS"} \
        > "$OUT/$target$tag.json" 2> "$OUT/$target$tag.log"
      echo "rc $? for $target$tag" >&2
      tail -3 "$OUT/$target$tag.log" >&2
      python3 bench/block_table.py "$OUT"/block-*.json | tee "$OUT/block-table.md" >&2
      continue
    elif [ "$target" = tiny ]; then
      python3 -m mtpkit convert mtpkit/examples/tiny-qwen3_5 -o /tmp/mtpkit-tiny --force >&2
      $stuck python3 -X faulthandler -m mtpkit bench --model /tmp/mtpkit-tiny "${args[@]}" \
        > "$OUT/bench-$target$tag.json" 2> "$OUT/bench-$target$tag.log"
    else
      $stuck python3 -X faulthandler -m mtpkit bench --random "$target" --dtype "${DTYPE:-bfloat16}" \
        "${args[@]}" "${oracle[@]}" > "$OUT/bench-$target$tag.json" 2> "$OUT/bench-$target$tag.log"
    fi
    echo "rc $? for $target$tag" >&2
    tail -3 "$OUT/bench-$target$tag.log" >&2
  done
  if ls "$OUT"/bench-*.json >/dev/null 2>&1; then
    python3 bench/bench_table.py "$OUT"/bench-*.json | tee "$OUT/bench-table.md"
  fi
}

case "${1:-}" in
  stage) stage ;;
  bench) shift; bench "$@" ;;
  ptx-save) ptx_save ;;
  *) sed -n '2,86p' "$0"; exit 2 ;;
esac
