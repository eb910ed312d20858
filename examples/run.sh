#!/usr/bin/env bash
# Merak-Zeus' run.sh on merak's recipes (docs/energy.md, docs/trainer_api.md).
#
# One run (training, or instruction profiling with --profile true):
#   bash examples/run.sh [MODEL] [MICROBATCH_SIZE] [NUM_MICROBATCHES] [--NAME VALUE ...] [KEY=VALUE ...]
# The energy workflow, one run after another (single node): profile with one microbatch,
# `merak-energy plan`, then train with the plan's per-instruction GPU clocks:
#   bash examples/run.sh workflow [MODEL] [MICROBATCH_SIZE] [NUM_MICROBATCHES] [--NAME VALUE ...] [KEY=VALUE ...]
#
# MODEL is a model option of a recipe (recipes/*/conf/model/*.yaml): gpt3-large, bert-large-uncased,
# wide-resnet50_8, toy, ... The recipe follows from the name (toy and demo: gpt); RECIPE=<name> chooses it.
# --pp/--dp/--tp N set the parallel degrees (default: pp = every process, dp = tp = 1); any other
# --NAME VALUE (or --NAME=VALUE) becomes trainer.NAME=VALUE: --partition_method, --max_steps,
# --shard_count, --profile, --num_warmup_steps, --num_prof_steps, --train_schedule, --frequency_plan,
# --pfo_server_url, ... A KEY=VALUE argument is passed to the recipe as it is (model.num_layers=2).
#
# Environment (defaults in brackets):
#   MODEL [toy], MICROBATCH_SIZE [2], NUM_MICROBATCHES [4]: when not given as arguments
#   NUM_GPUS [the GPUs nvidia-smi lists, or 1]: processes on this node
#   NNODES [1], NODE_RANK [0], MASTER_ADDR [127.0.0.1], MASTER_PORT [29500]: several nodes (torchrun)
#   RUN_DIR [./outputs/run-sh/MODEL+dpD+ppP+tpT+mbsM+nmbN, under the current directory]: results; the same
#     shared folder on every node
#   PYTHON [.venv/bin/python of this checkout, else python3]
#   P2P_POWER [80]: workflow: watts a GPU draws while blocked (80 simulated A100, 130 H100)
#   PLAN_POINTS [60]: workflow: points of the time-energy frontier
set -euo pipefail

ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

die() { echo "run.sh: $*" >&2; exit 2; }

MODE=run
if [[ "${1:-}" == "workflow" ]]; then MODE=workflow; shift; fi
# Positional MODEL, MICROBATCH_SIZE, NUM_MICROBATCHES come first; the environment fills in the rest.
POSITIONAL=()
while [[ $# -gt 0 && ${#POSITIONAL[@]} -lt 3 && "$1" != --* && "$1" != *=* ]]; do POSITIONAL+=("$1"); shift; done
MODEL="${POSITIONAL[0]:-${MODEL:-toy}}"
MBS="${POSITIONAL[1]:-${MICROBATCH_SIZE:-2}}"
NMB="${POSITIONAL[2]:-${NUM_MICROBATCHES:-4}}"

DP="" TP="" PP="" PROFILE=false SCHEDULE=1f1b
OVERRIDES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --*=*) name="${1%%=*}"; value="${1#*=}"; shift ;;
        --*) [[ $# -ge 2 ]] || die "$1 needs a value"; name="$1"; value="$2"; shift 2 ;;
        *=*) OVERRIDES+=("$1"); shift; continue ;;
        *) die "unexpected argument '$1' (flags are --NAME VALUE, recipe settings KEY=VALUE)" ;;
    esac
    name="${name#--}"
    case "$name" in
        dp) DP="$value" ;;
        tp) TP="$value" ;;
        pp) PP="$value" ;;
        *)
            [[ "$name" == profile ]] && PROFILE="${value,,}"  # true, True, TRUE
            [[ "$name" == train_schedule ]] && SCHEDULE="$value"
            OVERRIDES+=("trainer.$name=$value") ;;
    esac
done

if [[ -z "${NUM_GPUS:-}" ]]; then
    NUM_GPUS=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        count="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        [[ "$count" -gt 0 ]] && NUM_GPUS="$count"
    fi
fi
NNODES="${NNODES:-1}"
if [[ -z "$DP$TP$PP" ]]; then PP=$((NUM_GPUS * NNODES)); fi
DP="${DP:-1}" TP="${TP:-1}" PP="${PP:-1}"

if [[ -z "${RECIPE:-}" ]]; then
    case "$MODEL" in
        gpt*|toy|demo) RECIPE=gpt ;;
        bert*) RECIPE=bert ;;
        t5*) RECIPE=t5 ;;
        vit*|timm-vit*) RECIPE=vit ;;
        swin*|timm-swin*) RECIPE=swin ;;
        wide-resnet*|wide_resnet*) RECIPE=wide_resnet ;;
        *) die "cannot tell the recipe of model '$MODEL': set RECIPE=gpt|bert|t5|vit|swin|wide_resnet" ;;
    esac
fi
TRAIN_PY="$ROOT/recipes/$RECIPE/train.py"
[[ -f "$TRAIN_PY" ]] || die "no recipe '$RECIPE' ($TRAIN_PY)"
[[ -f "$ROOT/recipes/$RECIPE/conf/model/$MODEL.yaml" ]] || die "recipe '$RECIPE' has no model '$MODEL'"
# Under the current directory, as Hydra's outputs/ are: not inside the checkout from anywhere.
RUN_DIR="${RUN_DIR:-$PWD/outputs/run-sh/$MODEL+dp$DP+pp$PP+tp$TP+mbs$MBS+nmb$NMB}"

# run_one DIR NUM_MICROBATCHES [KEY=VALUE ...]: one run of the recipe, results in DIR.
run_one() {
    local dir="$1" microbatches="$2"
    shift 2
    local args=("model=$MODEL" "parallel.dp=$DP" "parallel.tp=$TP" "parallel.pp=$PP"
                "trainer.per_device_train_batch_size=$MBS" "trainer.gradient_accumulation_steps=$microbatches"
                "${OVERRIDES[@]}" "$@" "hydra.run.dir=$dir")
    if [[ "$NNODES" -eq 1 ]]; then
        # One node: the recipe starts its dp*tp*pp workers itself.
        "$PYTHON" "$TRAIN_PY" "${args[@]}"
    else
        "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" \
            --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
            --nproc_per_node "$NUM_GPUS" "$TRAIN_PY" "${args[@]}"
    fi
}

if [[ "$MODE" == run ]]; then
    [[ "$PROFILE" != true || "$NMB" -eq 1 ]] || die "--profile true needs 1 as NUM_MICROBATCHES, got $NMB"
    run_one "$RUN_DIR" "$NMB"
    echo "run.sh: results in $RUN_DIR"
    exit 0
fi

# The workflow plans from this node's profile, so it runs on one node.
[[ "$NNODES" -eq 1 ]] || die "workflow runs on one node; on several, run the three steps one by one (docs/energy.md)"
[[ "$PROFILE" != true ]] || die "workflow profiles by itself: leave out --profile"
echo "run.sh: 1/3 profile ($MODEL, microbatch $MBS, dp$DP pp$PP tp$TP) -> $RUN_DIR/profile"
run_one "$RUN_DIR/profile" 1 trainer.profile=true
CSV="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["profile"])' "$RUN_DIR/profile/summary.json")"
echo "run.sh: 2/3 plan ($PP stages, $NMB microbatches, $SCHEDULE) -> $RUN_DIR/plan"
"$PYTHON" -m merak.energy.cli plan "$CSV" --num-stages "$PP" --num-microbatches "$NMB" --schedule "$SCHEDULE" \
    --p2p-power "${P2P_POWER:-80}" --points "${PLAN_POINTS:-60}" --out "$RUN_DIR/plan"
echo "run.sh: 3/3 train with the plan -> $RUN_DIR/train"
run_one "$RUN_DIR/train" "$NMB" "trainer.frequency_plan=$RUN_DIR/plan/plan.py"
echo "run.sh: profile $CSV, plan $RUN_DIR/plan/plan.py, training results in $RUN_DIR/train"
