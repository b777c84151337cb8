#!/usr/bin/env bash
# The GPU tests, then the benchmark suite, on one H200 through the device tool:
#   mkdir -p gpu_wheels && cp ../shared/wheels/*.whl gpu_wheels/     (git-ignored; carry: ["gpu_wheels"])
#   pip download --python-version 3.12 --only-binary=:all: --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
#     -d gpu_wheels fastapi uvicorn httptools uvloop aiohttp             (the server and its benchmark client)
#   bash bench/h200.sh [STEP ...]     steps: tests-engine tests-verify tests-kernels tests-gdn serve serve-mixed
#                                     serve-http serve-prefix serve-sampling serve-pd-mtp serve-pd-http decode prefill spec kernels pd;
#                                     on two GPUs (device kind
#                                     nvidia-h200-x2), not in the default list: tp-9b tp-27b
# Default: every step in that order. A device call allows 600 s, so pass one to three steps per call.
# Results go to $OUT (the device tool brings them back), else bench/results; `python -m jaxgdn.bench table`
# prints them.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site gpu_wheels/*.whl
export PYTHONPATH=/tmp/site:.:tests HOME=/tmp TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export JAXGDN_CACHE_DIR=${JAXGDN_CACHE_DIR:-/tmp/jaxgdn-cache}
dest=${OUT:-bench/results}
stamp=$(date -u +%Y%m%d)
steps=${*:-tests-engine tests-verify tests-kernels tests-gdn serve serve-mixed serve-http serve-prefix serve-sampling serve-pd-mtp serve-pd-http decode prefill spec kernels pd}

# gpu_tests NAME LIMIT SELECTION: one slice of `pytest -m gpu`, its log kept beside the results (-v so a cut
# run still names what passed)
gpu_tests() {
  timeout "$2" python3 -m pytest -v -p no:warnings -m gpu tests -k "$3" -o faulthandler_timeout=200 --continue-on-collection-errors \
    > "$dest/gpu-tests-$1_$stamp.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$dest/gpu-tests-$1_$stamp.txt"
}

for step in $steps; do
  case $step in
    # the engine on the GPU (tests/test_engine_gpu.py) in two slices, then the kernels beside their CPU tests
    tests-engine)  gpu_tests engine 560 "engine_gpu and (pd_ or decode_launches)" ;;
    tests-verify)  gpu_tests verify 560 "engine_gpu and not (pd_ or decode_launches)" ;;
    tests-kernels) gpu_tests kernels 560 "not engine_gpu and not gdn" ;;
    tests-gdn)     gpu_tests gdn 560 "gdn and not engine_gpu" ;;
    # the throughput workload: 1,000 random requests, prompts 256-1024, outputs 32-512
    serve) timeout 580 python3 -m jaxgdn.bench serve --model qwen3.5-0.8b --num-prompts 1000 --input-len 256 1024 \
             --output-len 32 512 --max-num-seqs 256 --out "$dest/serve_gpu_$stamp.json" ;;
    # the mixed workload users reported: 128 requests, prompts 256-1024, outputs 32-256
    serve-mixed) timeout 580 python3 -m jaxgdn.bench serve --model qwen3.5-0.8b --num-prompts 128 --input-len 256 1024 \
             --output-len 32 256 --max-num-seqs 64 --max-num-batched-tokens 8192 --out "$dest/serve-mixed_gpu_$stamp.json" ;;
    # the server over HTTP at 64 and at 256 requests in flight (serve-http-c64, -c256), then the same workloads
    # in-process on the programs the server compiled (serve-c64, -c256: one process on its cache)
    serve-http)
      export JAXGDN_CACHE_DIR=/tmp/jaxgdn-serve-http-cache
      python3 -m jaxgdn.serve --model qwen3.5-0.8b --port 8000 > /tmp/serve-http-server.txt 2>&1 &
      server=$!
      for _ in $(seq 300); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
      grep "start-up" /tmp/serve-http-server.txt
      for c in 64 256; do
        timeout 100 python3 -m jaxgdn.bench serve --http http://127.0.0.1:8000 --model qwen3.5-0.8b --num-prompts 1000 \
          --max-concurrency $c --http-repeat 0 --out "$dest/serve-http-c${c}_gpu_$stamp.json"; done
      kill $server; wait $server
      for c in 64 256; do
        timeout 120 python3 -m jaxgdn.bench serve --model qwen3.5-0.8b --num-prompts 1000 --max-concurrency $c --no-peer \
          --cache-dir $JAXGDN_CACHE_DIR --out "$dest/serve-c${c}_gpu_$stamp.json"; done ;;
    # prefix caching (docs/prefix-caching.md), one compilation cache for the three: a 2,048-token shared prompt,
    # conversations of 6 turns, and the random workload, each warm with caching on and off
    serve-prefix)
      f="--no-peer --cache-dir /tmp/jaxgdn-prefix-cache --max-model-len 4096"
      timeout 260 python3 -m jaxgdn.bench serve --dataset prefix --num-prompts 512 --prefix-len 2048 --input-len 32 256 \
        --output-len 64 256 $f --out "$dest/serve-prefix_gpu_$stamp.json"
      timeout 150 python3 -m jaxgdn.bench serve --dataset multiturn --num-prompts 128 --input-len 32 256 \
        --output-len 64 256 $f --out "$dest/serve-multiturn_gpu_$stamp.json"
      timeout 150 python3 -m jaxgdn.bench serve --compare-prefix-caching $f \
        --out "$dest/serve-random-prefix-ab_gpu_$stamp.json" ;;
    # the cost of the sampling API: the random workload plain, with logprobs=5 and with a JSON schema on every
    # request, one cache
    serve-sampling)
      f="--no-peer --cache-dir /tmp/jaxgdn-sampling-cache --num-prompts 1000 --input-len 256 1024 --output-len 32 512"
      timeout 280 python3 -m jaxgdn.bench serve $f --out "$dest/serve-sampling-off_gpu_$stamp.json"
      timeout 120 python3 -m jaxgdn.bench serve $f --logprobs 5 --out "$dest/serve-logprobs-5_gpu_$stamp.json"
      timeout 150 python3 -m jaxgdn.bench serve $f --json-schema --out "$dest/serve-json-schema_gpu_$stamp.json" ;;
    # PD + MTP K = 2 at the default configuration, both workers on the one GPU, then the colocated engine on the
    # same workload (bench serve --pd runs both: the ratio, handoff bytes and copy times)
    serve-pd-mtp) timeout 580 python3 -m jaxgdn.bench serve --model qwen3.5-0.8b --num-prompts 1000 --pd \
      --num-speculative-tokens 2 --no-peer --out "$dest/serve-pd-mtp_gpu_$stamp.json" ;;
    # the same workload over HTTP through the two PD servers (--role prefill / decode) sharing the GPU: the prefill
    # server starts first, the decode server then loads the programs they share from the cache; logs go to $dest
    serve-pd-http)
      export JAXGDN_CACHE_DIR=/tmp/jaxgdn-pd-http-cache
      f="--model qwen3.5-0.8b --num-speculative-tokens 2 --gpu-memory-utilization 0.42"
      healthy() { for _ in $(seq "$2"); do curl -sf http://127.0.0.1:$1/health > /dev/null && return 0; sleep 1; done; return 1; }
      python3 -m jaxgdn.serve --role prefill --port 8100 $f > "$dest/serve-pd-http-prefill_gpu_$stamp.txt" 2>&1 &
      prefill=$!
      healthy 8100 300 && python3 -m jaxgdn.serve --role decode --port 8000 --prefill-url http://127.0.0.1:8100 $f \
        > "$dest/serve-pd-http-decode_gpu_$stamp.txt" 2>&1 &
      decode=$!
      healthy 8000 240 && timeout 200 python3 -m jaxgdn.bench serve --http http://127.0.0.1:8000 --model qwen3.5-0.8b \
        --num-prompts 1000 --http-repeat 0 --out "$dest/serve-pd-http_gpu_$stamp.json"
      for port in 8100 8000; do curl -s http://127.0.0.1:$port/metrics | grep -E "^jaxgdn_(xla_)?compiles"; done
      kill $prefill $decode; wait $prefill $decode ;;
    decode)  timeout 300 python3 -m jaxgdn.bench decode --out "$dest/decode_gpu_$stamp.json" ;;
    prefill) timeout 300 python3 -m jaxgdn.bench prefill --out "$dest/prefill_gpu_$stamp.json" ;;
    spec)    timeout 300 python3 -m jaxgdn.bench spec --out "$dest/spec_gpu_$stamp.json" ;;
    kernels) timeout 300 python3 -m jaxgdn.bench kernels --out "$dest/kernels_gpu_$stamp.json" ;;
    pd)      timeout 200 python3 -m jaxgdn.bench pd --out "$dest/pd_gpu_$stamp.json" ;;
    # tensor parallelism: decode of the 9B preset on one GPU and split over two, then the 27B over two; the
    # profiles' top kernels include the all-reduces
    tp-9b) for tp in 1 2; do
             timeout 290 python3 -m jaxgdn.bench decode --model qwen3.5-9b --no-peer --batch 1 64 -tp $tp \
               --profile /tmp/tp$tp --out "$dest/decode-9b-tp${tp}_gpu_$stamp.json"; done ;;
    tp-27b) timeout 580 python3 -m jaxgdn.bench decode --model qwen3.5-27b --no-peer --batch 1 64 -tp 2 \
              --profile /tmp/tp27 --out "$dest/decode-27b-tp2_gpu_$stamp.json" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
