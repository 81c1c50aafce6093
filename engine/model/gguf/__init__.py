"""GGUF files opened where they lie: the header (`header`), the file and its tensors (`file`), the
transformers config it maps to (`config`), the expert layout (`layout`), conversions of the tensor
types without a kernel (`convert`), DeepSeek's latent attention (`mla`), and the loader (`loader`)."""
