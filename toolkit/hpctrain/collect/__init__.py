"""sacct records, events, logs and metrics turned into one summary per run."""
