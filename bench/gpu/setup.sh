#!/bin/bash
# Source on the H200 machine: installs the carried wheels (made here by bench/gpu/wheels.sh; deepspeed and
# bitsandbytes are not in that image) and sets the environment every GPU process there needs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/toolkit${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off on shared multi-GPU hosts (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The image presets "9.0a", which DeepSpeed's op builder cannot parse (int('0a')).
export TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# DeepSpeed's runner script (the --launcher deepspeed path) lands in the target's bin/.
export PATH=/tmp/site/bin:$PATH
