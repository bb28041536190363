#!/usr/bin/env bash
# One prepared GPU run of worldserve's GPU numbers, in at most 9 minutes on one H100/H200-class GPU.
#
#   bench/gpu.sh             # on the GPU machine: wan-causal 1.3b (load=dummy, bfloat16) and tinyworld
#   bench/gpu.sh --dry-run   # the same code on the CPU with config=tiny, in seconds (the test suite runs it)
#
# Parts, each one Markdown table (or two) printed as rows are measured and written to $OUT_DIR/<part>.md;
# each part runs under its own time budget, so a part cut short keeps the rows it measured and the
# next part still runs:
#   1 model        wan-causal alone: block latency at batch 1/2/4/8 and windows 3/9/15, one batched forward vs
#                  one forward per session, peak memory, achieved TFLOP/s (whole block, transformer, VAE decode),
#                  the VAE's decode of a block's first latent frame alone (what frames sent per latent frame
#                  would save a key), the prompt re-cache cost per switch, TAEHV's decode of the same batch next to the VAE's
#                  (decoder=taehv) (bench/wan_causal.py --parts blocks)
#   2 attention    the batched self-attention (one call per layer) vs the per-session loop (--parts attention)
#   3 server       wan-causal through a real `worldserve serve` with 1/2/4/8 `worldserve bench` clients (all
#                  admitted: --step-budget 1000), and its cold start (process start to first chunk)
#                  (bench/serve_sweep.py)
#   4 tinyworld    tinyworld served on the GPU the same way
#   5 matrix       matrix-game-2 (Matrix-Game 2.0 universal, 1.3b widths) alone: block latency at batch 1/2/4/8,
#                  batched vs one step per session, peak memory, TFLOP/s (bench/matrix_game.py)
#   6 abot         abot-world (ABot-World-0-5B-LF, Wan2.2-TI2V-5B widths) alone at 704x1280 and 352x640: block
#                  latency at batch 1/2/4, batched vs one step per session, peak memory, state per session,
#                  the VAE's decode vs TAEHV's, each in bfloat16 and with quant=fp8's GEMMs (bench/abot_world.py)
# Needs: a Python with worldserve[server,wan,tinyworld] and a CUDA torch ($PYTHON, default python).
set -u
cd "$(dirname "$0")/.."
# Every client is admitted (the step budget's admission control off), so each row measures that many
# sessions in one server, real time or not, instead of how many it would admit.
ADMIT_ALL="--step-budget 1000"

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
PYTHON=${PYTHON:-python}
OUT=${OUT_DIR:-${OUT:-gpu-bench-out}}
mkdir -p "$OUT"

if [ "$DRY" = 1 ]; then
    # one batch size and one client count (2: a batch), the least that runs every code path the GPU run does
    DEVICE=cpu CONFIG=tiny DTYPE=float32 BATCHES="2" WINDOWS="3" BLOCKS=1 CLIENTS="2" DURATION=2 SETTLE=1
    ATTENTION="--attention-layers 2" THREADS="--threads 1" TINY_OPTIONS="--model-option threads=1"
    WAN_OPTIONS="--model-option config=tiny --model-option threads=1"
    BUDGET_MODEL=120 BUDGET_ATTENTION=60 BUDGET_SERVER=120 BUDGET_TINY=120
else
    DEVICE=cuda CONFIG=1.3b DTYPE=bfloat16 BATCHES="1 2 4 8" WINDOWS="3 9 15" BLOCKS=2 CLIENTS="1 2 4 8" DURATION=12 SETTLE=5
    ATTENTION="" THREADS="" TINY_OPTIONS="--model-option device=cuda"
    WAN_OPTIONS="--model-option config=1.3b --model-option load=dummy --model-option device=cuda --model-option max_batch_size=8"
    # the parts' budgets add up to 510 s with matrix's and abot's (each part's kill grace, 10 s, only on a part cut short)
    BUDGET_MODEL=135 BUDGET_ATTENTION=35 BUDGET_SERVER=120 BUDGET_TINY=50
fi

part() {  # name, seconds, command...: run it under its budget, print and keep what it printed
    local name=$1 budget=$2
    shift 2
    echo "## $name"
    echo
    local started=$SECONDS
    timeout -k 10 "$budget" "$@" 2>"$OUT/$name.err" | tee "$OUT/$name.md"
    local status=${PIPESTATUS[0]}
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then
        echo "(cut short at its ${budget} s budget: the rows above are the ones measured)" | tee -a "$OUT/$name.md"
    elif [ "$status" != 0 ]; then
        echo "(failed with status $status: $(tail -n 3 "$OUT/$name.err" | tr '\n' ' '))" | tee -a "$OUT/$name.md"
    fi
    echo "(part $name: $((SECONDS - started)) s)"
    echo
}

{
    echo "# bench/gpu.sh $(date -u +%Y-%m-%dT%H:%MZ) $([ "$DRY" = 1 ] && echo '(dry run: CPU, config=tiny)')"
    if [ "$DRY" = 0 ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    fi
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo
} | tee "$OUT/header.md"

# shellcheck disable=SC2086  # the option strings split into words on purpose
part model "$BUDGET_MODEL" "$PYTHON" bench/wan_causal.py --parts blocks --config "$CONFIG" --device "$DEVICE" \
    --dtype "$DTYPE" --batches $BATCHES --windows $WINDOWS --blocks "$BLOCKS" $THREADS
# shellcheck disable=SC2086
part attention "$BUDGET_ATTENTION" "$PYTHON" bench/wan_causal.py --parts attention --config "$CONFIG" \
    --device "$DEVICE" --dtype "$DTYPE" --batches $BATCHES --windows 15 --blocks "$BLOCKS" $ATTENTION $THREADS
# shellcheck disable=SC2086
part server "$BUDGET_SERVER" "$PYTHON" bench/serve_sweep.py --model wan-causal $WAN_OPTIONS --server-arg "$ADMIT_ALL" \
    --clients $CLIENTS --duration "$DURATION" --settle "$SETTLE" --log "$OUT/server.log"
# shellcheck disable=SC2086
part tinyworld "$BUDGET_TINY" "$PYTHON" bench/serve_sweep.py --model tinyworld $TINY_OPTIONS --server-arg "$ADMIT_ALL" \
    --clients $CLIENTS --duration "$DURATION" --settle "$SETTLE" --log "$OUT/tinyworld.log"

# -- matrix-game-2 (issue 22), self-contained: Matrix-Game 2.0's universal variant at the released 1.3b widths
# (load=dummy, bfloat16, 640x352), block latency at batch 1/2/4/8, one batched step vs one step per session, peak
# memory, TFLOP/s of the block and of the VAE decode (bench/matrix_game.py). Dry run: config=tiny on the CPU.
if [ "$DRY" = 1 ]; then
    MATRIX_ARGS="--config tiny --device cpu --dtype float32 --batches 2 --blocks 1 --threads 1"
    BUDGET_MATRIX=90
else
    MATRIX_ARGS="--config 1.3b --device cuda --dtype bfloat16 --batches 1 2 4 8 --blocks 2"
    BUDGET_MATRIX=60
fi
# shellcheck disable=SC2086
part matrix "$BUDGET_MATRIX" "$PYTHON" bench/matrix_game.py $MATRIX_ARGS

# -- abot-world (issue 27), self-contained: ABot-World at the released 5B widths (load=dummy, bfloat16) at its
# 704x1280 and at 352x640; a 5B transformer's KV window is ~7 GiB per session at 704x1280, so batches stop at 4.
if [ "$DRY" = 1 ]; then
    ABOT_ARGS="--config tiny --device cpu --dtype float32 --batches 2 --blocks 1 --threads 1 --quants none fp8"
    BUDGET_ABOT=90
else
    ABOT_ARGS="--config 5b --device cuda --dtype bfloat16 --batches 1 2 4 --blocks 2 --sizes 704x1280 352x640 --quants none fp8"
    BUDGET_ABOT=110
fi
# shellcheck disable=SC2086
part abot "$BUDGET_ABOT" "$PYTHON" bench/abot_world.py $ABOT_ARGS
echo "total: ${SECONDS} s; tables in $OUT/"
