"""Model definitions and loaders: the Llama architecture, GGUF / HF-directory / preset loading."""
