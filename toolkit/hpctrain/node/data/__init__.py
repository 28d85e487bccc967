"""The rank's training data: tokenizers, prepared (memory-mapped) folders, the epoch plan, and the loader whose
micro-batches are a pure function of their index."""
