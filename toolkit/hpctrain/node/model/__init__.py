"""The model DeepSpeed trains: built from a local folder or config, its attention kernel, LoRA/QLoRA adapters,
pipeline stages, and the ZeRO-3 CPU-offload step fixes (with the host-memory pinning they use)."""
