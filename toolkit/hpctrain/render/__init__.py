"""Pure functions from (spec, plan) to the files a job runs: sbatch script, hostfile, the DeepSpeed config, container lines."""
