#!/usr/bin/env bash
# The H200 runs behind bench/results/*_gpu_*.json, as one script for the device tool:
#   mkdir -p gpu_wheels && cp ../shared/wheels/*.whl gpu_wheels/     (git-ignored; carry: ["gpu_wheels"])
#   bash bench/h200.sh [tests-engine|tests-verify|tests-kernels|tests-gdn|tests-rest|kernels|decode|decode-long|decode-1step|decode-fla|decode-sync|prefill|
#                       prefill-pallas|spec|spec-sync|spec-shipped|pd|startup|probes|gdn-probes|mosaic|sampling-probes|
#                       sampling-backends|scan-probes|mlp-probe|decode-kernels|fold-ab|decode-forms|mixer-probe|attention-probe|pool-probe|spec-pool-ab|graph-launch|prefill-attention-probe|
#                       residual-probe|libgemm-ab|swiglu-probe|swiglu-ab|swiglu-small|skinny-probe|pool-gates|pdl-probe ...]
#   (default: all but the thirty extras, in this order; decode-long times decode at 2048-token rows; sampling-probes and sampling-backends the sampled-MTP
#   pad-token hunt (bug fixed), spec-sync times MTP with synchronous scheduling,
#   decode-fla times transformers + fla alone (one call), probes the cold-weight product probe
#   (bench/probes/cold_products.py), gdn-probes the chunked GDN kernel forms, mosaic the Mosaic GPU backend
#   probe, decode-1step times one decode step per launch, decode-sync the synchronous engine beside the
#   default async scheduling, prefill-pallas the opt-in paged flash-attention kernel, spec-shipped only the
#   shipped model's spec rows, scan-probes the chunked GDN scan settings and forms beside fla (limit $SCAN_PROBE_LIMIT s, default 330), mlp-probe the MLP's forms
#   at 8192 tokens, decode-kernels a decode step's kernels named by their source, fold-ab the folded RMSNorm weights
#   against the unfolded norms, decode-forms forms of the decode step's code, mixer-probe the GDN mixer kernel alone, attention-probe the decode attention kernel alone, pool-probe the GDN pool kernel's program shapes, spec-pool-ab the 0.8B K=3 verify step with the pool kernel before and after r26; residual-probe and libgemm-ab r33's residual-add folding and library-GEMM A/B, swiglu-probe and swiglu-ab r34's fused SiLU * up kernel alone and in the engine's prefill (kernel off, then on); swiglu-small r39's decode-sized form of it (test, alone, decode off/on), skinny-probe r39's Mosaic GPU decode-shaped products; pool-gates r41's gates inside the pool kernel (tests, decode off/on/off); pdl-probe r42's weight loads ahead of the PDL wait; `python -m jaxgdn.bench table
#   FILE` prints any of them)
# Results go to $OUT (the device tool brings them back) or bench/results when $OUT is unset.
# Each step has its own time limit so one slow step cannot take the others' results with it. A device call
# allows 600 s: pass one to three steps per call (e.g. "tests-engine", "tests-kernels", "decode", "prefill", "spec").
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site gpu_wheels/*.whl
export PYTHONPATH=/tmp/site:.:tests HOME=/tmp TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAXGDN_CACHE_DIR=${JAXGDN_CACHE_DIR:-/tmp/jaxgdn-cache}
dest=${OUT:-bench/results}
stamp=$(date -u +%Y%m%d)
steps=${*:-tests-engine tests-verify tests-kernels tests-gdn tests-rest kernels decode prefill spec pd startup}
rest_tests="(sampled_mtp or conv or kv_write or prompt_qkv or gates_from or library_gemms or swiglu)"
# switch_ab NAME SWITCH RUNS BATCHES: the pool kernel's compiled tests, then `bench decode` at BATCHES with the env
# switch set to each of RUNS in turn, one process each (r41; r42's norm-sums A/B, since removed, ran it too)
switch_ab() {
  timeout 200 python3 -m pytest -v -p no:warnings -m gpu tests/test_gpu.py -k "gdn_pool_kernel_compiled" \
    > "$dest/gpu-tests-$1_$stamp.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$dest/gpu-tests-$1_$stamp.txt"
  local n=0 v
  for v in $3; do
    n=$((n + 1))
    env "$2=$v" timeout 150 python3 -m jaxgdn.bench decode --no-peer --batch $4 \
      --out "$dest/decode-$1-$v-$n""_gpu_$stamp.json" 2>&1 | grep -v Warning
  done
}
for step in $steps; do
  case $step in
    # The GPU suite in two halves, one device call each (r11: the engine tests and the first two kernel tests
    # took the whole 420 s the suite once had; the 16 kernel tests took ~270 s); -v so a cut run still
    # names what passed. The two-device test runs apart (skipped on one GPU) with a stack dump if it stalls.
    # The 4-verify-steps test (r13) has its own step, tests-verify: in the engine half it was cut while
    # compiling (2026-12-02); alone it took 67 s on a warm machine with the compilation cache filled.
    tests-engine) timeout 560 python3 -m pytest -v -p no:warnings -m gpu tests/test_gpu.py -k "pd_ or decode_launches" \
               -o faulthandler_timeout=150 > "$dest/gpu-tests-engine_$stamp.txt" 2>&1
             grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$dest/gpu-tests-engine_$stamp.txt" ;;
    tests-verify) timeout 560 python3 -m pytest -v -p no:warnings -m gpu tests/test_gpu.py -k "verify_launches" \
               -o faulthandler_timeout=300 > "$dest/gpu-tests-verify_$stamp.txt" 2>&1
             grep -E "PASSED|FAILED|ERROR|passed|failed" "$dest/gpu-tests-verify_$stamp.txt" ;;
    # tests-kernels allows 560 s since r18: the GDN kernel test compiles both scan depths and a bf16 run
    # (its two large shapes took 100 and 57 s). r27: with the pool kernel's tests the half ran past 560 s at
    # the prompt conv test, so the sampled-MTP engine test and the conv and KV-write kernels are tests-rest
    # (with the prefill q/k/v kernel, the in-place gates and, since r33, the library-GEMM prompt program).
    # r37: the GDN kernel test alone took 411 s (three shapes: 206, 131, 75 s; both chunked forms, both scan
    # depths, fp32 and bf16), so it is the step tests-gdn, one pytest per shape (a cut run keeps the others')
    tests-kernels) timeout 560 python3 -m pytest -v -p no:warnings -m gpu tests/test_gpu.py \
               -k "not pd_ and not four_steps and not compiled_equal_reference and not $rest_tests" \
               > "$dest/gpu-tests-kernels_$stamp.txt" 2>&1
             grep -E "PASSED|FAILED|ERROR|passed|failed" "$dest/gpu-tests-kernels_$stamp.txt" ;;
    tests-gdn) for s in shape0 shape1 shape2; do
               timeout 280 python3 -m pytest -v -p no:warnings -m gpu tests/test_gpu.py -k "compiled_equal_reference and $s" \
                 > "$dest/gpu-tests-gdn-$s""_$stamp.txt" 2>&1
               grep -E "PASSED|FAILED|ERROR|passed|failed" "$dest/gpu-tests-gdn-$s""_$stamp.txt"
             done ;;
    tests-rest) timeout 560 python3 -m pytest -v -p no:warnings -m gpu tests/test_gpu.py \
               -k "$rest_tests" > "$dest/gpu-tests-rest_$stamp.txt" 2>&1
             grep -E "PASSED|FAILED|ERROR|passed|failed" "$dest/gpu-tests-rest_$stamp.txt" ;;
    kernels) timeout 240 python3 -m jaxgdn.bench kernels --out "$dest/kernels_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # 560 s since r25: with transformers + fla and the profile, a cold machine ran 300 s out at batch 64
    decode)  timeout 560 python3 -m jaxgdn.bench decode --profile /tmp/jaxgdn-profile --out "$dest/decode_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # r25: decode at long rows (LONG_PROMPT tokens, default 2048), the one-kernel forms on (the split decode
    # attention) and off (the XLA chains), one process each; first run at r27 (decode-long-{on,off}-r27)
    decode-long) for f in on off; do
               timeout 280 python3 -m jaxgdn.bench decode --no-peer --prompt-len ${LONG_PROMPT:-2048} --batch 1 8 64 \
                 --fused-decode-kernels $f --out "$dest/decode-long-$f""_gpu_$stamp.json" 2>&1 | grep -v Warning
             done ;;
    # one decode step per launch (the default runs 4 on a GPU), beside the default in the same session
    decode-1step) timeout 200 python3 -m jaxgdn.bench decode --decode-steps-per-launch 1 --no-peer --batch 1 8 32 64 \
               --out "$dest/decode-1step_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # batches 1 and 32 against transformers + fla (carried wheels) alone in a call: fla's first Triton
    # compiles take minutes, which ran the 300 s "decode" step out of time (decode-fla-peer, incomplete)
    decode-fla) timeout 560 python3 -m jaxgdn.bench decode --batch 1 32 --peer-batch 1 32 \
               --out "$dest/decode-fla_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    decode-sync) timeout 300 python3 -m jaxgdn.bench decode --async-scheduling off --no-peer --profile /tmp/jaxgdn-profile-sync \
               --out "$dest/decode-sync_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    prefill-pallas) timeout 240 python3 -m jaxgdn.bench prefill --attention-impl pallas --no-peer --stream-steps 0 \
               --out "$dest/prefill-pallas_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # 400 s since r29: each shape also runs a stream of 8 steps (--stream-steps) on an engine of its own
    prefill) timeout 400 python3 -m jaxgdn.bench prefill --profile /tmp/jaxgdn-profile-prefill --out "$dest/prefill_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # spec alone in a call: with 4 verify steps per launch its 0.8B programs compile for minutes (r14 ran
    # past 340 s); spec-sync times MTP with synchronous scheduling (the default is async) the same way
    spec)    timeout 560 python3 -m jaxgdn.bench spec --out "$dest/spec_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    spec-sync) timeout 560 python3 -m jaxgdn.bench spec --async-scheduling off --out "$dest/spec-sync_gpu_$stamp.json" \
               2>&1 | grep -v Warning ;;
    # the shipped model's rows only (no 0.8B modeled rows): about half the time of "spec"
    spec-shipped) timeout 200 python3 -m jaxgdn.bench spec --model "" --out "$dest/spec-shipped_gpu_$stamp.json" \
               2>&1 | grep -v Warning ;;
    pd)      timeout 200 python3 -m jaxgdn.bench pd --out "$dest/pd_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # r26: the GDN pool kernel (engine rows of steps > 16 rows) by dv tile, warps and hints, against an XLA pass
    pool-probe) timeout 300 python3 bench/probes/gdn_pool.py "$dest/gdn-pool-probe_gpu_$stamp.json" 32 64 128 2>&1 | grep -v Warning ;;
    spec-pool-ab) for f in old new; do timeout 250 python3 bench/probes/spec_pool_ab.py $f "$dest/spec-pool-ab-$f""_gpu_$stamp.json" \
               --k 3 2>&1 | grep -v Warning | grep "qwen\|shipped"; done ;;
    # decode-shaped weight products with cold weights: XLA (Triton GEMM), cuBLAS, the Pallas GEMM configs
    probes)  timeout 300 python3 bench/probes/cold_products.py "$dest/cold-products-default_gpu_$stamp.json" 1 8 64 \
               2>&1 | grep -v Warning
             PROBE_XLA_ONLY=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 100 python3 bench/probes/cold_products.py \
               "$dest/cold-products-cublas_gpu_$stamp.json" 1 8 64 2>&1 | grep -v Warning ;;
    # Pallas' Mosaic GPU backend against the Triton lowering and XLA on a bandwidth-bound kernel
    mosaic)  timeout 120 python3 bench/probes/mosaic_gpu.py "$dest/mosaic-gpu-probe_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # r20: the chunked GDN's scan under launch settings beside fla's kernels (r35: its fused and prefetch forms); MLP forms at 8192 tokens
    scan-probes) timeout ${SCAN_PROBE_LIMIT:-330} python3 bench/probes/gdn_scan_configs.py "$dest/gdn-scan-configs-probe_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # r29: a CUDA graph's launch with its buffers moving or fixed (bench/probes/graph_launch.py), elementwise
    # and GEMM chains of 480 kernels
    graph-launch) for kind in elementwise gemm; do
               timeout 150 python3 bench/probes/graph_launch.py "$dest/graph-launch-probe-$kind""_gpu_$stamp.json" 480 $kind \
                 2>&1 | grep -v Warning
             done ;;
    # r33: the residual chain's adds folded into cuBLASLt products or not (bench/probes/residual_chain.py), with
    # Triton GEMMs on (default) and off; then the engine's prefill with library_gemms_min_tokens 1024 against off
    residual-probe) timeout 150 python3 bench/probes/residual_chain.py "$dest/residual-chain-probe_gpu_$stamp.json" 2>&1 | grep -v Warning
             XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 150 python3 bench/probes/residual_chain.py \
               "$dest/residual-chain-probe-cublas_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    libgemm-ab) for v in 1024 off; do
               timeout 280 python3 -m jaxgdn.bench prefill --no-peer --library-gemms-min-tokens $v --profile /tmp/prof-$v \
                 --out "$dest/prefill-libgemm-$v""_gpu_$stamp.json" 2>&1 | grep -v Warning
             done ;;
    # r34: the MLP's gate/up product with SiLU * up in its epilogue (Mosaic GPU) against cuBLAS + the multiply,
    # then the engine's prefill with the kernel (the default, mlp.SWIGLU_KERNEL_MIN_TOKENS) and without it
    swiglu-probe) timeout 200 python3 bench/probes/swiglu_mosaic.py "$dest/swiglu-mosaic-probe_gpu_$stamp.json" 8192 4096 2048 \
               2>&1 | grep -v Warning ;;
    swiglu-ab) for v in off on; do
               if [ $v = off ]; then min=off; else min=; fi
               JAXGDN_SWIGLU_MIN_TOKENS=$min timeout 280 python3 -m jaxgdn.bench prefill --no-peer --profile /tmp/prof-swiglu-$v \
                 --out "$dest/prefill-swiglu-$v""_gpu_$stamp.json" 2>&1 | grep -v Warning
             done ;;
    # r39: the gate/up kernel's decode-sized form (swiglu_mosaic.swiglu_product_small, 64-row steps only): its
    # compiled test, the kernel alone against XLA's product + pass at 64 rows (cold weights), then the decode
    # step at batch 64 with the form off, then on (one process each; r39's first runs also timed 128 rows, where
    # the form lost and which it no longer takes)
    swiglu-small) timeout 120 python3 -m pytest -v -p no:warnings -m gpu tests/test_gpu.py -k "swiglu_kernel_compiled and small" \
               > "$dest/gpu-tests-swiglu-small_$stamp.txt" 2>&1
             grep -E "PASSED|FAILED|ERROR|passed|failed" "$dest/gpu-tests-swiglu-small_$stamp.txt"
             PROBE_SWIGLU=1 timeout 80 python3 bench/probes/skinny_mosaic.py "$dest/swiglu-small-probe_gpu_$stamp.json" 64 \
               2>&1 | grep -v Warning
             for v in off on; do
               JAXGDN_SWIGLU_SMALL=$v timeout 170 python3 -m jaxgdn.bench decode --no-peer --batch 64 \
                 --out "$dest/decode-swiglu-small-$v""_gpu_$stamp.json" 2>&1 | grep -v Warning
             done ;;
    # r41: the pool kernel forming the gates from the in_proj product (steps of > 16 rows): its compiled tests,
    # then the decode step at batches 32, 64 and 128 with it off / on / off (one process each; POOL_RUNS)
    pool-gates) switch_ab pool-gates JAXGDN_POOL_GATES "${POOL_RUNS:-off on off}" "${POOL_BATCHES:-32 64 128}" ;;
    skinny-probe) timeout 500 python3 bench/probes/skinny_mosaic.py "$dest/skinny-mosaic-probe_gpu_$stamp.json" 64 1 8 \
               2>&1 | grep -v Warning ;;
    # r42: weight loads ahead of griddepcontrol.wait in a chain of Pallas GEMVs; the dump shows whether XLA adds
    # its own wait to the Pallas kernels (files naming griddepcontrol, with counts)
    pdl-probe) timeout 300 python3 bench/probes/pdl_prefetch.py "$dest/pdl-prefetch-probe_gpu_$stamp.json" 2>&1 | grep -v Warning
             XLA_FLAGS=--xla_dump_to=/tmp/pdl-dump PDL_PROBE_PAIRS=1 timeout 120 python3 bench/probes/pdl_prefetch.py > /dev/null 2>&1
             grep -rc griddepcontrol /tmp/pdl-dump | grep -v ":0$" | head -30 ;;
    mlp-probe) timeout 100 python3 bench/probes/mlp_forms.py "$dest/mlp-forms-probe_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # r20: a 0.8B decode step's kernels at batches 1 and 64, each named by the model code that made it
    decode-kernels) timeout 300 python3 bench/probes/decode_kernels.py "$dest/decode-kernels-probe_gpu_$stamp.json" 1 64 \
               2>&1 | grep -v Warning ;;
    # r21: RMSNorm weights folded into the projections (EngineConfig.fold_norms) against the unfolded norms,
    # decode at batches 1, 8 and 64 and prefill, in one process each (no peer); FOLD_RUNS picks the runs
    fold-ab) i=0; t=$(python3 -c "from jaxgdn.norms import POST_SCALE_MAX_TOKENS as t; print(t)")
             for run in ${FOLD_RUNS:-decode:on decode:off prefill:on prefill:off decode:on}; do
               i=$((i + 1)); bench=${run%:*}; f=${run#*:}
               if [ "$bench" = decode ]; then extra="--batch 1 8 64"; else extra="--shapes 1x2048 1x8192 8x1024 --stream-steps 0"; fi
               timeout 150 python3 -m jaxgdn.bench "$bench" --no-peer $extra --fold-norms "$f" \
                 --out "$dest/$bench-fold$t-$f-$i""_gpu_$stamp.json" 2>&1 | grep -v Warning
             done ;;
    # forms of the decode step's code at batches 1 and 8 (FORM_BATCHES), one process each
    # (bench/probes/decode_forms.py; r22: the folded norm's product, the one-kernel GDN mixer); FORMS picks them
    decode-forms) for form in ${FORMS:-default unfused-mixer no-barrier unfolded default}; do
               timeout 150 python3 bench/probes/decode_forms.py $form "$dest/decode-forms-$form-probe_gpu_$stamp.json" \
                 ${FORM_BATCHES:-1 8} 2>&1 | grep -v Warning
             done ;;
    # r23: the attention layer of a decode step alone at the 0.8B widths, the one kernel against the XLA chain
    # (r24: also its grouped form, and rows of 1024 keys beside the default 96; r25: the split grouped form, and
    # 4096 keys); PROBE_CONTEXTS picks the row lengths, PROBE_FORMS the forms
    attention-probe) for context in ${PROBE_CONTEXTS:-96 1024 4096}; do
               PROBE_CONTEXT=$context timeout 200 python3 bench/probes/decode_attention.py \
                 "$dest/decode-attention-probe-$context""_gpu_$stamp.json" 1 8 64 2>&1 | grep -v Warning
             done ;;
    # r30: whole-prompt causal attention at the 0.8B heads: cuDNN against JAX's Mosaic GPU flash attention
    prefill-attention-probe) timeout 300 python3 bench/probes/prefill_attention.py \
               "$dest/prefill-attention-probe_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # r22: the one-kernel GDN mixer alone at the 0.8B widths against the unfused chain, 4/8/16 warps
    mixer-probe) timeout 300 python3 bench/probes/gdn_mixer.py "$dest/gdn-mixer-probe_gpu_$stamp.json" 1 8 64 2>&1 | grep -v Warning ;;
    # the chunked GDN's kernel forms: prep (gdn_prep.py), the gated norm fused into the output kernel
    gdn-probes) timeout 200 python3 bench/probes/gdn_output_norm.py "$dest/gdn-output-norm-probe_gpu_$stamp.json" 2>&1 | grep -v Warning
             timeout 250 python3 bench/probes/gdn_prep.py "$dest/gdn-prep-probe_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    # sampled MTP rows on the GPU (they emitted the pad token 0 in r16; cause found in r2: Triton GEMM
    # fusions, fixed by sampling.PIN_SCALED_LOGITS): the engine's sampled rows by default (pinned), then
    # unpinned with the verify inputs dumped from inside the step (a host callback: needs the CPU platform),
    # and unpinned under settings that each remove one suspect (GDN kernels, GEMM fusions, command buffers).
    # Most telling first, so a cut call keeps them. The CPU's outputs: bench/results/engine-sampling-probe_gpu_20261201.txt.
    sampling-probes) for v in "PIN_SCALED_LOGITS=1" "PIN_SCALED_LOGITS=0 DUMP_VERIFY=1 JAX_PLATFORMS=cuda,cpu" "PIN_SCALED_LOGITS=0 GDN_IMPL=chunked" \
                      "PIN_SCALED_LOGITS=0 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false" \
                      "PIN_SCALED_LOGITS=0 XLA_FLAGS=--xla_gpu_enable_command_buffer="; do
               echo "== $v"; env $v timeout 110 python3 bench/probes/engine_sampling.py 2:1:sync 2>&1 | grep -v Warning
             done | tee "$dest/engine-sampling-probes_gpu_$stamp.txt" ;;
    sampling-backends) JAX_PLATFORMS=cuda,cpu timeout 120 python3 bench/probes/sampling_backends.py \
               "$dest/sampling-backends-probe_gpu_$stamp.json" 2>&1 | grep -v Warning | grep -vc same ;;
    startup) timeout 400 python3 -m jaxgdn.bench startup --cache-dir /tmp/jaxgdn-startup-cache \
               --out "$dest/startup_gpu_$stamp.json" 2>&1 | grep -v Warning ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
