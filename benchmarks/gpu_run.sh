#!/usr/bin/env bash
# The GPU figures' device calls (BENCHMARKS.md, section GPU), one part per call, each under 10 minutes.
#   bash benchmarks/gpu_run.sh 1   # the GPU tests; per-call costs at the 13B shapes
#   bash benchmarks/gpu_run.sh 2   # the fixture preset on the GPU, the tree cost per node, the loop's overhead
#   bash benchmarks/gpu_run.sh 3   # where the loop syncs; the loop's overhead with CUDA graphs
#   bash benchmarks/gpu_run.sh 4   # per-call costs at the 7B/1B shapes
#   bash benchmarks/gpu_run.sh 5   # the sync and tree tests, where the loop syncs, the 7B/1B shapes
#   bash benchmarks/gpu_run.sh 6 same|bridged   # the loop's overhead with CUDA graphs, one draft per call
#   bash benchmarks/gpu_run.sh 7 ["-k expression"]   # chi-square cases on CUDA (about two per call)
#   bash benchmarks/gpu_run.sh 8 test|bridged|same   # captured trees: the CUDA test, or the 13B-shape loop per draft
#   bash benchmarks/gpu_run.sh 9   # per-call costs at the 13B shapes with the tree-masked 8/16/32-row verifications
#   bash benchmarks/gpu_run.sh 10  # correctness in one call: the CUDA tests and seven chi-square cases, in parallel
#   bash benchmarks/gpu_run.sh 11  # three dynamic-cache chi-square cases, then the warmed-up captured bridged tree loop
#   bash benchmarks/gpu_run.sh 12  # the CUDA tests, test_cache.py and the dynamic same-tokenizer chi-square case
#   bash benchmarks/gpu_run.sh 13 [24]  # trees against chains at T=0.7 on the fixture preset (prompts: 12, or 24)
#   bash benchmarks/gpu_run.sh 14  # the same tree and chain with CUDA graphs (compile=True), drafting every cycle
#   bash benchmarks/gpu_run.sh 15  # CUDA graphs without inductor (the default): the CUDA tests but torch.compile's,
#                                  # a chi-square case under graphs, recording and step costs at the 13B shapes, a
#                                  # fresh process's first generate, the bridged loop per cycle
#   bash benchmarks/gpu_run.sh 16  # CUDA graphs at the 7B/1B shapes, the same-tokenizer loop per cycle, the fixture preset by default
#   bash benchmarks/gpu_run.sh 17  # the CUDA tests but inductor's, xtokspec distill on the fixture pair on CUDA, the
#                                  # vLLM proposer's batched draft forwards against one per request (real drafts' shapes)
#   bash benchmarks/gpu_run.sh 18  # the batched draft forwards at Gemma-3's shape; the loop's overhead at the 13B shapes, eager
#   bash benchmarks/gpu_run.sh 19  # the vLLM proposer's captured drafts: their CUDA test, their cost against eager and batched
#   bash benchmarks/gpu_run.sh 20  # token healing on the GPU: the CUDA tests, the one-hot chi-square case, the fixture
#                                  # preset healed against unhealed (greedy and T=0.7)
#   bash benchmarks/gpu_run.sh 21  # healing's host transfers: their CUDA test; the loop per cycle healed and not (13B shapes)
#   bash benchmarks/gpu_run.sh 22  # the same loops in both orders (which of the two runs first)
#   bash benchmarks/gpu_run.sh 23  # the fixture preset against transformers' compiled target alone; the eager loop at
#                                  # the 13B shapes with the bridged draft first
#   bash benchmarks/gpu_run.sh 24  # the default (CUDA graphs) measured: parts 15's and 16's recording and step costs
#                                  # at the 13B and 7B/1B shapes, a fresh first generate; the keyed sampler on CUDA
#   bash benchmarks/gpu_run.sh 25  # the CUDA tests but inductor's (the placements' seeded asserts), the keyed tests,
#                                  # the keyed sampler against one-hot and auto on the fixtures (host-hashed row keys)
#   bash benchmarks/gpu_run.sh 26  # the vLLM proposer's drafting way chosen per step: its CUDA tests, the draft
#                                  # forwards' cost four ways, the proposer's own time per step by way and batch
# Each step has its own time limit and writes under $OUT, so a step that fails or runs long loses only itself.
set -u
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then  # carried wheels (the transformers this project was tested with)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
{ nvidia-smi; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"; } \
  > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
step() {  # step SECONDS NAME COMMAND...: run with a limit, log to $OUT/NAME.log, report the exit status
  local limit=$1 name=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s"
  tail -n 25 "$OUT/$name.log"
}
case "${1:-1}" in
1)  # the GPU tests (the compiled one spends ~3 minutes compiling), the per-call costs at the 13B shapes
  step 300 tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_cache.py
  step 250 gpu13 python3 benchmarks/gpu.py --pairs 13b --out "$OUT/gpu13"
  ;;
2)  # the fixture preset on the GPU, the tree cost per node, the loop's overhead at the 13B shapes (eager)
  step 220 fixtures xtokspec bench --preset fixtures --device cuda --prompts 12 --modes greedy --tree-widths 4 \
    --systems xtokspec-same hf-assisted xtokspec-bridged hf-universal xtokspec-bridged-tree4 --out "$OUT/fixtures"
  step 70 treecost python3 benchmarks/tree_cost.py --device cuda --out "$OUT/treecost"
  step 200 loop python3 benchmarks/gpu_loop.py --out "$OUT/loop"
  ;;
3)  # where the greedy loop syncs, and the loop's overhead with CUDA graphs
  step 60 syncs python3 benchmarks/gpu_syncs.py
  step 420 loopc python3 benchmarks/gpu_loop.py --compile --out "$OUT/loopc"
  ;;
4)  # the 7B/1B shapes
  step 300 gpu7 python3 benchmarks/gpu.py --pairs 7b-1b --out "$OUT/gpu7"
  ;;
5)  # the sync and tree tests, where the loop syncs, the 7B/1B shapes
  step 150 tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "host_transfers or tree4"
  step 60 syncs python3 benchmarks/gpu_syncs.py
  step 250 gpu7 python3 benchmarks/gpu.py --pairs 7b-1b --out "$OUT/gpu7"
  ;;  # (a chi-square case here did not fit its 120 s: part 7 runs them)
6)  # the loop's overhead with CUDA graphs at the 13B shapes, for one draft (compiling takes minutes)
  step 540 "loopc-${2:-same}" python3 benchmarks/gpu_loop.py --compile --drafts "${2:-same}" --out "$OUT/loopc-${2:-same}"
  ;;
7)  # chi-square on CUDA, the cases chosen by a pytest -k expression (each takes 110-222 s on an H100, so
    # about two fit a call; e.g. "tree_sampling and static", "static-intersection", "longer_runs")
  XTOKSPEC_TEST_DEVICE=cuda step 540 stats python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP \
    --durations=0 tests/test_stats.py -k "${2:-tree_sampling and dynamic or switching_proposal_kinds}"
  ;;
8)  # captured token trees (tree-masked compiled steps): "8 test" greedy equality on CUDA (the compiled chain's test
    # spent ~3 minutes compiling; trees add a graph per bucket), "8 bridged" / "8 same" the cost, the nodes and
    # the loop's overhead per cycle at the 13B shapes (part 6's compiled chain took 220-310 s; trees compile more)
  if [ "${2:-bridged}" = test ]; then
    step 560 tests python3 -m pytest -q -p no:cacheprovider -rP tests/test_gpu.py -k "compiled-tree4"
  else
    step 560 "loopt-${2:-bridged}" python3 benchmarks/gpu_loop.py --compile --tree-width 4 --drafts "${2:-bridged}" \
      --out "$OUT/loopt-${2:-bridged}"
  fi
  ;;
9)  # what the target's tree-masked verification costs per bucket (8, 16, 32 rows: three more target graphs to
    # compile, ~30 s each at this shape), and the tree predictions from the real pair's CPU traces
  step 560 gpu13 python3 benchmarks/gpu.py --pairs 13b --traces benchmarks/results/fast-bf16-cpu/real-trees-t07/results.json \
    --out "$OUT/gpu13"
  ;;
10)  # correctness only (no timings), one pytest process per case in parallel (16 host cores; the fixture models are
     # launch-bound on a GPU, so the cases barely share it): every test of test_gpu.py, and seven end-to-end
     # chi-square cases (dynamic cache, sampled roots, the trimmed head, target-alone cycles)
  XTOKSPEC_TEST_DEVICE=cuda step 570 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP -n 10 \
    --durations=0 tests/test_gpu.py tests/test_stats.py -k "test_gpu or (end_to_end_sampling_matches_target and \
    dynamic) or sampled_root_tree or trimmed_draft_head or target_alone_cycles"
  ;;
11)  # the three dynamic-cache chi-square cases (they ask for the dynamic cache by name: CUDA's default is the
     # static one), then the captured width-4 bridged tree loop after warmup
  XTOKSPEC_TEST_DEVICE=cuda step 150 stats python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP -n 3 \
    --durations=0 tests/test_stats.py -k "end_to_end_sampling_matches_target and dynamic"
  step 400 loopt-bridged python3 benchmarks/gpu_loop.py --compile --tree-width 4 --drafts bridged --out "$OUT/loopt-bridged"
  ;;
12)  # every CUDA test and test_cache.py (with the carried transformers: 5.24 names the forward's cache argument
     # `cache`), and the dynamic same-tokenizer chi-square case, whose q^2 control misses at its first look on
     # CUDA's draws (p=1.9e-4 at 500 runs) and rejects at its second, sized by its measured power
  XTOKSPEC_TEST_DEVICE=cuda step 560 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP -n 8 \
    --durations=0 tests/test_gpu.py tests/test_cache.py \
    tests/test_stats.py -k "test_gpu or test_cache or (end_to_end_sampling_matches_target and dynamic-same)"
  ;;
13)  # trees against chains at T=0.7 on the fixture preset, measured on the GPU (eager, CUDA's static cache), with
     # and without the fallback to the target alone: bridged tree vs bridged chains and vs the same-tokenizer chain
  step 540 fixtures-t07 xtokspec bench --preset fixtures --device cuda --prompts ${2:-12} --modes T=0.7 --tree-widths 4 \
    --always-draft --no-progress --systems xtokspec-same xtokspec-bridged-onehot xtokspec-bridged-intersection \
    xtokspec-bridged-auto xtokspec-bridged-tree4 xtokspec-same-always xtokspec-bridged-onehot-always \
    xtokspec-bridged-intersection-always xtokspec-bridged-auto-always xtokspec-bridged-tree4-always --out "$OUT/fixtures-t07"
  ;;
14)  # eager, the fixture target (24 narrow layers) costs ~6-7 draft steps (2 layers) a call, in launches;
     # captured, both cost little: the tree and the intersection chain compiled, drafting every cycle. Compiling
     # the two systems' buckets takes most of a call: a 380-s limit stopped it while still compiling
  step 560 fixtures-t07c xtokspec bench --preset fixtures --device cuda --compile --prompts 12 --max-new-tokens 64 \
    --modes T=0.7 --tree-widths 4 --always-draft --no-progress --systems xtokspec-bridged-tree4-always \
    xtokspec-bridged-intersection-always --out "$OUT/fixtures-t07c"
  ;;
15)  # CUDA graphs recorded by xtokspec (SpecConfig(compile="graphs"), "auto" on a GPU; no inductor): the CUDA tests
     # but torch.compile's (greedy equality for chains and trees under graphs, the host syncs per cycle eager and
     # under graphs, the default's first generate, the static intersection chi-square case under graphs with its
     # control), in parallel; then what recording and a replayed step cost at the 13B shapes (c with graphs, the
     # predictions from the real pairs' traces), a first generate in a fresh process, and the bridged loop per cycle
  # (two pytest processes side by side, so that no plugin is needed: the chi-square case alone, every other)
  XTOKSPEC_TEST_DEVICE=cuda step 270 stats python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP \
    --durations=0 tests/test_gpu.py -k "sampling_under_cuda_graphs" &
  XTOKSPEC_TEST_DEVICE=cuda step 270 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP \
    --durations=0 tests/test_gpu.py -k "not compiled and not sampling_under_cuda_graphs"
  wait
  step 100 graphs13 python3 benchmarks/gpu_graphs.py --pairs 13b --out "$OUT/graphs13"
  step 60 first python3 benchmarks/gpu_graphs.py --first-generate --out "$OUT/first"
  step 120 loopg-bridged python3 benchmarks/gpu_loop.py --compile graphs --drafts bridged --out "$OUT/loopg-bridged"
  ;;
16)  # CUDA graphs at the 7B/1B shapes, and the same-tokenizer loop per cycle with graphs (13B shapes)
  step 200 graphs7 python3 benchmarks/gpu_graphs.py --pairs 7b-1b --out "$OUT/graphs7"
  step 250 loopg-same python3 benchmarks/gpu_loop.py --compile graphs --drafts same --out "$OUT/loopg-same"
  # the fixture preset with the default configuration (graphs) against the target alone and assisted generation
  step 120 fixtures-default xtokspec bench --preset fixtures --device cuda --prompts 12 --max-new-tokens 64 \
    --modes greedy --tree-widths --no-progress --out "$OUT/fixtures-default"
  ;;
17)  # the CUDA tests but the inductor-compiled ones (greedy equality eager, under xtokspec's CUDA graphs, across
     # placements; the cache tests), in parallel; xtokspec distill end to end on CUDA (the fixture pair: target
     # continuations, bf16 training, before/after evaluation); the proposer's draft forwards batched across
     # requests against one request at a time, the fixture draft and random weights at SmolLM2's and Gemma-3's shapes
  XTOKSPEC_TEST_DEVICE=cuda step 170 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP -n 8 \
    --durations=0 tests/test_gpu.py tests/test_cache.py -k "not compiled"
  step 150 distill xtokspec distill --target ja-target --draft ja-draft-bpe --prompts fixtures/data/prompts.txt \
    --eval-count 8 --eval-new-tokens 32 --new-tokens 48 --max-steps 40 --batch-size 16 --target-device cuda \
    --draft-device cuda --no-progress --out "$OUT/distill/draft"
  rm -f "$OUT"/distill/draft/*.safetensors  # the report stays; the weights need not come back
  step 150 batch-drafts python3 benchmarks/batch_draft_cost.py --device cuda --out "$OUT/batch-drafts"
  ;;
18)  # part 17's last step did not reach Gemma-3 in its limit: that shape alone, fewer repetitions; then the loop's
     # own overhead per cycle at the 13B shapes, eager (part 2's last step), on the loop as it is now
  step 150 batch-drafts-gemma python3 benchmarks/batch_draft_cost.py --device cuda --drafts gemma --reps 5 \
    --out "$OUT/batch-drafts-gemma"
  step 230 loop python3 benchmarks/gpu_loop.py --out "$OUT/loop"
  ;;
19)  # the proposer's drafts captured per request (xtokspec_draft_graphs): the CUDA test (proposals equal eager
     # static caches', outputs the target's, caches and graphs passed to new requests), then the draft forwards'
     # cost one request at a time eager, batched, and captured (fixture draft, SmolLM2-135M's shape)
  XTOKSPEC_TEST_DEVICE=cuda step 90 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP \
    tests/test_vllm.py -k "captured_drafts_on_cuda"
  step 150 batch-drafts-captured python3 benchmarks/batch_draft_cost.py --device cuda --drafts fixture smollm2 \
    --batches 1 4 8 16 --reps 5 --captured --out "$OUT/batch-drafts-captured"
  ;;
20)  # token healing (on by default) on the GPU: every CUDA test but inductor's (greedy equality heals the bridged
     # chains; the bridged draft's host transfers per cycle healed and not), beside the one-hot chi-square case (the
     # sampled kind that heals; its healed share asserted) on CUDA; then the fixture preset with the default
     # configuration (CUDA graphs), each healing system against its -unhealed twin, with the fallback and drafting
     # every cycle (-always), greedy and T=0.7
  XTOKSPEC_TEST_DEVICE=cuda step 240 stats python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP \
    --durations=0 tests/test_stats.py -k "end_to_end_sampling_matches_target and dynamic-onehot" &
  XTOKSPEC_TEST_DEVICE=cuda step 240 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP -n 6 \
    --durations=0 tests/test_gpu.py -k "not compiled and not sampling_under_cuda_graphs"
  wait
  step 230 fixtures-healing xtokspec bench --preset fixtures --device cuda --prompts 12 --max-new-tokens 64 \
    --modes greedy T=0.7 --tree-widths --unhealed --always-draft --no-progress --systems xtokspec-same \
    xtokspec-bridged xtokspec-bridged-unhealed xtokspec-bridged-always xtokspec-bridged-unhealed-always \
    xtokspec-bridged-onehot xtokspec-bridged-onehot-unhealed xtokspec-bridged-onehot-always \
    xtokspec-bridged-onehot-unhealed-always --out "$OUT/fixtures-healing"
  ;;
21)  # token healing's host read per cycle: the transfers test again, then the bridged loop per cycle at the 13B
     # shapes with and without healing, eager and under CUDA graphs (random weights heal about a third of cycles)
  XTOKSPEC_TEST_DEVICE=cuda step 120 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP -n 2 \
    tests/test_gpu.py -k "host_transfers"
  step 200 loop-healing python3 benchmarks/gpu_loop.py --drafts bridged --unhealed --out "$OUT/loop-healing"
  step 200 loopg-healing python3 benchmarks/gpu_loop.py --compile graphs --drafts bridged --unhealed \
    --out "$OUT/loopg-healing"
  ;;
22)  # part 21's loops with the unhealed twin first, then the eager one again healed first: the first system may
     # pay for the GPU warming up
  step 120 loop-healing-u python3 benchmarks/gpu_loop.py --drafts bridged --unhealed --unhealed-first \
    --out "$OUT/loop-healing-u"
  step 90 loopg-healing-u python3 benchmarks/gpu_loop.py --compile graphs --drafts bridged --unhealed \
    --unhealed-first --out "$OUT/loopg-healing-u"
  step 120 loop-healing-h python3 benchmarks/gpu_loop.py --drafts bridged --unhealed --out "$OUT/loop-healing-h"
  ;;
23)  # the fixture preset (xtokspec's default configuration: CUDA graphs; with the fallback and drafting every
     # cycle) against the target alone both ways: transformers' eager generate ("target") and its static cache, which
     # transformers compiles with CUDA graphs ("target-static"); then part 18's eager loop at the 13B shapes with the
     # bridged draft first (part 18 ran the same-tokenizer draft first, and the first system may pay for the GPU's
     # warming up)
  step 330 fixtures-static xtokspec bench --preset fixtures --device cuda --prompts 12 --max-new-tokens 64 \
    --modes greedy T=0.7 --tree-widths --always-draft --no-progress --systems xtokspec-same xtokspec-bridged \
    xtokspec-bridged-always xtokspec-bridged-onehot xtokspec-bridged-onehot-always --out "$OUT/fixtures-static"
  step 200 loop-bridged-first python3 benchmarks/gpu_loop.py --drafts bridged same --out "$OUT/loop-bridged-first"
  ;;
24)  # the default path's figures first (gpu_graphs.py at both pairs' shapes and a fresh process's first generate,
     # each alone on the GPU), then the keyed sampler on CUDA: its tests (the hash's bits against the reference,
     # keyed text equal to the target alone's whatever the draft) and what its noise costs at a real vocabulary
  step 100 graphs13 python3 benchmarks/gpu_graphs.py --pairs 13b --out "$OUT/graphs13"
  step 60 first python3 benchmarks/gpu_graphs.py --first-generate --out "$OUT/first"
  step 200 graphs7 python3 benchmarks/gpu_graphs.py --pairs 7b-1b --out "$OUT/graphs7"
  XTOKSPEC_TEST_DEVICE=cuda step 90 keyed-tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rP \
    --durations=5 tests/test_keyed.py
  step 30 keyed-noise python3 benchmarks/keyed_bench.py --noise-only --device cuda --out "$OUT/keyed-noise/results.json"
  step 80 keyed-bench python3 benchmarks/keyed_bench.py --device cuda --prompts 16 --rounds 1 --fixed-k 4 \
    --systems onehot,auto,keyed --out "$OUT/keyed-bench/results.json"
  ;;
25)  # what part 24 left to check: the CUDA tests but inductor's, in parallel (the placements test's seeded asserts:
     # a repeat at a fixed K, the keyed sample the target alone's), the keyed tests; then the keyed sampler's speed
     # on the fixtures, its noise's row keys now hashed on the host (part 24: keyed / auto 0.739 [0.661])
  XTOKSPEC_TEST_DEVICE=cuda step 200 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -n 8 -rfE \
    --durations=8 tests/test_gpu.py tests/test_keyed.py -k "not compiled"
  step 40 keyed-noise python3 benchmarks/keyed_bench.py --noise-only --device cuda --out "$OUT/keyed-noise/results.json"
  step 150 keyed-bench python3 benchmarks/keyed_bench.py --device cuda --prompts 32 --rounds 1 --fixed-k 4 \
    --systems onehot,auto,keyed,tree4,keyed_tree4 --out "$OUT/keyed-bench/results.json"
  step 200 keyed-bench3 python3 benchmarks/keyed_bench.py --device cuda --prompts 32 --rounds 3 --fixed-k 4 \
    --systems onehot,keyed --out "$OUT/keyed-bench3/results.json"
  ;;
26)  # captured drafts by default on a GPU, each step drafting the cheaper of batched forwards over the requests'
     # static caches and each request's CUDA graphs: the CUDA tests (proposals equal eager ones, both ways used; the
     # keyed tree roots' bar), the draft forwards' cost four ways by batch, the proposer's own ms per step by way
  XTOKSPEC_TEST_DEVICE=cuda step 120 tests python3 -m pytest -q -p no:cacheprovider -p no:randomly -rfE -n 4 \
    tests/test_vllm.py tests/test_keyed.py -k "captured_drafts or step_by_step_choice or static_draft_caches or tree_roots_coupled"
  step 180 proposer-ways python3 benchmarks/proposer_ways.py --device cuda --batches 1 2 4 8 16 --out "$OUT/proposer-ways"
  step 230 batch-drafts-ways python3 benchmarks/batch_draft_cost.py --device cuda --drafts fixture smollm2 \
    --batches 1 2 4 8 16 32 --reps 5 --captured --out "$OUT/batch-drafts-ways"
  ;;
esac
# one archive: the device returns at most 8 files
tar czf /tmp/gpu-run.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu-run.tgz "$OUT/gpu-run-${1:-1}.tgz"
