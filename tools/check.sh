#!/usr/bin/env bash
# Installs what is missing, runs the tiered store's and the prefetch scheduler's tests under
# ThreadSanitizer, then builds everything (warnings are errors; CUDA sources compile where nvcc
# exists) and, where nvcc exists, the GPU check's own build, runs the numerics-sensitive tests
# under OpenBLAS kernels other than this CPU's own (half of them under each of two), fuzzes each
# parser of outside input for a few seconds, and runs the whole test suite through ctest, whose
# summary is the last thing printed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's time (bash's SECONDS), printed as it ends, so a slow stage shows where.
stage_start=$SECONDS
stage_done() {
  echo "strata check: $1 took $((SECONDS - stage_start)) s ($SECONDS s in all)"
  stage_start=$SECONDS
}

tools/install-deps.sh
jobs=$(nproc)
stage_done "installing what was missing"

# ThreadSanitizer over the code whose tests drive several threads at once: the tiered store and
# the prefetch scheduler (transfer lanes and caller threads), the swap engine (io_uring driver
# threads, buffer registration), the NVMe-streamed optimizer step and the overlapped one (the
# engine's step thread beside the model's passes), and the in-process communicator (ranks as
# threads meeting at one rendezvous). A second, small build of
# just those test binaries, run directly; of the optimizer's tests only the streamed ones (the
# SIMD ones take minutes under TSan). At -O1 with line tables only (-g1: a report still names
# each frame's file and line): a third less compile time than RelWithDebInfo's -O2 -g.
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_SANITIZE=thread \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO='-O1 -g1 -DNDEBUG' \
  -DSTRATA_WERROR=ON -DSTRATA_BUILD_BENCH=OFF -DSTRATA_CUDA=OFF
cmake --build build-tsan -j "$jobs" \
  --target strata_mem_tests strata_sched_tests strata_io_tests strata_optim_tests strata_zero_tests \
  strata_dist_tests
# The runs below, as many at once as there are cores (each is mostly one thread; they took 61 s
# one after another), each into its own log, printed where it fails.
tsan_failed=()
tsan_run() {  # NAME TEST-BINARY [GTEST ARGS...]
  local name=$1 binary=$2
  shift 2
  if ! TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "build-tsan/tests/$binary" "$@" \
    --gtest_brief=1 >"build-tsan/$name.log" 2>&1; then
    touch "build-tsan/$name.failed"
  fi
}
rm -f build-tsan/*.failed
tsan_runs=(
  "mem strata_mem_tests"
  "sched strata_sched_tests"
  "io strata_io_tests"
  "dist strata_dist_tests"
  # Of the optimizer's tests only the streamed ones (the SIMD ones take minutes under TSan).
  "optim strata_optim_tests --gtest_filter=*Streamed*"
  # The overlapped optimizer step: its thread beside the model's passes and the prefetcher;
  # checkpointed activations on their way down and back on the copy streams; ZeRO over
  # in-process ranks; the state an asynchronous save reads on its thread while steps run;
  # guessed updates hearing of final gradients from the gradient landing, accumulated on the
  # device or the host; the canonical sums over 1, 2 and 4 in-process ranks; and the experts'
  # token dispatch between in-process ranks.
  "zero strata_zero_tests --gtest_filter=EnginePrefetch*:*ZeroInProcess*:Checkpointed*:*HeldState*:*SilentInTheLastMicroBatch*:*DeterministicReduction*:MoeDispatch*"
)
running=0
for run in "${tsan_runs[@]}"; do
  if [[ $running -ge $jobs ]]; then
    wait -n
    running=$((running - 1))
  fi
  read -ra args <<<"$run"  # the name, the binary and its filter (split, never globbed)
  tsan_run "${args[@]}" &
  running=$((running + 1))
done
wait
for run in "${tsan_runs[@]}"; do
  name=${run%% *}
  if [[ -f "build-tsan/$name.failed" ]]; then
    cat "build-tsan/$name.log"
    tsan_failed+=("$name")
  fi
done
if [[ ${#tsan_failed[@]} -gt 0 ]]; then
  echo "strata: ThreadSanitizer runs failed: ${tsan_failed[*]} (logs: build-tsan/<name>.log)"
  exit 1
fi
stage_done "the ThreadSanitizer build and its tests"

# ccache keys these two builds' objects by paths relative to the checkout, so that the GPU
# check's build below reuses the objects they share and a later run in another clone finds them.
relative_ccache=(env CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true)
# CUDA sources compile for one architecture here, sm_80 (with its PTX), where a user's build
# compiles three (80;89;90): nothing runs them on this machine, every architecture-dependent
# branch in kernels/ tests __CUDA_ARCH__ >= 800, and the GPU check's build below compiles sm_90.
# tools/quickstart.sh puts the three back.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=ON \
  -DSTRATA_CUDA_ARCHITECTURES=80
"${relative_ccache[@]}" cmake --build build -j "$jobs"
stage_done "the Release build"

# The GPU check's own build (tools/gpu-check.sh --build-only: STRATA_GPU_CHECK_ONLY, no MPI,
# io_uring or oneDNN, warnings as errors), configured, compiled and linked for one architecture
# where nvcc exists, so that it is known to link before a GPU is lent; nothing of it runs here.
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  "${relative_ccache[@]}" GPU_CHECK_ARCH=90 GPU_CHECK_WERROR=1 \
    GPU_CHECK_BUILD_DIR="$PWD/build-gpucheck" GPU_CHECK_OUT='' OUT='' \
    tools/gpu-check.sh --build-only
  stage_done "the GPU check's build"
fi

# Debian's OpenBLAS picks its GEMM kernel from the CPU it runs on (Zen, Haswell, SkylakeX...), and
# each rounds differently in the last bits. A tolerance that holds for one kernel only would pass
# here and fail on the next machine, so the tests that compare floating-point results with a
# tolerance also run under a kernel other than this CPU's own: every second one of them under
# one of two other kernels (chosen from those every x86-64 CPU with AVX2 runs), the rest under
# the other, so each test meets a foreign kernel and both kernels meet tests of every module.
# STRATA_CPU_GEMM=openblas keeps their GEMMs on OpenBLAS where this CPU would run them on oneDNN
# (AVX-512 or bf16 units), so these runs cover OpenBLAS's paths on every machine.
own=$( { OPENBLAS_VERBOSE=2 build/strata info 2>&1 || true; } | sed -n 's/^Core: //p' | head -n 1)
others=()
for kernel in Haswell Prescott Sandybridge; do
  [[ "$kernel" != "$own" && ${#others[@]} -lt 2 ]] && others+=("$kernel")
done
numerics='Golden|Parity|Equivalence|Attention|Ops|Resum|Reshard|Llama|Train|Loss'
# Of those, the ones that compare two runs to the bit (or count bytes) have no tolerance for a
# kernel to break: both runs take the same kernel's rounding. Left out here (74 of the 346
# CPU-seconds these runs took); the whole suite below runs them.
exact='TheBitsOfOneStage|BitForBit|KeepsTheBits|KeepTheBits|SynchronousBytes|BytesEachNode'
half=0
for kernel in "${others[@]}"; do
  half=$((half + 1))
  echo "strata: numerics-sensitive tests, half $half of 2, under OPENBLAS_CORETYPE=$kernel (this CPU's own: ${own:-?})"
  log=build/numerics-$kernel.log
  if OPENBLAS_CORETYPE=$kernel STRATA_CPU_GEMM=openblas ctest --test-dir build -j "$jobs" --timeout 900 -R "$numerics" -E "$exact" \
       -I "$half,,2" --output-on-failure >"$log" 2>&1; then
    grep -E 'tests passed|tests failed|No tests' "$log" || true
  else
    cat "$log"
    echo "strata: numerics-sensitive tests failed under OPENBLAS_CORETYPE=$kernel"
    exit 1
  fi
  stage_done "the numerics-sensitive tests under $kernel"
done

# The parsers of outside input under libFuzzer (clang, ASan + UBSan; tools/fuzz.sh): a few
# seconds a harness, from the seeds of tests/fuzz/corpus, with a fixed seed. A finding fails the
# check and leaves its input in build-fuzz/artifacts.
tools/fuzz.sh 5
stage_done "the fuzz build and its harnesses"

# Tests pin their own thread counts; run two at a time on this class of machine.
# Tests that compare a prediction with a timed run need the cores to themselves: they run after
# the rest, one at a time.
timed='StepIsCloseToTheRun'
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900 -E "$timed"
ctest --test-dir build --output-on-failure --timeout 900 -R "$timed"
