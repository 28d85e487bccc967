"""hpctrain: launch DeepSpeed training of large language models on SLURM clusters."""

__version__ = "0.1.0"
