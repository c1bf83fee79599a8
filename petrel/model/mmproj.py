"""llama.cpp's vision projector GGUF (`llama-server -m text.gguf --mmproj mmproj.gguf`) for Idefics3 / SmolVLM: its
clip.* keys back to a Hugging Face Idefics3 config, its tensors back to the published Hugging Face names, so that
petrel/model/idefics3.py loads it as it loads a Hugging Face directory. The text model is the llama GGUF beside it
(petrel/model/loader.py); the image processor's settings come from the mmproj keys (processor_config)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

PROJECTOR = "idefics3"
VISION = "model.vision_model."
# llama.cpp name -> Hugging Face name (llama.cpp's gguf-py tensor_mapping, SmolVLM rows)
TOP_NAMES = {
    "v.patch_embd": VISION + "embeddings.patch_embedding",
    "v.position_embd": VISION + "embeddings.position_embedding",
    "v.post_ln": VISION + "post_layernorm",
    "mm.model.fc": "model.connector.modality_projection.proj",
}
# v.blk.N.<llama.cpp> -> model.vision_model.encoder.layers.N.<Hugging Face>
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
# clip.vision.* key -> SigLIP vision_config field (all needed)
VISION_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "image_size": "image_size",
    "patch_size": "patch_size",
}


class MmprojError(ValueError):
    """A bad mmproj (or text model for it): raised as it is, naming the key, tensor or model."""


class Mmproj:
    """An mmproj GGUF file, checked: an idefics3 projector with every key and tensor petrel needs."""

    def __init__(self, path: str):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as exc:
            raise MmprojError(f"mmproj {path!r}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.meta = {key: field.contents() for key, field in self.reader.fields.items()}
        kind = self.meta.get("clip.projector_type", self.meta.get("clip.vision.projector_type"))
        if kind != PROJECTOR:
            raise MmprojError(
                f"mmproj {path!r}: clip.projector_type is {kind!r}; petrel reads {PROJECTOR!r} projectors "
                f"(Idefics3 / SmolVLM)"
            )
        self.vision = {field: int(self._key(f"clip.vision.{key}")) for key, field in VISION_KEYS.items()}
        self.vision["layer_norm_eps"] = float(self.meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6))
        self.scale_factor = int(self._key("clip.vision.projector.scale_factor"))
        self.tensors = {t.name: t for t in self.reader.tensors}
        for name in self.expected_tensors():
            if name not in self.tensors:
                raise MmprojError(f"mmproj {path!r}: tensor {name!r} is missing")

    def _key(self, key: str):
        if key not in self.meta:
            raise MmprojError(f"mmproj {self.path!r}: key {key!r} is missing")
        return self.meta[key]

    def expected_tensors(self) -> list[str]:
        names = ["v.position_embd.weight", "mm.model.fc.weight"]
        for base in ("v.patch_embd", "v.post_ln"):
            names += [f"{base}.weight", f"{base}.bias"]
        for i in range(self.vision["num_hidden_layers"]):
            names += [f"v.blk.{i}.{short}.{kind}" for short in BLOCK_NAMES for kind in ("weight", "bias")]
        return names

    def hf_config(self, text: dict) -> dict:
        """The Hugging Face Idefics3 config (the shape of a published config.json); text: its text_config."""
        return {
            "architectures": ["Idefics3ForConditionalGeneration"],
            "model_type": "idefics3",
            "text_config": {"model_type": "llama", **text},
            "vision_config": dict(self.vision),
            "scale_factor": self.scale_factor,
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
        }

    def processor_config(self) -> dict:
        """processor_config.json's shape: the image processor's settings (tile side = the tower's image_size; the
        resize bound = clip.vision.preproc_image_size, else 4 tiles a side as SmolVLM's; mean/std from the file,
        else Idefics3's 0.5) and image_seq_len (the connector's rows per tile)."""
        side = int(self.vision["image_size"])
        kwargs = {
            "size": {"longest_edge": int(self.meta.get("clip.vision.preproc_image_size", 4 * side))},
            "max_image_size": {"longest_edge": side},
        }
        for key in ("image_mean", "image_std"):
            if f"clip.vision.{key}" in self.meta:
                kwargs[key] = [float(v) for v in self.meta[f"clip.vision.{key}"]]
        patches = side // int(self.vision["patch_size"])
        return {"image_processor": kwargs, "image_seq_len": patches * patches // self.scale_factor**2}

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) of each tensor petrel uses (F32, F16 or any block type gguf reads)."""
        from gguf.quants import dequantize

        for name in self.expected_tensors():
            t = self.tensors[name]
            base, kind = name.rsplit(".", 1)
            if base.startswith("v.blk."):
                _, _, layer, short = base.split(".")
                hf = f"{VISION}encoder.layers.{layer}.{BLOCK_NAMES[short]}"
            else:
                hf = TOP_NAMES[base]
            data = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            yield f"{hf}.{kind}", torch.from_numpy(np.array(data, dtype=np.float32))


def text_config(cfg) -> dict:
    """The Hugging Face text_config of a GGUF text model's ModelConfig (what the connector needs: hidden_size)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def with_mmproj(cfg, path: str):
    """The text GGUF's ModelConfig made the Idefics3 model's: a llama text model only."""
    if cfg.architecture != "LlamaForCausalLM":
        raise MmprojError(
            f"mmproj: the text model is a {cfg.architecture} GGUF; an {PROJECTOR} mmproj goes with a llama text GGUF "
            f"(Idefics3 / SmolVLM)"
        )
    cfg.multimodal_config = Mmproj(path).hf_config(text_config(cfg))
    cfg.architecture = "Idefics3ForConditionalGeneration"
    return cfg
