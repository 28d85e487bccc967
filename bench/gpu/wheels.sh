#!/bin/bash
# Run here (not on the H200 machine), in the repository's root, with `make install` done: fills .whl/ with what
# the H200 image lacks or has too old, for bench/gpu/setup.sh to install there. It is ~23 MB, under the 64 MiB a
# device call may carry. The image is Python 3.12 with torch 2.11.0+cu130 and transformers 5.17 (too old:
# hpctrain's ZeRO-3 path is measured with 5.24).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
mkdir -p .whl
py312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64 -d .whl)
# DeepSpeed has no wheel on PyPI: built here without its ops (they JIT-build there against the image's CUDA).
DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
python3 -m pip download -q "${py312[@]}" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    typing-extensions hjson submitit==1.5.4 tomli-w peft==0.21.2 liger_kernel==0.8.5 transformers==5.24.0
# bitsandbytes (QLoRA): PyPI's 43 MB wheel holds a library for every CUDA and ROCm release. Keep the one the
# image's torch loads (CUDA 13.0) and the CPU one: 3.6 MB. RECORD loses the dropped files' lines.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q "${py312[@]/#.whl/$tmp}" bitsandbytes==0.50.2
(cd "$tmp" && mkdir x && cd x && unzip -q ../bitsandbytes-*.whl \
    && find . -name 'libbitsandbytes_*.so' ! -name '*cuda130.so' ! -name '*_cpu.so' -delete \
    && rec=$(ls -d bitsandbytes-*.dist-info)/RECORD \
    && grep -vE 'libbitsandbytes_' "$rec" > ../RECORD && grep -E 'libbitsandbytes_(cuda130|cpu)\.so' "$rec" >> ../RECORD \
    && cp ../RECORD "$rec" && rm -f ../bitsandbytes-*.whl && zip -q -r ../bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl .)
rm -f .whl/bitsandbytes-*.whl
cp "$tmp"/bitsandbytes-*.whl .whl/
du -sh .whl
