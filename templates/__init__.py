"""Jinja2 templates shipped inside the wheel (sbatch.sh.j2, hostfile.j2); users may override them."""
