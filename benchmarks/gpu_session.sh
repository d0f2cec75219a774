#!/usr/bin/env bash
# The calls of a session that is lent a GPU, prepared here (every figure of benchmarks/gpu_suite.py, written under
# $OUT, which the device tool brings back). Run from the repository root:
#
#   bash benchmarks/gpu_session.sh 1       # peers built in the background; correctness; kernels against the peers
#   bash benchmarks/gpu_session.sh 2       # training steps, generate(), speculative decoding
#   bash benchmarks/gpu_session.sh --dry   # both parts on this CPU (gpu_suite.py --dry-run, no peers): the plumbing
#
# Part 1 carries `.whl` (fla_core-*.whl, flash_linear_attention-*.whl, mamba_ssm-*.tar.gz: see
# benchmarks/install_gpu_peers.sh; `.whl/` is git-ignored), part 2 `outputs/denseretnet-600` (the speculative
# section's model: `python examples/pretrain.py --model denseretnet --max-steps 600 --output-dir
# outputs/denseretnet-600`). Each part is meant to stay under one call's 10 minutes on an H100: part 1 builds
# mamba_ssm (about 3 minutes on 16 cores) while the correctness checks run, which time nothing; every timed section
# runs with nothing else on the machine. Each part writes gpu_suite.json / .md and its log under $OUT/part<N>.
# PYTHON names the interpreter (default python3, the device machine's).
set -uo pipefail
part=${1:?"usage: bash benchmarks/gpu_session.sh 1|2|--dry"}
out=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
suite() {  # suite NAME [gpu_suite.py arguments...]: one run of the suite into $out/NAME, its log beside it
    local name=$1
    shift
    mkdir -p "$out/$name"
    "${PYTHON:-python3}" benchmarks/gpu_suite.py --out-dir "$out/$name" "$@" 2>&1 | tee "$out/$name/log.txt" | tail -n 40
    return "${PIPESTATUS[0]}"
}
status=0
case $part in
    1)
        site=/tmp/gpu_peers
        bash benchmarks/install_gpu_peers.sh .whl "$site" > "$out/peers.log" 2>&1 &
        peers=$!
        suite part1-checks --sections kernel-correctness model-parity || status=1
        wait "$peers" || { echo "peers not installed: see peers.log"; status=1; }
        PYTHONPATH=$PYTHONPATH:$site suite part1-kernels --sections kernels || status=1
        ;;
    2)
        suite part2 --sections training decode speculative || status=1
        ;;
    --dry)
        export TRITON_INTERPRET=1
        suite part1-checks --dry-run --sections kernel-correctness model-parity || status=1
        suite part1-kernels --dry-run --sections kernels || status=1
        suite part2 --dry-run --sections training decode speculative || status=1
        ;;
    *)
        echo "usage: bash benchmarks/gpu_session.sh 1|2|--dry" >&2
        exit 2
        ;;
esac
echo "results under $out (exit $status)"
exit "$status"
