#!/usr/bin/env bash
# The GPU machine's acceptance runs, one device command each, named by what they accept.
# Run from the repo root on the GPU machine, with the wheels of shared/device/wheels.sh in .whl/:
#
#   bash scripts/gpu_acceptance.sh leaderboard-sweep    # on a FRESH machine: the full leaderboard
#       sweep (another GPU's name refused first), its export checked, diff and show in 80 columns
#   bash scripts/gpu_acceptance.sh leaderboard-levers   # on a FRESH machine: the one-launch levers'
#       GPU tests, a fresh sweep that searches them (its table and results come back, and stay in
#       .gpu/ for the next command), exported and checked; then each of tables/H200.yaml's winners
#       beside itself with reduce=spin, q_load=first and bf16 partials (`mla-tune time variants
#       --floor`, each list timed forward and back) and the levers at 4x1, 4x64 and 4x1024
#   bash scripts/gpu_acceptance.sh leaderboard-budget   # a budget_s 120 sweep holds its budget,
#       its export checked, diff against the committed table
#   BASE=OLD_EXPORT.py bash scripts/gpu_acceptance.sh leaderboard-export   # on one GPU: this
#       tree's leaderboard export beside OLD_EXPORT.py (paired ratio, strict at the 12 shapes),
#       the contest's ranked mode, then side by side the engine-call, integration, gluon and
#       compile GPU tests and scripts/compile_vs_driver.py; TEST_GROUPS= (;-separated) replaces
#       the test groups
#   bash scripts/gpu_acceptance.sh sweep-safety         # the crash-and-resume sweep (an
#       out-of-bounds candidate, kill -9 halfway) and the strict fallback at short lengths:
#       tests/test_crash_resume.py and tests/test_runtime.py, one after the other
#   bash scripts/gpu_acceptance.sh serving-tests [OLD_EXPORT.py]   # the serving GPU tests in
#       parallel groups, the leaderboard export beside OLD_EXPORT.py (3% rule), serving host times
#   bash scripts/gpu_acceptance.sh serving-splitk       # on one GPU: the serving split-K tests
#       (its shared split budget), the ragged mix that budget is for beside FlashMLA and two
#       large-batch cells beside their swept times (`mla-tune time mix`), `mla-tune verify`
#       at seeds 3 and 4 (SEEDS= others)
#   bash scripts/gpu_acceptance.sh splitk-default      # on one GPU: split-K's default serving variant
#       beside the unbudgeted one it replaced (a split every 512 tokens, no split_budget), timed
#       new, old, old, new by `mla-tune time mix` at four mixes in four 64-row families (MIXES=
#       ;-separated --lens, FAMILIES= kv/heads/q_len), the table's picks and the vendors beside;
#       then DecodePlan's scratch and update host time per family (bench_update.py --by-family)
#   RESULTS=... CONFIG=... DEVICES=... bash scripts/gpu_acceptance.sh serving-sweep-chunk   # one
#       chunk of the serving sweep, resumed from the previous chunk's results (they come back
#       in $OUT as H200.serving.results.tgz; DEVICES=0,1 runs a shard per GPU)
#   bash scripts/gpu_acceptance.sh gpu-suite           # the whole GPU suite (pytest -m gpu, 8 xdist
#       workers; pytest-xdist and execnet wheels in .whl/), then DecodePlan.update's host time
#       (scripts/bench_update.py) with the table, per backend that ran, and without it
#       (--no-lookup); about 6 minutes
#   SEEDS="91 92" bash scripts/gpu_acceptance.sh serving-verify   # DecodePlan.update's host time
#       on the device's tensors (bench_update.py), run's host times beside the vendors'
#       (bench_serving_host.py), then `mla-tune verify` of tables/H200.serving.yaml at each seed
#       (30 shapes, 10 ragged mixes)
#   SEEDS="107 108" bash scripts/gpu_acceptance.sh serving-recheck   # `mla-tune verify` of
#       tables/H200.serving.yaml at each seed only (VERIFY_BUDGET=, VERIFY_TIMEOUT=), reports back
#   bash scripts/gpu_acceptance.sh serving-steps    # on one GPU: each role of `mla-tune time mix`
#       also as a layer of a LAYERS=8-layer step at the engine loop's mixes (bf16, fp8; 8 and 32
#       sequences, 128 heads), the calibration probe's LayeredSteps on the GPU, `time scan
#       --layers` over bf16's 8 x 2048 bucket (docs/perf.md 2.7)
#   bash scripts/gpu_acceptance.sh serving-points   # `mla-tune time points` of
#       tables/H200.serving.yaml (POINTS=48 points, POINTS_BUDGET=300 s): its points timed again,
#       as a sweep step and in verify's alternating passes; the report comes back gzipped.
#       RETIME=1 (FAMILIES= its --families, TABLE= the table to start from): every point timed
#       again in passes, the table written back as H200.serving.retimed.yaml; LAYERS=N times
#       each as a layer of an N-layer step (an engine's step; docs/perf.md 2.7)
#   SEEDS="101 102" bash scripts/gpu_acceptance.sh serving-adopt   # a serving table built by this
#       tree from a sweep's results (RESULTS=, default docs/data/sweep/h200-2026-12-02-gluon/
#       H200.serving.results.jsonl.gz; or TABLE_GZ= a built table) calibrated here,
#       `mla-tune verify` of it at each seed, then the engine loop (fp8, bf16) beside FlashMLA
#       (ENGINE_LOOPS=0: not the engine loop)
#   bash scripts/gpu_acceptance.sh serving-graph-steps  # on the table's GPU (TABLE=): the engine
#       loop (61 layers) at every batch bucket of each of GRAPH_FAMILIES= (KV/heads/q_len, default
#       all twelve) at each of LENS= (LO,HI pairs; default 500,4000), the table's graph pick beside
#       each candidate of GRAPH_VARIANTS_bf16= / GRAPH_VARIANTS_fp8= (;-separated; default the
#       family's graph picks, FlashMLA, and FlashInfer at bf16; `cell-picks` adds its eager cells'
#       picks and runner-ups; what the sweep's gate refused is not looped) as the bucket's pick; the reports
#       come back in engine_loops.tgz for `mla-tune verify --engine-loop ... --repick-graph OUT`
#   bash scripts/gpu_acceptance.sh serving-table        # on two GPUs: `mla-tune verify` of
#       tables/H200.serving.yaml and the FlashInfer tests on GPU 1; on GPU 0 the fast-path and
#       FlashMLA tests, the engine loop (bf16, fp8) beside FlashMLA, the 64 x 4000 example, host times
#
# MLA_TUNE_REQUIRE_BACKENDS=1 (exported for every mode): a GPU test whose backend cannot run fails.
#
# Test groups name files; a file that is not in this tree is left out of its group (with a
# line saying so), so a group survives tests moving between files.
#
# It works in /tmp/acceptance and copies what matters (the table, its results file, the logs,
# at most 8 files: what the device tool brings back) to $OUT (or ./gpu_out).
set -uo pipefail
modes="serving-graph-steps|gpu-suite|splitk-default|serving-steps|leaderboard-levers|serving-verify|serving-recheck|serving-points|serving-adopt|leaderboard-sweep|leaderboard-budget|leaderboard-export|sweep-safety|serving-tests|serving-splitk|serving-sweep-chunk|serving-table"
mode=${1:?usage: gpu_acceptance.sh $modes}
keep=${OUT:-gpu_out}
out=/tmp/acceptance
mkdir -p "$out" "$keep"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PATH=/tmp/site/bin:$PATH CUDA_HOME=/usr/local/cuda \
  FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1 MLA_TUNE_REQUIRE_BACKENDS=1

timed() {  # timed NAME CMD...: runs CMD, prints and records its wall seconds
  local name=$1; shift
  local t0; t0=$(date +%s%N)
  "$@"
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s: wall %d.%03d s (exit %d)\n' "$name" $((ms / 1000)) $((ms % 1000)) "$rc" | tee -a "$out/walls.txt"
}

verify_seeds() {  # verify_seeds TABLE: `mla-tune verify` of TABLE at each of $SEEDS, reports gzipped to $keep
  local seed
  for seed in ${SEEDS:?SEEDS=\"S1 S2\" names the fresh seeds}; do
    timed verify-$seed timeout ${VERIFY_TIMEOUT:-240} python3 -m mla_tune verify --table "$1" \
      --seed $seed --budget ${VERIFY_BUDGET:-190} --workers 12 --max-p95 0.05 --max-regret 0.15 \
      --json "$out/verify$seed.json" > "$out/verify$seed.log" 2>&1; grep -v -i warn "$out/verify$seed.log" | tail -9
    gzip -c "$out/verify$seed.json" > "$keep/verify$seed.json.gz" 2>/dev/null
  done
}

engine_loops() {  # engine_loops TABLE TIMEOUT: the engine loop at fp8 and bf16, buckets 8 and 32, beside FlashMLA
  local kv
  for kv in fp8 bf16; do
    timed engine-$kv timeout "$2" python3 scripts/engine_loop.py --kv $kv --buckets 8,32 \
      --table "$1" --out "$out/engine_$kv" 2>&1 | tail -4
    cp "$out/engine_$kv/engine_loop.json" "$out/engine_$kv.json" 2>/dev/null
  done
}

present() {  # present GROUP: the group without its test files missing here; nothing when none is here
  local g=$1 f kept=0
  for f in $(grep -o 'tests/[A-Za-z0-9_/]*\.py' <<< "$g"); do
    if [ -f "$f" ]; then kept=1; else g=${g//$f/}; echo "left out $f (not in this tree)" | tee -a "$out/walls.txt" >&2; fi
  done
  [ "$kept" = 1 ] && printf '%s' "$g"
  return 0
}

run_groups() {  # run_groups TIMEOUT TAIL: the GPU test groups in "${groups[@]}" side by side
  local i=0 g n kept=()
  for g in "${groups[@]}"; do
    g=$(present "$g")
    [ -n "$g" ] && kept+=("$g")
  done
  groups=("${kept[@]}")
  for g in "${groups[@]}"; do
    i=$((i + 1))
    ( eval timeout ${GROUP_TIMEOUT:-$1} python3 -m pytest -q -m gpu -p no:cacheprovider $g > "$out/gpu_tests_$i.log" 2>&1
      echo "group $i ($g): exit $?" >> "$out/walls.txt" ) &
  done
  wait
  for n in $(seq 1 $i); do echo "== group $n: ${groups[$((n - 1))]}"; cat "$out/gpu_tests_$n.log"; done > "$out/gpu_tests.log"
  for n in $(seq 1 $i); do echo "== group $n"; tail -"$2" "$out/gpu_tests_$n.log"; done
}

case $mode in
leaderboard-sweep)
  # another GPU is refused from its name, before any worker starts
  timed refuse-MI355X python3 -m mla_tune sweep --gpu MI355X --config configs/mi355x.yaml 2>&1 | tail -2
  python3 -m mla_tune sweep --gpu H200 --dry-run > "$out/dryrun.txt" 2>&1
  grep -i -E "estimat|budget|rung" "$out/dryrun.txt" | head -12
  timed sweep python3 -m mla_tune sweep --gpu H200 --fresh --out "$out/H200.yaml" > "$out/sweep.log" 2>&1
  tail -30 "$out/sweep.log"
  python3 -m mla_tune export --table "$out/H200.yaml" -o "$out/full.py"
  python3 scripts/check_submission.py "$out/full.py" --reps 30 2>&1 | tail -20
  COLUMNS=80 python3 -m mla_tune diff tables/H200.yaml "$out/H200.yaml"
  COLUMNS=80 python3 -m mla_tune show --table "$out/H200.yaml" | awk 'length > 80' | wc -l
  ;;
leaderboard-levers)
  timed lever-tests timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gluon_decode.py \
    -k "q_loaded_first or (empty_splits and partials) or reduce_spin" > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log"
  timed sweep python3 -m mla_tune sweep --gpu H200 --fresh --out "$out/H200.yaml" > "$out/sweep.log" 2>&1
  tail -22 "$out/sweep.log"
  python3 -m mla_tune export --table "$out/H200.yaml" -o "$out/full.py"
  timed check python3 scripts/check_submission.py "$out/full.py" --reps 30 2>&1 | tail -16
  COLUMNS=80 python3 -m mla_tune diff tables/H200.yaml "$out/H200.yaml"
  mkdir -p .gpu && cp "$out/H200.yaml" "$out/H200.results.jsonl" .gpu/  # ignored: the next command here finds them
  cp "$out/H200.yaml" "$out/H200.results.jsonl" "$out/sweep.log" "$out/gpu_tests.log" "$keep/"
  # per shape: the winner W, W+spin, W+spin+q first, W+spin+q first+bf16 partials (where
  # spin runs; else W and W+q first), then the same list backwards: both positions (6.1)
  python3 - > "$out/levers.txt" <<'PY'
import yaml
from mla_tune.core import Shape, Variant
from mla_tune.kernels.gluon_decode import gd_check_launch
for row in yaml.safe_load(open("tables/H200.yaml"))["rows"]:
    shape, w = Shape(row["batch"], row["kv_len"]), Variant.parse(row["winner"]["variant"])
    steps = [dict(reduce="spin"), dict(q_load="first"), dict(part="bf16")]
    try:
        gd_check_launch(shape.batch, w.p["num_splits"], block_n=w.p["block_n"], num_stages=w.p["num_stages"],
                        v_path=w.p["v_path"], reduce="spin", sm_count=132)
        assert w.p["num_splits"] > 1
    except (AssertionError, ValueError):  # spin cannot run: q first only
        steps = [dict(q_load="first")]
    chain = [w]
    for step in steps:
        chain.append(chain[-1].with_params(**step))
    print(f"{shape.batch}x{shape.kv_len}", *map(str, chain + chain[::-1]))
PY
  base="gluon_fused(block_n=64,kv=fp8,num_splits=1,num_stages=2,q=fp8_dynamic,v_path=rs8)"
  sixteen="gluon_fused(block_n=64,kv=fp8,num_splits=16,num_stages=2,q=fp8_dynamic,v_path=ss16)"
  echo "4x1,4x64 $base ${base/v_path/q_load=first,v_path} ${base/v_path/q_load=first,v_path} $base" >> "$out/levers.txt"
  echo "4x1024 $sixteen ${sixteen/v_path/reduce=spin,v_path} ${sixteen/q=/part=bf16,q=} ${sixteen/q=/part=bf16,q_load=first,q=}" \
    >> "$out/levers.txt"
  while read -r shapes variants; do  # what LEVERS_S (default 570) seconds of the command leave
    [ "$SECONDS" -lt "${LEVERS_S:-570}" ] || { echo "levers at $shapes: left out, out of time" | tee -a "$out/walls.txt"; continue; }
    timed "levers-$shapes" timeout 120 python3 -m mla_tune time variants $variants --shapes "$shapes" --floor \
      --reps 40 >> "$out/levers.log" 2>&1
  done < "$out/levers.txt"
  grep -v -i warn "$out/levers.log"
  cp "$out/levers.log" "$out/levers.txt" "$keep/"
  ;;
leaderboard-budget)
  # the estimate comes from the last full sweep's measured costs (tables/H200.results.jsonl)
  sed 's/^budget_s: .*/budget_s: 120              # the budget must hold for real/; s/^name: .*/name: leaderboard-budget120/' \
    configs/leaderboard.yaml > "$out/budget120.yaml"
  python3 -m mla_tune sweep --gpu H200 --config "$out/budget120.yaml" --out "$out/H200.b120.yaml" \
    --dry-run > "$out/dryrun120.txt" 2>&1
  grep -i -E "estimat|budget" "$out/dryrun120.txt" | head -8
  timed sweep120 python3 -m mla_tune sweep --gpu H200 --config "$out/budget120.yaml" --fresh \
    --out "$out/H200.b120.yaml" > "$out/sweep120.log" 2>&1
  tail -25 "$out/sweep120.log"
  python3 -m mla_tune export --table "$out/H200.b120.yaml" -o "$out/b120.py"
  python3 scripts/check_submission.py "$out/b120.py" --reps 30 2>&1 | tail -16
  COLUMNS=80 python3 -m mla_tune diff tables/H200.yaml "$out/H200.b120.yaml"
  ;;
sweep-safety)
  timed crash-resume timeout 450 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_crash_resume.py \
    > "$out/gpu_tests_crash.log" 2>&1; tail -3 "$out/gpu_tests_crash.log"
  timed strict-fallback timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_runtime.py \
    > "$out/gpu_tests_strict.log" 2>&1; tail -3 "$out/gpu_tests_strict.log"
  cat "$out/gpu_tests_crash.log" "$out/gpu_tests_strict.log" > "$out/gpu_tests.log"
  ;;
serving-tests)
  # GPU test groups run side by side (compiles dominate; 16 cores), each with its own log
  groups=(
    "tests/test_serving_correctness.py -k triton_fused"
    "tests/test_serving_correctness.py -k 'triton and not triton_fused'"
    "tests/test_serving_correctness.py -k 'flashinfer or flashmla'"
    "tests/test_serving_correctness.py -k gluon_fused"
    "tests/test_graph_replay.py tests/test_vendor_serving.py"
    "tests/test_gluon_decode.py -k 'reduce_spin'"
  )
  run_groups 330 3
  python3 -m mla_tune export --table tables/H200.yaml -o "$out/new_export.py"
  if [ -n "${2:-}" ]; then
    timed lb-side-by-side python3 scripts/check_submission.py "$out/new_export.py" --against "$2" \
      --table tables/H200.yaml --reps 50 --rounds 3 --max-ratio 1.03 --out "$out" 2>&1 | tail -16
  fi
  timed host python3 scripts/bench_serving_host.py --out "$out" 2>&1 | tail -14
  ;;
serving-splitk)
  groups=(
    "tests/test_serving_correctness.py -k 'triton and not triton_fused'"
    "tests/test_graph_replay.py tests/test_fast_launch.py"
  )
  run_groups 200 2
  # the ragged mix the shared budget is for; then two grid points whose split-K picks
  # (max_splits 64 and 17) leave most of the grid's items empty, beside their times as swept
  timed mix timeout 90 python3 -m mla_tune time mix --table tables/H200.serving.yaml --kv fp8 --heads 16 \
    --lens 4501,2796,56221 > "$out/mix.log" 2>&1
  for heads in 16 128; do
    timed mix-256x512-$heads timeout 90 python3 -m mla_tune time mix --table tables/H200.serving.yaml --kv fp8 \
      --heads $heads --q-len 4 --lens "512*256" >> "$out/mix.log" 2>&1
  done
  grep -v -i warn "$out/mix.log" | tail -24
  for seed in ${SEEDS:-3 4}; do
    timed verify-$seed timeout 170 python3 -m mla_tune verify --table tables/H200.serving.yaml --seed $seed \
      --shapes 60 --ragged 20 --budget 130 --max-p95 0.05 --max-regret 0.15 --json "$out/verify$seed.json" \
      > "$out/verify$seed.log" 2>&1; grep -v -i warn "$out/verify$seed.log" | tail -9
  done
  ;;
splitk-default)
  # each line: FAMILY NEW OLD (OLD: NEW without its budget, a split every 512 tokens)
  python3 - "${FAMILIES:-fp8/128/1 bf16/128/1 fp8/128/4 fp8/16/4}" > "$out/defaults.txt" <<'PY'
import sys
from mla_tune import gpu
from mla_tune.backends import get_backend
from mla_tune.core import CallSpec, Variant
platform = gpu.detect()
for family in sys.argv[1].split():
    kv, heads, q_len = family.split("/")
    new = get_backend("triton").default_serving_variant(
        CallSpec(kv, page_size=64, heads=int(heads), max_q_len=int(q_len)), platform)
    old = Variant.make("triton", **{**{k: v for k, v in new.p.items() if k != "split_budget"}, "tokens_per_split": 512})
    print(family, new, old)
PY
  cat "$out/defaults.txt"
  IFS=';' read -r -a mixes <<< "${MIXES:-4501,2796,56221;512*256;4000*64;20000*40}"
  while read -r family new old; do
    IFS=/ read -r kv heads q_len <<< "$family"
    for lens in "${mixes[@]}"; do
      [ "$SECONDS" -lt "${MIX_S:-420}" ] || { echo "mix $family $lens: left out, out of time" | tee -a "$out/walls.txt"; continue; }
      echo "== $family $lens" >> "$out/mix.log"
      timed "mix-$family-$lens" timeout 90 python3 -m mla_tune time mix --table tables/H200.serving.yaml --kv "$kv" \
        --heads "$heads" --q-len "$q_len" --lens "$lens" --variant "$new" --variant "$old" --variant "$old" \
        --variant "$new" >> "$out/mix.log" 2>&1
    done
  done < "$out/defaults.txt"
  # the table: per family and mix, new and old (mean of the two positions) and old / new
  awk '/^== /{f=$2; m=$3; n1=n2=o1=o2=""; bad=""} $1 ~ /^extra[1-4]$/ && $4 != "ok"{bad=" FAIL"}
       $1=="extra1"{n1=$2} $1=="extra2"{o1=$2} $1=="extra3"{o2=$2}
       $1=="extra4"{n2=$2; if (n1+0 > 0 && n2+0 > 0 && o1+0 > 0 && o2+0 > 0)
         printf "%-11s %-16s new %7.1f (%7.1f %7.1f) old %7.1f (%7.1f %7.1f) old/new %.3f%s\n", f, m, (n1+n2)/2, n1, n2,
           (o1+o2)/2, o1, o2, (o1+o2)/(n1+n2), bad; else print f, m, "a default did not run" bad}' "$out/mix.log" \
    | tee "$out/defaults_table.txt"
  timed update timeout 150 python3 scripts/bench_update.py --device cuda --warm --by-family --mixes 300 \
    --json "$out/update_c.json" 2>&1 | grep -v -i warn | tail -30
  cp "$out/mix.log" "$out/defaults_table.txt" "$keep/"
  ;;
serving-steps)
  # an engine's step against the flushed call (docs/perf.md 2.7): `time mix --layers` at the
  # engine loop's first-step mixes, LayeredStep timed by time_call; the calibration probe on
  # the GPU (LayeredSteps captured there); `time scan --layers` over one bucket
  L8=2240,3665,2998,1646,3134,3083,3333,532
  L32=3352,2280,1730,3391,981,1403,1141,2108,3853,1924,2915,3258,2976,786,3415,3470,1457,2884,3006,3764,1874,3855,2636,1633,3411,1451,1987,3225,1019,2425,1133,2094
  for kv in bf16 fp8; do for lens in $L8 $L32; do
    echo "== $kv ${lens:0:20}... layers ${LAYERS:-8}" >> "$out/steps.log"
    timed "steps-$kv" timeout 120 python3 -m mla_tune time mix --table tables/H200.serving.yaml --kv $kv \
      --heads 128 --lens "$lens" --layers ${LAYERS:-8} --reps 20 >> "$out/steps.log" 2>&1
  done; done
  grep -v -i warn "$out/steps.log" | grep -E "^==|^ +(eager|graph|flashinfer|flashmla) "
  timed calibrate-probe timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_serving_calibrate.py \
    -k real_kernel 2>&1 | tail -2
  timed scan timeout 240 python3 -m mla_tune time scan --kv bf16 --heads 128 --batch 8 --bucket 2048 \
    --points 4 --layers ${LAYERS:-8} --reps 10 --json "$out/scan.json" > "$out/scan.log" 2>&1
  grep -v -i warn "$out/scan.log" | tail -8
  cp "$out/steps.log" "$out/scan.log" "$out/scan.json" "$keep/" 2>/dev/null
  ;;
serving-sweep-chunk)
  # the serving sweep, one chunk per device command (the sweep stops cleanly at
  # --budget and resumes from its results file). RESULTS= the previous chunk's
  # H200.serving.results.tgz (or a one-GPU .jsonl.gz), carried from its $OUT; CONFIG= the sweep config
  # (default configs/serving.yaml). Brings back the results and, once complete, the table.
  # DEVICES=0,1: one shard per GPU (--devices), merged once every shard is done; the
  # results come back as one tar of every results file (a one-GPU chunk's .jsonl.gz too).
  mkdir -p /tmp/sw
  case "${RESULTS:-}" in
    "") ;;
    *.tgz) tar xzf "$RESULTS" -C /tmp/sw || exit 1 ;;
    *) gunzip -c "$RESULTS" > /tmp/sw/H200.serving.results.jsonl || exit 1 ;;
  esac
  timed sweep timeout ${SWEEP_TIMEOUT:-560} python3 -m mla_tune sweep --config "${CONFIG:-configs/serving.yaml}" \
    --gpu H200 --out /tmp/sw/H200.serving.yaml --budget ${SWEEP_BUDGET:-500} ${DEVICES:+--devices $DEVICES} \
    > "$out/sweep.log" 2>&1
  tar czf "$keep/H200.serving.results.tgz" -C /tmp/sw $(cd /tmp/sw && ls *.results.jsonl)
  cp /tmp/sw/H200.serving.yaml "$keep/" 2>/dev/null
  cp "$out/sweep.log" "$keep/"
  grep -v -i warn "$out/sweep.log" | tail -12
  ;;
leaderboard-export)
  python3 -m mla_tune export --gpu H200 -o "$out/new_export.py" 2>&1 | tail -1
  if [ -n "${BASE:-}" ]; then
    timed lb-side-by-side timeout ${PAIRED_TIMEOUT:-240} python3 scripts/check_submission.py "$out/new_export.py" --against "$BASE" \
      --shapes bench,test --require strict --table tables/H200.yaml --reps 50 --rounds ${ROUNDS:-3} --max-ratio 1.03 \
      --out "$out" 2>&1 | grep -v -i warn | tail -18
  fi
  timed ranked timeout 200 python3 scripts/check_submission.py "$out/new_export.py" --ranked --shapes bench,test \
    --out "$out" 2>&1 | grep -v -i warn | tail -18
  if [ -n "${TEST_GROUPS:-}" ]; then IFS=';' read -r -a groups <<< "$TEST_GROUPS"; else
  groups=(
    "tests/test_serving_correctness.py -k 'uint8 or flashmla'"
    "tests/test_integrations_engines.py"
    "tests/test_gluon_decode.py"
    "tests/test_xcompile.py tests/test_nvidia_backends.py"
  ); fi
  ( timed compile-vs-driver timeout ${GROUP_TIMEOUT:-300} python3 scripts/compile_vs_driver.py --out "$out" \
      > "$out/compile_vs_driver.log" 2>&1 ) &
  run_groups 300 4
  wait
  grep -v -i warn "$out/compile_vs_driver.log" | tail -30
  cp "$out"/check_submission*.json "$out/compile_vs_driver.json" "$keep/" 2>/dev/null
  ;;
serving-graph-steps)
  table=${TABLE:-tables/H200.serving.yaml}
  buckets=$(python3 -c "from mla_tune.serving.table import load_serving_table as l; \
print(','.join(map(str, l('$table').batch_buckets)))")
  mkdir -p "$out/loops"
  for lens in ${LENS:-500,4000}; do
    for fam in ${GRAPH_FAMILIES:-bf16/128/1 fp8/128/1 bf16/16/1 fp8/16/1 bf16/128/2 bf16/128/4 bf16/16/2 bf16/16/4 fp8/128/2 fp8/128/4 fp8/16/2 fp8/16/4}; do
      IFS=/ read -r kv heads qlen <<< "$fam"
      if [ $kv = bf16 ]; then v=${GRAPH_VARIANTS_bf16:-"graph-picks;flashmla(kv=bf16,q=bf16);flashinfer(kernel=fa3,kv=bf16,q=bf16)"}
      else v=${GRAPH_VARIANTS_fp8:-"graph-picks;flashmla(kv=fp8,q=fp8_dynamic)"}; fi
      name=engine_${kv}_h${heads}_q${qlen}_${lens/,/-}
      timed "$name" timeout ${LOOP_TIMEOUT:-200} python3 scripts/engine_loop.py --kv $kv --heads $heads \
        --q-len $qlen --buckets "$buckets" --lens "$lens" --table "$table" --variants "$v" \
        --steps ${LOOP_STEPS:-16} --out "$out/$name" > "$out/$name.log" 2>&1
      grep -E "^bucket|as the graph pick|Error" "$out/$name.log" | cut -c1-140 | tail -45
      cp "$out/$name/engine_loop.json" "$out/loops/$name.json" 2>/dev/null
    done
  done
  tar -czf "$keep/engine_loops.tgz" -C "$out/loops" .
  ;;
gpu-suite)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  timed gpu-suite timeout ${SUITE_TIMEOUT:-400} python3 -m pytest -q -m gpu -n 8 --dist load -p no:cacheprovider \
    > "$out/gpu_tests.log" 2>&1; tail -25 "$out/gpu_tests.log" | grep -v -i warn
  timed update timeout 120 python3 scripts/bench_update.py --device cuda --warm --by-backend \
    --json "$out/update_c.json" 2>&1 | tail -12
  timed update-no-lookup timeout 120 python3 scripts/bench_update.py --device cuda --warm --no-lookup \
    --json "$out/update_no_lookup.json" 2>&1 | tail -6
  ;;
serving-verify)
  # host time first (nothing else running): update on the device's tensors, then run beside the vendors
  timed update timeout 150 python3 scripts/bench_update.py --device cuda --warm --by-backend \
    --json "$out/update_c.json" 2>&1 | tail -10
  timed host timeout 110 python3 scripts/bench_serving_host.py --out "$out" 2>&1 | tail -24
  verify_seeds tables/H200.serving.yaml
  ;;
serving-recheck)
  verify_seeds tables/H200.serving.yaml
  ;;
serving-points)
  retime=()
  [ "${RETIME:-0}" = 1 ] && retime=(--write "$keep/H200.serving.retimed.yaml" ${FAMILIES:+--families "$FAMILIES"})
  timed points timeout $(( ${POINTS_BUDGET:-300} + 120 )) python3 -m mla_tune time points \
    --table "${TABLE:-tables/H200.serving.yaml}" --points ${POINTS:-48} --budget ${POINTS_BUDGET:-300} \
    ${retime[@]+"${retime[@]}"} ${LAYERS:+--layers "$LAYERS"} --json "$out/points.json" > "$out/points.log" 2>&1
  grep -v -i warn "$out/points.log" | tail -8
  gzip -c "$out/points.json" > "$keep/points.json.gz" 2>/dev/null; cp "$out/points.log" "$keep/"
  ;;
serving-table)
  ( CUDA_VISIBLE_DEVICES=1 timeout 400 python3 -m mla_tune verify --table tables/H200.serving.yaml \
      --max-p95 0.05 --max-regret 0.15 --json "$out/verify.json" > "$out/verify.log" 2>&1
    echo "verify: exit $?" >> "$out/walls.txt"
    CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_vendor_serving.py -k flashinfer > "$out/gpu_tests_fi.log" 2>&1
    echo "flashinfer tests: exit $?" >> "$out/walls.txt" ) &
  export CUDA_VISIBLE_DEVICES=0
  timed tests-fast timeout 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_fast_launch.py \
    tests/test_plan.py > "$out/gpu_tests_fast.log" 2>&1; tail -3 "$out/gpu_tests_fast.log"
  timed tests-flashmla timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vendor_serving.py \
    -k "not flashinfer" > "$out/gpu_tests_fm.log" 2>&1; tail -2 "$out/gpu_tests_fm.log"
  engine_loops tables/H200.serving.yaml 120
  timed example timeout 90 python3 scripts/serving_example.py --out "$out" 2>&1 | tail -14
  wait  # GPU 1's verify and FlashInfer tests, before the host times (no CPU contention)
  timed host timeout 150 python3 scripts/bench_serving_host.py --out "$out" 2>&1 | tail -24
  cat "$out"/gpu_tests_fast.log "$out"/gpu_tests_fm.log "$out"/gpu_tests_fi.log > "$out/gpu_tests.log"
  tail -3 "$out/gpu_tests_fi.log"; tail -40 "$out/verify.log"
  ;;
serving-adopt)
  # a serving table readied for adoption: built by this tree from RESULTS (`mla-tune sweep
  # --merge`; TABLE_GZ= takes a built table instead), the split-K reduction's calibration on
  # this GPU, `mla-tune verify` at each of SEEDS, then the engine loop (fp8, bf16) beside
  # FlashMLA; brings back the calibrated table, the calibration's log and the verify reports
  t=/tmp/adopt/H200.serving.yaml
  mkdir -p /tmp/adopt
  if [ -n "${TABLE_GZ:-}" ]; then gunzip -c "$TABLE_GZ" > "$t" || exit 1
  else python3 -m mla_tune sweep --gpu H200 --config configs/serving.yaml --out "$t" \
         --merge "${RESULTS:-docs/data/sweep/h200-2026-12-02-gluon/H200.serving.results.jsonl.gz}" || exit 1
  fi
  timed calibrate timeout 150 python3 -m mla_tune.serving.calibrate --table "$t" > "$out/calibrate.log" 2>&1
  grep -v -i warn "$out/calibrate.log" | tail -16
  cp "$t" "$keep/"; cp "$out/calibrate.log" "$keep/"
  verify_seeds "$t"
  [ "${ENGINE_LOOPS:-1}" = 0 ] || engine_loops "$t" 120
  ;;
*)
  echo "unknown mode $mode (${modes//|/ | })"; exit 2 ;;
esac
cat "$out/walls.txt"
for f in walls.txt compile_vs_driver.log dryrun.txt sweep.log H200.yaml H200.results.jsonl dryrun120.txt sweep120.log \
         H200.b120.yaml H200.b120.results.jsonl gpu_tests.log check_submission.json serving_host.json \
         verify.log verify.json engine_bf16.json engine_fp8.json serving_example.json mix.log \
         verify3.json verify4.json verify3.log verify4.log update_c.json update_numpy.json; do
  [ -f "$out/$f" ] && cp "$out/$f" "$keep/"
done
ls "$keep"
