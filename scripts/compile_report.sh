#!/usr/bin/env bash
# docs/compile.md in one command: `mla-tune compile` of each GPU's own plan, as Markdown.
#
#   scripts/compile_report.sh PYTHON36 [OUT]
#
# PYTHON36 is a Python with the target images' Triton (3.6.0, the contest's MI355X runner
# and the H200 image) and mla_tune installed (pip install -e .), e.g. /work/venv36/bin/python;
# the installed Triton (this shell's `python`) gives the other sections. Sections:
# MI355X (configs/mi355x.yaml) under PYTHON36 and under the installed Triton; H200
# (configs/leaderboard.yaml) likewise. JOBS (default: the CPU count) compiler processes;
# results are cached by binary key ($MLA_TUNE_CACHE/compile, else ~/.cache/mla-tune/compile),
# so a second run recompiles only what changed. Run from anywhere; writes OUT (default
# docs/compile.md) atomically. A section whose binaries fail still lands in the report,
# and the script then exits 1.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 PYTHON36 [OUT]  (PYTHON36: a Python with triton 3.6.0 and mla_tune installed)" >&2
    exit 2
fi
py36=$1
cd "$(dirname "$0")/.."
out=${2:-docs/compile.md}
jobs=${JOBS:-$(nproc)}
python=${PYTHON:-python}
tmp=$(mktemp "${out}.XXXXXX")
trap 'rm -f "$tmp"' EXIT
status=0
installed=$("$python" -c "import triton; print(triton.__version__)")
image=$("$py36" -c "import triton; print(triton.__version__)") || exit 2
{
    echo "# Compile report: each GPU's plan cross-compiled without the GPU"
    echo
    echo "Made by \`scripts/compile_report.sh $py36\` on $(date -u +%Y-%m-%d) at commit"
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- mla_tune configs || echo ' plus uncommitted changes'),"
    echo "on a machine without a GPU, with Triton $image (the target images') and $installed (installed here)."
    echo "Nothing here ran on a GPU: these are the compilers' resource figures, not timings."
    echo "Each section is one \`mla-tune compile\` run (mla_tune/xcompile), its command above its"
    echo "table; a sweep drops the candidates listed as dropped. Columns: registers (AMD: arch VGPRs +"
    echo "AGPRs of the 512-entry file; CUDA: per thread), scratch (AMD: private segment per lane;"
    echo "CUDA: spill stores), LDS / shared bytes, MMA instructions, occupancy (AMD: waves per"
    echo "SIMD; CUDA: CTAs / warps per SM), candidates sharing the binary."
    echo
} > "$tmp"
for gpu in MI355X H200; do
    for py in "$py36" "$python"; do
        args=(compile --gpu "$gpu" --markdown --jobs "$jobs")
        [ "$py" = "$python" ] || args+=(--triton "$py")
        "$python" -m mla_tune "${args[@]}" >> "$tmp" || status=1
        echo >> "$tmp"
    done
done
mv "$tmp" "$out"
trap - EXIT
echo "wrote $out"
exit $status
