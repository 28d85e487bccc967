"""SLURM: the one wrapper around its commands, nodelist parsing, and dispatch through submitit."""
