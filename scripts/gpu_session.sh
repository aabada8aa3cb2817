#!/usr/bin/env bash
# One device call (~9 min) of what issue 21 still needs from a GPU, for a session that is lent one:
#   1. the tests never run on a GPU yet: the MLIR fusion's Triton kernels (if they pass and pay,
#      mlir_elementwise_fusion's `backend: auto` can pick triton on CUDA; it skips there now), the FP8 tests whose forms
#      changed after the last GPU run, the pipeline with the multi-stream transforms on;
#   2. that shape propagation keeps the graph symbolic on CUDA and skips no transform
#      (scripts/gpu_shape_prop_diag.py; its cause, torch 2.11's C++ matmul, was found and fixed on CPU);
#   3. the HF + torch.compile row of the `large` table (RESULTS.md "On a GPU");
#   4. prefill at 2048 tokens against HF eager again (was 0.85x before the eager steps of
#      torch-cudagraph took the direct kernels and one host read per attention call).
#   5. prefix caching's state copies under captured graphs and the logits processors on CUDA
#      (tests/gpu/test_state_and_sampling_gpu.py, written and run on CPU with DEVICE=cpu);
# Run `scripts/gpu_wheels.sh` here first (the device call carries .whl/), then, through the device
# tool: `bash scripts/gpu_session.sh` with carry [".whl"] and timeout_s 600. Logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"
timeout 230 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/gpu/test_mlir_triton_gpu.py \
    tests/gpu/test_fp8_cuda.py "tests/gpu/test_multi_stream_gpu.py::test_pipeline_on_gpu_with_the_transforms_on" \
    tests/gpu/test_state_and_sampling_gpu.py \
    > "$OUT/tests.log" 2>&1
tail -25 "$OUT/tests.log"
timeout 90 python3 scripts/gpu_shape_prop_diag.py > "$OUT/diag.log" 2>&1
grep -E "=====|FAILED NODE|skipped for|first input|shape prop|Error" "$OUT/diag.log" | head -20
timeout 100 python3 -m autodeploy.cli bench --model large --dtype bfloat16 --device cuda \
    --engines autodeploy hf-eager --batch-sizes 1 --new-tokens 8 --prefill-lens 2048 --rounds 1 \
    --prefill-reps 3 --accuracy-prompts 0 --out "$OUT" > "$OUT/prefill.log" 2>&1
tail -8 "$OUT/prefill.log"
timeout 240 python3 -m autodeploy.cli bench --model large --dtype bfloat16 --device cuda \
    --engines hf+torch.compile --batch-sizes 1 32 --new-tokens 32 --prefill-lens 2048 --rounds 1 \
    --prefill-reps 1 --accuracy-prompts 0 --out "$OUT" > "$OUT/bench.log" 2>&1
tail -15 "$OUT/bench.log"
