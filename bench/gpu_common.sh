# Sourced by bench/gpu_check.sh and bench/gpu_quant_check.sh: a lease's setup, and the 8B checkpoint made beside it.
# Needs .bench-shared/workload.py (a copy of ../shared/bench/workload.py) and, where the device image lacks
# llguidance, its wheel in .whl/.

# gpu_setup OUTDIR: the environment, the carried wheels, the device's name and versions into OUTDIR/device.txt.
gpu_setup() {
    mkdir -p "$1"
    export PYTHONUNBUFFERED=1 PYTHONPATH=agent:kernels:contract
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    nvidia-smi -L | tee "$1/device.txt"
    python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' \
        | tee -a "$1/device.txt"
}

# make_8b MODEL OUTDIR: start writing the random Llama-3-8B checkpoint in the background; its pid is in $maker.
# It is built on the GPU (seconds, not minutes on the host) and written by transformers' save_pretrained.
make_8b() {
    ( timeout "${MAKE_S:-150}" python3 - "$1" >"$2/make.log" 2>&1 <<'PY'
import sys, time, torch
sys.path.insert(0, ".bench-shared")
import workload
t = time.time()
torch.set_default_device("cuda")
workload.make_model("llama3-8b", sys.argv[1], dtype="bfloat16")
print(f"made {sys.argv[1]} in {time.time() - t:.0f}s")
PY
    ) &
    maker=$!
}
