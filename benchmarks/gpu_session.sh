#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels and this working tree, run the GPU tests, tune,
# benchmark, and record a replay fixture. Every log goes under $OUT (default .out/). Usage, from the
# repo root:
#   bash benchmarks/gpu_session.sh [tests|tune|bench|fixture|overhead|train|grid|ship|fill|decode|decode-ship|kvcache|paged|varlen|varlen-ship|fa4bench|alternatives|ab|ab-tree|sweep|profile|profile-fa4|power|all]...
# `tests` runs `pytest -m gpu` as eleven processes side by side (test files split so each takes about
# as long), to fit one call's time; `overhead` and `train` are benchmarks/overhead.py and
# train_step.py (host cost per call; forward + backward step time), each alone on the GPU; `grid`
# re-times the committed grid configs (benchmarks/results_db.py) with `tuner bench` (GRID_DTYPE=bf16
# for one dtype).
# Narrowing for a short session: PYTEST_K (a pytest -k expression for the tests step),
# TUNE_ARGS (replaces `--gpu auto` for precompile, search and bench; e.g. "--gpu auto --dtype bf16"),
# TRIALS (per problem, default 30).
# `ship` tunes the model table (tuner/models.py; SHIP_MODELS=0: not; or the names of some, "phi-2 sd15"),
# with SHIP_GRID=1 the standard grid, and SHIP_SHAPES (more --shape arguments) on the Hopper family, in SHIP_DTYPE (default bf16), exports the lookup (peers
# included) to $OUT/lookup.json, and benches what the dispatcher serves from it for those shapes
# beside SDPA flash and cuDNN ($OUT/bench-<dtype>.json).
# On an H100 the committed grid results open it as stored bests; SEED_DB (a results database
# carried from an earlier session, e.g. another GPU's) is copied in first, so its winners warm-start
# the studies. SHIP_TIMEOUT bounds the search (seconds). OTHER_LOOKUP (another GPU's lookup, e.g.
# a shipped one) is re-keyed to this GPU and benched the same way ($OUT/cross.json): the cost of
# running that GPU's configs here ($OUT/cross-<dtype>.json). SHIP_PRECOMPILE=0 / SHIP_BENCH=0 leave out its
# precompile and its bench (a short warm-started search); SHIP_MERGE (a folder) merges the search's
# entries into this GPU's shipped lookup there ($OUT/merged.json), which a later call on the same machine
# installs over the shipped one with LOOKUP_OVERLAY=<that folder> (its tests and benches run it).
set -o pipefail
OUT=${OUT:-.out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}   # the carried wheels: our runtime deps (../shared/device/wheelhouse.sh), FA4's too where brought
if [ -d "$WHEELS" ]; then
  # once per machine and set of wheels: installing again on a warm machine (--upgrade) would replace
  # the FA4 compiler library that an earlier call unpacked into the same folder
  stamp=/tmp/site/.wheels-$(ls "$WHEELS" | md5sum | cut -c1-12)
  if [ ! -f "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl 2>/dev/null \
      && rm -f /tmp/site/.fa4-cu13 && touch "$stamp" || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# flashtune itself, from this working tree (no network there: no build isolation, no deps)
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-ft . 2>&1 | grep -v WARN
# LOOKUP_OVERLAY: a folder of lookups named as the shipped ones (an earlier call's SHIP_MERGE, say) that replace
# them in this install, so the tests and benches of this call run the lookup about to be committed
if [ -n "$LOOKUP_OVERLAY" ]; then cp "$LOOKUP_OVERLAY"/*.json /tmp/site-ft/tuner/lookups/ \
  && (cd "$LOOKUP_OVERLAY" && md5sum *.json) | sed 's/^/overlaid lookup: /' | tee -a "$OUT/gpu.log"; fi
export PYTHONPATH=/tmp/site-ft:$PYTHONPATH
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export TUNER_CACHE_DIR=${TUNER_CACHE_DIR:-/tmp/flashtune-cubin}
export TUNER_DB=${TUNER_DB:-sqlite:////tmp/flashtune/results.db} TUNER_LOOKUP=${TUNER_LOOKUP:-/tmp/flashtune/best.json}
mkdir -p /tmp/flashtune
# FlashAttention-4 as a peer, where ../shared/device/fa4-wheels.sh's two halves came (an earlier call
# copied .fa4a/part-aa to /tmp/fa4.part-aa; this one carries .fa4b and the FA4 wheels in .whl)
if [ -f /tmp/fa4.part-aa ] && [ -f .fa4b/part-ab ] && [ ! -f /tmp/site/.fa4-cu13 ]; then
  cat /tmp/fa4.part-aa .fa4b/part-ab | xz -T0 -dc | tar -x -C /tmp/site && touch /tmp/site/.fa4-cu13 \
    && echo "FlashAttention-4's compiler library unpacked" | tee -a "$OUT/gpu.log"
fi
[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
if [ -n "$SEED_DB" ] && [ ! -e /tmp/flashtune/results.db ]; then cp "$SEED_DB" /tmp/flashtune/results.db; fi
tuner() { python3 -m tuner.cli "$@"; }
merge_into() {   # $1: a folder; $2: the step's log. This GPU's shipped lookup with this machine's searches merged in,
  # kept in $1 for a later call's LOOKUP_OVERLAY and brought back as $OUT/merged.json
  local key merged; key=$(python3 -c 'from tuner.gpu import detect; print(detect().key)')
  merged=$1/${key//\//_}.json   # named as the shipped file it starts from (the installed one)
  mkdir -p "$1"; [ -f "$merged" ] || cp "/tmp/site-ft/tuner/lookups/${merged##*/}" "$merged"
  tuner export -o "$merged" --merge --gpu-key "$key" 2>&1 | tee -a "$OUT/$2.log"
  cp "$merged" "$OUT/merged.json"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee -a "$OUT/gpu.log"
python3 -c "import torch, cuda.core; print('torch', torch.__version__, 'cuda.core', cuda.core.__version__)" | tee -a "$OUT/gpu.log"
steps=${*:-all}
for step in $steps; do
  case $step in
    tests|all) fam=tests/test_gpu_kernel.py::test_family_matches_reference
               anyd=tests/test_gpu_kernel.py::test_any_head_dim_matches_reference
               vs=tests/test_gpu_varlen.py::test_search_tunes_a_varlen_variant_on_its_length_mix
               # eleven side by side on the H200, 2026-12-01 (x14), seconds: 240, 40, 181, 79, 97, 227, 224, 159, 182,
               # 93, 229 (the varlen search alone: with the rest of its group it ran past 300 s in x13)
               groups=("tests/test_gpu_op.py tests/test_tma.py tests/test_gpu_varlen.py --deselect $vs" "$vs"
                       "$fam -k sm90" "$fam -k mma" "$fam -k simt"
                       "tests/test_gpu_kernel.py --deselect $fam --deselect $anyd" "$anyd"
                       "tests/test_gpu_end_to_end.py tests/test_gpu_reliability.py tests/test_gpu_timing.py"
                       "tests/test_gpu_decode.py tests/test_dashboard.py" "tests/test_gpu_shipped.py tests/test_gpu_tail.py"
                       "tests/test_gpu_split_kv.py tests/test_gpu_pairs.py tests/test_gpu_packed_gqa.py")
               i=0; for g in "${groups[@]}"; do i=$((i + 1))
                 FLASHTUNE_E2E_TRIALS=${E2E_TRIALS:-12} timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -m gpu -q -rA \
                   ${PYTEST_K:+-k "$PYTEST_K"} $g > "$OUT/pytest_gpu_$i.log" 2>&1 &
               done; wait
               # one file: a call brings back at most 8 files of $OUT, and eleven groups plus gpu.log are twelve
               for f in "$OUT"/pytest_gpu_*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done > "$OUT/pytest_gpu.log"
               for f in "$OUT"/pytest_gpu_*.log; do echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
               grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest_gpu_*.log; rm -f "$OUT"/pytest_gpu_*.log ;;&
    grid) results=benchmarks/results/NVIDIA-H100-80GB-HBM3_sm_90-fp16-bf16.json
          python3 benchmarks/results_db.py $results sqlite:////tmp/flashtune/grid.db
          for dt in ${GRID_DTYPE:-fp16 bf16}; do
            tuner bench --db sqlite:////tmp/flashtune/grid.db --dtype $dt --peer sdpa_flash --peer sdpa_cudnn \
              $(python3 benchmarks/results_db.py $results --shapes --dtype $dt) --json "$OUT/grid-$dt.json" 2>&1 \
              | grep -v -E "UserWarning|scaled_dot_product_attention" | tee "$OUT/grid-$dt.log"
          done
          cp /tmp/flashtune/grid.db "$OUT/grid.db" ;;&
    ship) dt=${SHIP_DTYPE:-bf16}
          models=$(python3 -c "import sys; from tuner.models import MODELS; w = sys.argv[1]
names = MODELS if w == '1' else [] if w == '0' else w.split(); print(' '.join('--model ' + m for m in names))" "${SHIP_MODELS:-1}")
          grid=benchmarks/results/NVIDIA-H100-80GB-HBM3_sm_90-fp16-bf16.json
          gridshapes=$(python3 benchmarks/results_db.py $grid --shapes --dtype $dt)
          if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "H100 80GB HBM3"; then
            python3 benchmarks/results_db.py $grid "$TUNER_DB" | tee -a "$OUT/ship.log"
          fi
          [ "${SHIP_PRECOMPILE:-1}" = 1 ] && tuner precompile --family flash_fwd_sm90 --dtype $dt --shape 1,16:8,2048,128,causal --shape 1,16:8,2048,256,causal \
            --shape 1,16,2048,64,causal --shape 1,16,2048,64 ${SHIP_GRID:+--shape 1,16,2048,128} 2>&1 | tail -1 | tee -a "$OUT/ship.log"
          tuner search --gpu auto --family flash_fwd_sm90 $models ${SHIP_GRID:+$gridshapes} ${SHIP_SHAPES:-} --dtype $dt --trials "${TRIALS:-16}" \
            --timeout "${SHIP_TIMEOUT:-330}" --lookup /tmp/flashtune/ship.json 2>&1 | grep -v -E "UserWarning|warnings.warn" \
            | tail -40 | tee -a "$OUT/ship.log"
          key=$(python3 -c 'from tuner.gpu import detect; print(detect().key)')
          tuner export -o "$OUT/lookup.json" --force --gpu-key "$key" 2>&1 | tee -a "$OUT/ship.log"
          [ -n "$SHIP_MERGE" ] && merge_into "$SHIP_MERGE" ship
          [ "${SHIP_BENCH:-1}" = 1 ] && FLASHTUNE_SHIPPED_LOOKUPS=0 tuner bench --gpu auto $models ${SHIP_GRID:+$gridshapes} ${SHIP_SHAPES:-} --dtype $dt --lookup "$OUT/lookup.json" \
            --peer sdpa_flash --peer sdpa_cudnn --json "$OUT/bench-$dt.json" 2>&1 | grep -v -E "UserWarning|warnings.warn" \
            | tee -a "$OUT/ship.log"
          if [ -n "$OTHER_LOOKUP" ]; then   # another GPU's configs on this one: what per-GPU tuning buys
            python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [e.update(gpu_key=sys.argv[2]) for e in d['entries']]; json.dump(d, open('/tmp/flashtune/other.json', 'w'))" "$OTHER_LOOKUP" "$key"
            FLASHTUNE_SHIPPED_LOOKUPS=0 tuner bench --gpu auto $models ${SHIP_GRID:+$gridshapes} --dtype $dt \
              --lookup /tmp/flashtune/other.json --peer sdpa_cudnn --json "$OUT/cross-$dt.json" 2>&1 \
              | grep -v -E "UserWarning|warnings.warn" | tail -45 | tee -a "$OUT/ship.log"
          fi
          gzip -c /tmp/flashtune/results.db > "$OUT/ship.db.gz" ;;&
    fill) # the buckets FILL_FROM (another GPU's shipped lookup, default the H100's) has tuned and this GPU's shipped
          # lookup lacks (benchmarks/missing_buckets.py: chunked prefill, split, decode), each searched here by its
          # family, warm-started from both GPUs' configs, in FILL_DTYPES (default "bf16 fp16"), TRIALS (default 4)
          # a problem, FILL_TIMEOUT (seconds, default 420) for all; FILL_MORE adds lines of the same form, searched
          # first ("<family> --dtype D [--trials N] --shape ...", ';' between them); merged as SHIP_MERGE (default
          # /tmp/flashtune/merged)
          mine=/tmp/site-ft/tuner/lookups/$(python3 -c 'from tuner.gpu import detect; print(detect().key.replace("/", "_"))').json
          lines=$(python3 benchmarks/missing_buckets.py --from "${FILL_FROM:-tuner/lookups/NVIDIA-H100-80GB-HBM3_sm_90.json}" --to "$mine")
          lines=$(printf '%s\n%s\n' "$(echo "$FILL_MORE" | tr ';' '\n')" "$lines" | grep -v '^ *$')
          end=$(( $(date +%s) + ${FILL_TIMEOUT:-420} ))
          for dt in ${FILL_DTYPES:-bf16 fp16}; do
            echo "$lines" | grep -- "--dtype $dt " | while read -r fam args; do
              left=$(( end - $(date +%s) )); [ $left -gt 5 ] || { echo "fill: out of time before $fam $args" | tee -a "$OUT/fill.log"; continue; }
              tuner search --gpu auto --family $fam --trials "${TRIALS:-4}" $args --timeout $left --lookup /tmp/flashtune/fill.json 2>&1 < /dev/null \
                | grep -v -E "UserWarning|warnings.warn" | grep -E "^(│|┃|tuning|--timeout)" | tee -a "$OUT/fill.log"
            done
          done
          merge_into "${SHIP_MERGE:-/tmp/flashtune/merged}" fill ;;&
    decode) # the issue-23 figures: decode against a KV cache beside SDPA cuDNN, SDPA flash and FA4, as TB/s;
            # then a chunked prefill (512 queries after 3584 cached keys), searched and benched beside them.
            # DECODE_ARGS adds decode_bench.py's options, e.g. "--page 16,64,256" (the cache as pages too)
            python3 benchmarks/decode_bench.py ${DECODE_ARGS:-} --json "$OUT/decode.json" 2>&1 | grep -v Warning | tee "$OUT/decode.log"
            chunk="--shape ${CHUNK_SHAPE:-8,32:8,512:4096,128,causal_br} --dtype bf16"
            tuner search --gpu auto $chunk --family flash_fwd_sm90 --trials ${TRIALS:-40} --timeout ${CHUNK_TIMEOUT:-150} \
              > "$OUT/chunk-search.log" 2>&1; tail -n 6 "$OUT/chunk-search.log"
            peers="--peer sdpa_cudnn --peer sdpa_flash"; [ -f /tmp/site/.fa4-cu13 ] && peers="$peers --peer fa4"
            tuner bench --gpu auto $chunk --family flash_fwd_sm90 $peers --json "$OUT/chunked.json" 2>&1 | grep -v Warning | tail -n 8 ;;
    decode-ship) # decode buckets of DECODE_MODELS (tuner/models.py names), one query against DECODE_SEQLENS keys at
                 # B1 and B32, searched on flash_decode with SDPA beside (merge them into the shipped lookup:
                 # `tuner export --db ... --merge`, from $OUT/results.db); then decode_bench at each model's heads
                 # and head dim, served from those entries ($OUT/decode-<model>.json); DECODE_TIMEOUT bounds each search
          for m in ${DECODE_MODELS:-phi-2 phi3-mini gpt2}; do
            tuner search --gpu auto --family flash_decode --model $m --seqlen "${DECODE_SEQLENS:-1:1024,1:8192}" --batch 1,32 \
              --dtype bf16 --trials "${TRIALS:-14}" --timeout "${DECODE_TIMEOUT:-60}" 2>&1 | grep -v -E "UserWarning|warnings.warn" \
              | grep -E "^(│|┃)" | tee -a "$OUT/decode-ship.log"
          done
          for m in ${DECODE_MODELS:-phi-2 phi3-mini gpt2}; do
            shape=$(python3 -c "import sys; from tuner.models import MODELS; a = MODELS[sys.argv[1]].layers[0]; print(f'--heads {a.heads}:{a.kv_heads} --head-dim {a.head_dim}')" $m)
            python3 benchmarks/decode_bench.py $shape --batch 1,8,32 --keys "${DECODE_KEYS:-1024,8192}" --json "$OUT/decode-$m.json" 2>&1 \
              | grep -v Warning | tee -a "$OUT/decode-ship.log"
          done ;;&
    ab) # a kernel change, before and after: the committed grid configs and the shipped lookup's, each
        # compiled from AB_TEMPLATES (the sources before; e.g. `git archive <commit> kernel_templates |
        # tar -x -C .ab`, carried) and from this tree, timed in turns (benchmarks/ab_kernel.py)
        python3 benchmarks/ab_kernel.py --templates "${AB_TEMPLATES:-.ab/kernel_templates}" ${AB_ARGS:---lookup} \
          --json "$OUT/ab.json" 2>&1 | grep -v Warning | tee "$OUT/ab.log" ;;&
    kvcache) # kvcache_attention on dense caches of ragged lengths: now (the Hopper kernel attention serves, on the
             # held keys) against before (flash_decode, or a sequence at a time), FA4 and SDPA masked beside;
             # KVCACHE_CASES (B,H:KVH,NQ:CAP,D ...) for other calls than benchmarks/kvcache_steps.py's;
             # KVCACHE_ARGS its options (e.g. "--page 16 --tail zero": the same keys in pages)
          python3 benchmarks/kvcache_steps.py $KVCACHE_ARGS $KVCACHE_CASES --json "$OUT/kvcache_steps.json" 2>&1 | grep -v -i warn \
            | tee "$OUT/kvcache_steps.log" ;;&
    paged) # a paged cache's K/V tiles by TMA boxes against the producer's cp.async (GATHER_KV), dense beside,
           # on pages of each PAGED_ROWS (default "16 8"); PAGED_CASES for other calls than the script's
          for rows in ${PAGED_ROWS:-16 8}; do
            python3 benchmarks/paged_copies_ab.py --page "$rows" $PAGED_CASES --json "$OUT/paged_copies_$rows.json" 2>&1 \
              | grep -v -i warn | tee -a "$OUT/paged_copies.log"
          done ;;&
    varlen) # issue 23's varlen figure: packed sequences against the same padded, beside FA2's and FA4's varlen
            python3 benchmarks/varlen_bench.py --json "$OUT/varlen.json" 2>&1 | grep -v Warning | tee "$OUT/varlen.log" ;;&
    varlen-ship) # issue 23: the varlen variants tuned on the padded problems of varlen_bench's batches (each
                 # trial on its problem's representative length mix), the lookup of those entries in
                 # $OUT/lookup-varlen.json (merge it into the shipped one: `tuner export --merge`), then
                 # varlen_bench served from it; VARLEN_TIMEOUT bounds each of the two searches (seconds)
          for kind in prefill:flash_fwd_sm90_varlen decode:flash_decode_varlen; do
            tuner search --gpu auto --family ${kind#*:} $(python3 benchmarks/varlen_bench.py --shapes ${kind%%:*}) \
              --dtype bf16 --trials "${TRIALS:-16}" --timeout "${VARLEN_TIMEOUT:-300}" --lookup /tmp/flashtune/varlen.json 2>&1 \
              | grep -v -E "UserWarning|warnings.warn" | tail -12 | tee -a "$OUT/varlen-ship.log"
          done
          cp /tmp/flashtune/varlen.json "$OUT/lookup-varlen.json"
          TUNER_LOOKUP=/tmp/flashtune/varlen.json python3 benchmarks/varlen_bench.py --json "$OUT/varlen.json" 2>&1 \
            | grep -v Warning | tee "$OUT/varlen.log" ;;&
    fa4bench) # the issue-22 figure: the standard grid (d=64/128/256) and the model shapes, served from the
              # shipped lookup of this GPU (FA4_LOOKUP: another), against SDPA flash, SDPA cuDNN and
              # FlashAttention-4 in the same run; FA4_WHAT narrows it ("bf16 fp16 models"); FA4_SHAPES (--shape
              # arguments, in FA4_DTYPE, default bf16) benches just those, as "shapes" ($OUT/fa4-shapes-<dtype>.json);
              # FA4_RANDOM=SEED[:COUNT] benches random_shapes.py's draws so
          lookup=${FA4_LOOKUP:-tuner/lookups/$(python3 -c 'from tuner.gpu import detect; print(detect().key.replace("/", "_"))').json}
          shapes() {   # the standard grid of dtype $1, as --shape arguments
            python3 -c "import sys; from tuner.problem import standard_grid as g; print(' '.join(f'--shape {p.batch},{p.heads},{p.seqlen_q},{p.head_dim}' + (',causal' if p.causal else '') for p in g(sys.argv[1])))" "$1"; }
          models=$(python3 -c "from tuner.models import MODELS; print(' '.join('--model ' + m for m in MODELS))")
          # FA4_RANDOM=SEED[:COUNT]: benchmarks/random_shapes.py's draws (model shapes nobody tuned) as FA4_SHAPES
          if [ -n "$FA4_RANDOM" ]; then
            IFS=: read -r seed count <<< "$FA4_RANDOM"
            FA4_SHAPES=$(python3 benchmarks/random_shapes.py --seed "$seed" --count "${count:-32}") \
              && echo "FA4_RANDOM=$FA4_RANDOM: $FA4_SHAPES" >> "$OUT/fa4.log"
          fi
          whats=("bf16:$(shapes bf16)" "fp16:$(shapes fp16)" "models:$models"); [ -n "$FA4_SHAPES" ] && whats=("shapes:$FA4_SHAPES")
          for what in "${whats[@]}"; do
            name=${what%%:*}; args=${what#*:}
            dt=$(case $name in fp16) echo fp16 ;; shapes) echo "${FA4_DTYPE:-bf16}" ;; *) echo bf16 ;; esac)
            [ "$name" = shapes ] || case " ${FA4_WHAT:-bf16 fp16 models} " in *" $name "*) ;; *) continue ;; esac
            timeout ${FA4_BENCH_TIMEOUT:-280} python3 -m tuner.cli bench --gpu auto --dtype $dt $args --lookup "$lookup" \
              --peer sdpa_flash --peer sdpa_cudnn --peer fa4 --json "$OUT/fa4-$name$([ "$name" = shapes ] && echo "-$dt").json" 2>&1 \
              | grep -v -E "UserWarning|warnings.warn" | grep -E "^(│|┃|--peer)" | tee -a "$OUT/fa4.log"
          done ;;&
    alternatives) # what attention serves beside the kernels it could serve instead, FA4 in the same turns (where
          # brought): ALT_ARGS, benchmarks/served_alternatives.py's arguments (default: --random 1:24)
          timeout ${ALT_TIMEOUT:-500} python3 benchmarks/served_alternatives.py ${ALT_ARGS:---random 1:24} \
            --json "$OUT/alternatives.json" 2>&1 | grep -v -i warn | tee -a "$OUT/alternatives.log" ;;&
    ab-tree) # another checkout against this one, each as `attention` serves it: AB_TREE (that checkout's tree,
          # e.g. `git archive main | tar -x -C .abt`, carried) installed beside this one, served_alternatives.py
          # --near 0 on AB_SHAPES under each in a process of its own (the other's first), then
          # benchmarks/served_ab.py: our times compared directly, each against its own run's best peer.
          # For a change whose Python side moves too (a tile's width, a default's rule; PERF_NOTES "z2").
          tree=${AB_TREE:-.abt}
          python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-ab "$tree" 2>&1 | grep -v WARN
          PYTHONPATH=${PYTHONPATH//\/tmp\/site-ft/\/tmp\/site-ab} timeout ${AB_TIMEOUT:-250} python3 "$tree/benchmarks/served_alternatives.py" \
            --near 0 $AB_SHAPES --json "$OUT/ab-before.json" 2>&1 | grep -v -i warn > "$OUT/ab-before.log"
          timeout ${AB_TIMEOUT:-250} python3 benchmarks/served_alternatives.py --near 0 $AB_SHAPES --json "$OUT/ab-after.json" 2>&1 \
            | grep -v -i warn > "$OUT/ab-after.log"
          python3 benchmarks/served_ab.py "$OUT/ab-before.json" "$OUT/ab-after.json" --json "$OUT/ab-tree.json" | tee "$OUT/ab-tree.log" ;;&
    sweep) # every valid flash_fwd_sm90 point of SWEEP_SHAPES (bf16), one database: replay fixtures for sampler
          # studies. SWEEP_DB (a sweep.db.gz an earlier call brought back, carried) is continued: a grid
          # search resumes where it stopped. The database goes to $OUT every 45 s (a consistent copy, sqlite3's
          # backup) and after each shape, so a call cut short at the device limit keeps what it measured.
          db=/tmp/flashtune/sweep.db
          if [ -n "$SWEEP_DB" ]; then gunzip -c "$SWEEP_DB" > $db; else rm -f $db; fi
          save_sweep() {   # $1 names the writer (the loop, or the end of a shape): each has its own temporaries
            python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
              $db /tmp/flashtune/sweep.$1 && gzip -c /tmp/flashtune/sweep.$1 > "$OUT/.sweep.$1" \
              && mv "$OUT/.sweep.$1" "$OUT/sweep.db.gz"; }
          ( while sleep 45; do [ -f $db ] && save_sweep loop; done ) & saver=$!
          for sh in ${SWEEP_SHAPES:-1,16,16384,128,causal 4,8,4096,256,causal}; do
            tuner precompile --family flash_fwd_sm90 --dtype bf16 --shape $sh 2>&1 | tail -1
            # --timeout stops asking for points (graceful: every measured point is stored)
            TUNER_DB=sqlite:///$db python3 -m tuner.cli search --gpu auto \
              --family flash_fwd_sm90 --dtype bf16 --shape $sh --sampler grid --trials 5000 --no-peers \
              --timeout ${SWEEP_TIMEOUT:-240} --lookup /tmp/flashtune/sweep.json 2>&1 | grep -E "^│" | tee -a "$OUT/sweep.log"
            save_sweep shape
          done
          kill $saver 2>/dev/null; wait $saver 2>/dev/null
          save_sweep last ;;&   # after the loop's last copy: the newest database has the last word
    profile) # Nsight Compute's view of flash_fwd_sm90 configs: the committed grid config of each problem whose key
             # contains a word of PROFILE_SHAPE (ab_kernel.py, both sides this tree's kernel), its PROFILE_SKIP-th launch
             # (the first ones are its float64 check): speed of light, issue, warp stall reasons (every metric the
             # sections collect: --page raw), instruction mix; $OUT/profile-<shape>.csv. PROFILE_FAMILY profiles
             # another family's shipped entries instead (flash_decode, say, with PROFILE_SHAPE B32-H32/kv8-N1x8192)
          fam=${PROFILE_FAMILY:-flash_fwd_sm90}
          kname=$(python3 -c "import sys; from tuner.kernel_templates import get_family; print(get_family(sys.argv[1]).kernel_name)" "$fam")
          for shape in ${PROFILE_SHAPE:-B1-H32-N16384-D64-bf16-full}; do
            name=$(echo "$shape" | tr '/' '_')
            ncu --target-processes all --kernel-name "regex:$kname" --launch-skip ${PROFILE_SKIP:-3} --launch-count 1 \
              --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
              --section MemoryWorkloadAnalysis --section InstructionStats --page raw --csv \
              python3 benchmarks/ab_kernel.py --templates kernel_templates --family "$fam" --shape "$shape" --rounds 1 --seconds 0.05 \
              > "$OUT/profile-$name.csv" 2> "$OUT/profile-$name.log"; tail -n 3 "$OUT/profile-$name.log"
          done ;;&
    profile-fa4) # the same sections on our served kernel and FlashAttention-4's (benchmarks/profile_vs_fa4.py) for
                 # each of PROFILE_FA4_SHAPES (--shape arguments); FA4 by the two-call carry; $OUT/profile-fa4.csv.
                 # PROFILE_PEER: another peer instead (sdpa_cudnn, say: no carry needed)
          ncu --target-processes all --nvtx --nvtx-include "prof/" \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
            --section InstructionStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --page raw --csv \
            python3 benchmarks/profile_vs_fa4.py --peer ${PROFILE_PEER:-fa4} ${PROFILE_FA4_SHAPES:---shape 1,32,8192,80,causal} \
            > "$OUT/profile-fa4.csv" 2> "$OUT/profile-fa4.log"; grep -v -i warn "$OUT/profile-fa4.log" | tail -n 4 ;;&
    power) # the SM clock and board power while ours, cuDNN and FA4 (where brought) run back to back
           # (benchmarks/power_state.py): how far the power cap sets each one's clock; POWER_SHAPES (--shape arguments)
          python3 benchmarks/power_state.py ${POWER_SHAPES:---shape 1,16,16384,128} --json "$OUT/power.json" 2>&1 \
            | grep -v -i warn | tee "$OUT/power.log" ;;&
    overhead|all) python3 benchmarks/overhead.py --json "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.log" ;;&
    train|all) python3 benchmarks/train_step.py --json "$OUT/train_step.json" 2>&1 | tee "$OUT/train_step.log" ;;&
    tune|all) tuner precompile ${TUNE_ARGS:---gpu auto} 2>&1 | tail -2 | tee "$OUT/tune.log"
              tuner search ${TUNE_ARGS:---gpu auto} --trials "${TRIALS:-30}" 2>&1 | tee -a "$OUT/tune.log" ;;&
    bench|all) tuner bench ${TUNE_ARGS:---gpu auto} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;&
    fixture|all) rm -f /tmp/flashtune/fixture.db
                 tuner precompile --gpu auto --shape 2,4,512,64,causal 2>&1 | tail -1
                 TUNER_DB=sqlite:////tmp/flashtune/fixture.db tuner search --gpu auto --shape 2,4,512,64,causal \
                   --sampler grid --trials 400 --no-peers --lookup /tmp/flashtune/fixture_best.json 2>&1 | tail -25 | tee "$OUT/fixture.log"
                 TUNER_DB=sqlite:////tmp/flashtune/fixture.db tuner search --gpu auto --shape 2,4,512,64,causal --trials 1 \
                   --lookup /tmp/flashtune/fixture_best.json 2>&1 | tail -8 | tee -a "$OUT/fixture.log"
                 cp /tmp/flashtune/fixture.db "$OUT/h100_simt.db" ;;
  esac
done
case " $steps " in *" ship "*) ;; *) cp /tmp/flashtune/results.db "$OUT/results.db" 2>/dev/null || true ;; esac
