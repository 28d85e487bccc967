"""The rank side: what every rank runs (distributed start, model, data, DeepSpeed engine, checkpoints,
heartbeats, metrics). Imports nothing from the login side (contract rank-side in pyproject.toml)."""
