#!/usr/bin/env bash
# Bring the GPU suite's peers (fla's chunk_retention, mamba_ssm's selective_scan_fn) onto a GPU machine that
# reaches no package registry; docs/benchmarks.md ("The peers") says how they were fetched and built.
#
#   bash benchmarks/install_gpu_peers.sh WHEEL_DIR SITE_DIR [BUILT_DIR]
#
# WHEEL_DIR holds, fetched on a machine that reaches the registry:
#   - fla_core-*.whl and flash_linear_attention-*.whl (pure Python; `pip download --no-deps` of both);
#   - mamba_ssm-*.tar.gz (the sdist), or a mamba_ssm-*.whl that an earlier run of this script built.
# Everything is installed with --no-deps into SITE_DIR (put it on PYTHONPATH): their other requirements (torch,
# triton, einops, transformers) are the machine's own. mamba_ssm is built from its sdist for this GPU's architecture
# alone (its setup.py names ten architectures, which takes far longer to compile), without build isolation, against
# the machine's torch; the wheel it makes is copied into BUILT_DIR when one is given, so that a later machine can
# install it instead of building again.
set -euo pipefail
wheels=$(realpath "$1")
site=$2
built=${3:-}
mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$wheels"/fla_core-*.whl "$wheels"/flash_linear_attention-*.whl
if compgen -G "$wheels/mamba_ssm-*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/mamba_ssm-*.whl
    exit 0
fi
work=$(mktemp -d)
tar xzf "$wheels"/mamba_ssm-*.tar.gz -C "$work"
cd "$work"/mamba_ssm-*
arch=$(python3 -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability())))")
ARCH=$arch python3 - <<'EOF'
import os, re
text = open("setup.py").read()
keep = os.environ["ARCH"]
text = text.replace('cc_flag.append("-gencode")', "pass")
text, count = re.subn(r'cc_flag\.append\("arch=compute_(\d+),code=sm_\d+"\)',
                      lambda m: f'cc_flag += ["-gencode", "arch=compute_{keep},code=sm_{keep}"]'
                      if m.group(1) == keep else "pass", text)
assert count >= 1 and f"compute_{keep}" in text, "setup.py no longer lists its architectures as expected"
open("setup.py", "w").write(text)
EOF
start=$(date +%s)
TORCH_CUDA_ARCH_LIST="${arch:0:-1}.${arch: -1}" MAMBA_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-16} python3 -m pip wheel -q --no-build-isolation --no-deps --no-index \
    -w "$work/dist" .
echo "mamba_ssm built for sm_$arch in $(( $(date +%s) - start )) s"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$work"/dist/mamba_ssm-*.whl
if [ -n "$built" ]; then
    mkdir -p "$built"
    cp "$work"/dist/mamba_ssm-*.whl "$built"/
fi
