"""Checkpoints: the crash-safe layout and resume, the Checkpointer the loop talks to, the background writer
that replaces DeepSpeed's checkpoint engine, parallel file writes, and export to a Hugging Face folder."""
