"""The default model's GGUF (SmolLM2-135M-Instruct, Q4_1) as an fp32 Hugging Face directory, for the peers that
load one (transformers, vLLM): $PEERS_HOME/models/smollm2-135m-instruct. Run in venv-hf (setup_peers.sh does).

transformers dequantizes the GGUF's blocks to fp32 as it loads them; the directory then holds those same weights,
so every engine runs the numbers petrel runs from the GGUF."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as peers  # noqa: E402


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(peers.GGUF_Q4_1)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # saved as a plain fp32 checkpoint: nothing left that marks it as quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    # the GGUF stores the norm epsilon as a float32 (9.99999975e-06); the model was trained with 1e-5
    model.config.rms_norm_eps = 1e-5
    wrong = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"})
    if wrong:
        raise SystemExit(f"expected fp32 weights after loading, found {wrong}")
    os.makedirs(peers.MODEL_DIR, exist_ok=True)
    model.save_pretrained(peers.MODEL_DIR, safe_serialization=True)
    tokenizer.save_pretrained(peers.MODEL_DIR)
    print(f"wrote {peers.MODEL_DIR}: {', '.join(sorted(os.listdir(peers.MODEL_DIR)))}")


if __name__ == "__main__":
    main()
