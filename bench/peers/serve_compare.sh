#!/usr/bin/env bash
# Server against server: start one engine's OpenAI server, drive it with
# `inflight bench serve` on one workload, save the report and the server's prefix-cache
# counters, stop the server. Run it once per engine (and per setting) back to back.
#
# usage: serve_compare.sh ENGINE OUT_DIR -- NAME [bench serve options...] [-- NAME [options...]]
#   ENGINE: inflight | inflight-no-prefix | vllm | vllm-no-prefix
#   each "--" group is one `inflight bench serve` run against the same server, in order
#   (e.g. `-- multi-turn --workload multi-turn --num-prompts 20 -- online-1 --workload online --rate 1`)
# Result per run: OUT_DIR/ENGINE.NAME.json (bench serve's report) and OUT_DIR/ENGINE.NAME.metrics
# (the server's /metrics after the run: counters are cumulative over the runs); and
# OUT_DIR/ENGINE.server.log.
# Environment (optional):
#   PEERS_DIR     holds venv-vllm and smollm2-135m-instruct (see README.md next to this)
#   INFLIGHT_DIR  this checkout (default: two levels above this script)
#   PORT          (default 8011)
#   BENCH_LOCK    lock file for timed runs (default /tmp/bench.lock)
#   SERVER_ARGS   extra server flags
#   CLIENT        inflight (default): `inflight bench serve`; vllm: vLLM's own client
#                 (`vllm bench serve`, through vllm_serve_client.py in PEERS_DIR/venv-vllm),
#                 which takes --workload, --rate and --num-prompts from each group and
#                 writes OUT_DIR/ENGINE.NAME.vllm-client.json (vLLM's result format)
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 ENGINE OUT_DIR -- NAME [bench serve options] [-- NAME [options]]..." >&2
  exit 2
fi
ENGINE=$1
OUT_DIR=$2
shift 2
if [ "${1:-}" = "--" ]; then shift; fi
HERE=$(cd "$(dirname "$0")" && pwd)
INFLIGHT_DIR=${INFLIGHT_DIR:-$(cd "$HERE/../.." && pwd)}
PORT=${PORT:-8011}
LOCK=${BENCH_LOCK:-/tmp/bench.lock}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

case $ENGINE in
  inflight|inflight-no-prefix)
    flags=(--dtype bfloat16 --host 127.0.0.1 --port "$PORT")
    [ "$ENGINE" = inflight-no-prefix ] && flags+=(--no-enable-prefix-caching)
    cmd=("$INFLIGHT_DIR/.venv/bin/inflight" serve "${flags[@]}")
    ;;
  vllm|vllm-no-prefix)
    : "${PEERS_DIR:?set PEERS_DIR (venv-vllm, smollm2-135m-instruct)}"
    flags=(--model "$PEERS_DIR/smollm2-135m-instruct" --served-model-name SmolLM2-135M-Instruct
           --dtype bfloat16 --host 127.0.0.1 --port "$PORT"
           --enable-prompt-tokens-details)  # usage.prompt_tokens_details.cached_tokens
    [ "$ENGINE" = vllm-no-prefix ] && flags+=(--no-enable-prefix-caching)
    # Both cores for its OpenMP threads (its default keeps one for the scheduler), 4 GiB KV.
    export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4
    cmd=("$PEERS_DIR/venv-vllm/bin/python" -m vllm.entrypoints.openai.api_server "${flags[@]}")
    ;;
  *) echo "unknown engine $ENGINE" >&2; exit 2 ;;
esac

# shellcheck disable=SC2206
cmd+=(${SERVER_ARGS:-})
echo "== $ENGINE: ${cmd[*]}" >&2
"${cmd[@]}" > "$OUT_DIR/$ENGINE.server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
started=$(date +%s)
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  kill -0 $server 2>/dev/null || { echo "$ENGINE server died; see $OUT_DIR/$ENGINE.server.log" >&2; exit 1; }
  sleep 2
done
echo "== $ENGINE ready after $(( $(date +%s) - started )) s" >&2
run_vllm_client() {
  local name=$1 workload="" rate="" num=0
  shift
  while [ $# -gt 0 ]; do
    case $1 in
      --workload) workload=$2; shift 2 ;;
      --rate) rate=$2; shift 2 ;;
      --num-prompts) num=$2; shift 2 ;;
      *) echo "CLIENT=vllm takes only --workload, --rate, --num-prompts (got $1)" >&2; exit 2 ;;
    esac
  done
  : "${PEERS_DIR:?set PEERS_DIR (venv-vllm, smollm2-135m-instruct)}"
  local file=$OUT_DIR/workload_$workload.jsonl
  [ -f "$file" ] || "$INFLIGHT_DIR/.venv/bin/inflight" bench workload "$workload" -o "$file"
  echo "== $ENGINE / $name: vllm bench serve, $workload[:$num] at $rate req/s" >&2
  flock "$LOCK" "$PEERS_DIR/venv-vllm/bin/python" "$HERE/vllm_serve_client.py" \
    --workload "$file" --tokenizer "$PEERS_DIR/smollm2-135m-instruct" --port "$PORT" \
    --rate "$rate" --num-prompts "$num" --label "$ENGINE $name" \
    --result "$OUT_DIR/$ENGINE.$name.vllm-client.json"
}
run_bench() {
  local name=$1
  shift
  if [ "${CLIENT:-inflight}" = vllm ]; then
    run_vllm_client "$name" "$@"
  else
    echo "== $ENGINE / $name: bench serve $*" >&2
    "$INFLIGHT_DIR/.venv/bin/inflight" bench serve --port "$PORT" --bench-lock "$LOCK" \
      --label "$ENGINE $name" --result-json "$OUT_DIR/$ENGINE.$name.json" --disable-tqdm "$@"
  fi
  curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT_DIR/$ENGINE.$name.metrics" || true
  grep -E '^(vllm|inflight):prefix_cache_(queries|hits)_total' "$OUT_DIR/$ENGINE.$name.metrics" >&2 || true
}
group=()
for arg in "$@"; do
  if [ "$arg" = "--" ]; then
    run_bench "${group[@]}"
    group=()
  else
    group+=("$arg")
  fi
done
if [ ${#group[@]} -gt 0 ]; then run_bench "${group[@]}"; fi
