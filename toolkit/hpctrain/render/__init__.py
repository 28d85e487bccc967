"""Pure functions from (spec, plan) to what a job runs: sbatch script, hostfile, DeepSpeed config, container lines."""
