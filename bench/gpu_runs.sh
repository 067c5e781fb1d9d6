#!/usr/bin/env bash
# Issue 28's GPU measurements in one device call (the device README: one H200, wheels carried
# in .whl/, which git ignores): the hand-off's tail per layer time, the pull's stages and
# timeline, calls in the Trio thread on and off, alone and under load, a thread running Python
# beside the actors, a cProfile of both processes, the data plane's own cost.
#   run: bash bench/gpu_runs.sh   (carry [".whl"]; $OUT collects the profiles)
#   some sections only: GPU_RUNS_SECTIONS="targets latency" bash bench/gpu_runs.sh
#   its plumbing, on a CPU (this machine's packages, Mooncake TCP, host memory):
#   GPU_RUNS_SITE= GPU_RUNS_DEVICES="--p-device cpu --d-device cpu --protocol tcp --layers 4 --blocks 8" \
#     bash bench/gpu_runs.sh
# Run on one H200 on 2026-12-05 (all sections: 483 s); docs/benchmarks.md has the figures.
SITE=${GPU_RUNS_SITE-/tmp/site}  # where the carried wheels go; empty: none installed
OUT=${OUT:-/tmp/gpu-runs-out}
SECTIONS=${GPU_RUNS_SECTIONS:-"targets latency timeline load gil profile overhead wakeup"}
if [ -n "$SITE" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=${SITE:+$SITE:}.:integrations/vllm:bench MC_INTRANODE_NVLINK=1 MC_LOG_LEVEL=ERROR PYTHONUNBUFFERED=1
nvidia-smi -L; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
# Every run is bounded (a hang costs its 90 s, not the device call's 600 s), and each section
# says when it started (seconds into the call).
T="timeout 90"
G=${GPU_RUNS_DEVICES:-"--p-device cuda:0 --d-device cuda:0"}
B="$T python bench/gpu_dataplane.py $G --notice"
# inline_max_bytes: the protocol's default (256 MiB for nvlink_intra), and 0 (every call in a thread)
INLINE="default 0"
inl() { [ "$1" = default ] || echo "--inline-max-bytes $1"; }

targets() {
  echo "## the hand-off targets: the tail after the last layer, per layer time (t=${SECONDS}s)"
  for ms in 0.2 0.5 1.0 2.0; do
    $T python bench/gpu_handoff.py $G --layer-ms $ms --checksums off --modes raw,eager,eager_notice,layerwise,layerwise_notice --requests 30 2>&1 | grep "^|\|^#\|inside"
  done
}
latency() {
  echo "## latency, no timeline (t=${SECONDS}s)"
  for sc in whole per-layer; do for i in $INLINE; do
    $B --scenario $sc $(inl $i) 2>&1 | grep -v "^WARNING\|^[EIW]1[0-9]\|Logging before"
  done; done
}
timeline() {
  echo "## timeline (t=${SECONDS}s)"
  for sc in whole per-layer; do for i in $INLINE; do
    rm -f /tmp/tl.jsonl; $B --scenario $sc $(inl $i) --timeline /tmp/tl.jsonl 2>&1 | grep "timeline"
  done; done
}
load() {
  echo "## under load: 4 workers, 2 calls/peer, concurrency 4, 256 requests (t=${SECONDS}s)"
  for sc in whole per-layer; do for i in $INLINE; do
    $B --scenario $sc $(inl $i) --workers 4 --calls-per-peer 2 --concurrency 4 --requests 256 2>&1 | grep "^|\|inside"
  done; done
}
gil() {
  echo "## the hand-off with a thread running Python beside the actors (as a vLLM forward), GIL interval 5 / 1 / 0.5 ms (t=${SECONDS}s)"
  H="$T python bench/gpu_handoff.py $G --layer-ms 0.5 --checksums off --modes eager_notice,layerwise_notice --requests 30"
  $H 2>&1 | grep "^|"
  for ms in 5 1 0.5; do echo "# busy, $ms ms"; $H --busy-python --gil-switch-ms $ms 2>&1 | grep "^|"; done
}
profile() {
  echo "## profile (t=${SECONDS}s)"
  mkdir -p $OUT/prof
  $B --scenario whole --iters 400 --profile $OUT/prof 2>&1 | grep "^|"
  for r in prefill decode; do
    python - $OUT/prof/$r.prof <<'PY'
import pstats, sys
print("=== ", sys.argv[1])
pstats.Stats(sys.argv[1]).sort_stats("tottime").print_stats(25)
PY
  done 2>&1 | grep -v "^$" | cut -c1-160
}
overhead() {
  echo "## write_overhead (t=${SECONDS}s)"
  $T python bench/write_overhead.py 2>&1 | tail -5
}
wakeup() {
  echo "## GIL wake-up on this host's CPUs: a blocking recv against poll-then-recv (t=${SECONDS}s)"
  $T python bench/gil_wakeup.py --intervals-ms 5 0.5 --readers recv poll 2>&1 | tail -10
}
for s in $SECTIONS; do $s; done
echo "## done (t=${SECONDS}s)"
