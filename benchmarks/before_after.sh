#!/usr/bin/env bash
# Before/after in one run: W1 and W2 in process (`petrel bench`), W3 and the 64-stream long-output run
# (benchmarks/w3_long_streams.py's settings) against `petrel serve`, for a base commit and the working tree,
# alternating base / new round by round so that drift on the machine falls on both.
#
#   bash benchmarks/before_after.sh <base-commit> [rounds] [out-dir]
#
# The base runs from a git worktree of <base-commit> (its kernels are built on first use); both use this
# checkout's .venv and this checkout's clients (petrel.bench.serve), so only the server / engine differs.
# Results: <out-dir>/{w12,w3,long}-{base,new}-<round>.json (default out-dir: benchmarks/results/before-after).
set -euo pipefail
BASE=${1:?base commit}; ROUNDS=${2:-2}; OUT=${3:-benchmarks/results/before-after}
ROOT=$(cd "$(dirname "$0")/.." && pwd); PY=$ROOT/.venv/bin/python
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
TREE=$(mktemp -d /tmp/petrel-base.XXXXXX)
git -C "$ROOT" worktree add -f --detach "$TREE" "$BASE" >/dev/null
trap 'git -C "$ROOT" worktree remove --force "$TREE"' EXIT

serve_bench() {   # tree name port [client args...] -- [server args...]
  local tree=$1 name=$2 port=$3; shift 3
  local client=() server=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do client+=("$1"); shift; done
  [ $# -gt 0 ] && shift; server=("$@")
  (cd /tmp && PYTHONPATH=$tree exec $PY -m petrel.cli serve --port "$port" --log-level warning ${server[@]+"${server[@]}"} \
     >"$OUT/$name.server.log" 2>&1) &
  local pid=$!
  for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  (cd /tmp && PYTHONPATH=$ROOT $PY -m petrel.bench.serve --url "http://127.0.0.1:$port" ${client[@]+"${client[@]}"} \
     --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1) || echo "$name: the client failed (see $OUT/$name.log)"
  kill "$pid"; wait "$pid" 2>/dev/null || true; sleep 2
}

LONG=(--concurrency 64 --num-prompts 64 --max-tokens 1024 -- --kv-cache-memory $((5 * 1024**3)) --max-num-seqs 64)
for round in $(seq 1 "$ROUNDS"); do
  order="base new"; [ $((round % 2)) = 0 ] && order="new base"
  for v in $order; do
    tree=$TREE; [ "$v" = new ] && tree=$ROOT
    echo "round $round: $v"
    (cd /tmp && PYTHONPATH=$tree $PY -m petrel.cli bench --workloads w1,w2 --engines petrel \
       --json "$OUT/w12-$v-$round.json" >"$OUT/w12-$v-$round.log" 2>&1)
    serve_bench "$tree" "w3-$v-$round" 8100
    serve_bench "$tree" "long-$v-$round" 8101 "${LONG[@]}"
  done
done
"$PY" - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
def runs(pattern):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{pattern}"))]
for v in ("base", "new"):
    w12 = [r for run in runs(f"w12-{v}-*.json") for r in run["results"]]
    w1 = [r["decode_tok_s"] for r in w12 if r.get("workload") == "w1"]
    w2 = [r["output_tok_s"] for r in w12 if r.get("workload") == "w2"]
    print(f"{v}: W1 decode tok/s {[round(x, 1) for x in w1]}, W2 tok/s {[round(x, 1) for x in w2]}")
    for kind in ("w3", "long"):
        for r in runs(f"{kind}-{v}-*.json"):
            r = r[0] if isinstance(r, list) else r
            print(f"{v}: {kind} {r['output_tok_s']:.1f} tok/s, TTFT p50/p99 {r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s, "
                  f"TPOT p50/p99 {r['tpot_p50_s'] * 1e3:.0f}/{r['tpot_p99_s'] * 1e3:.0f} ms")
PY
