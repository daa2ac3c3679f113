"""Development infrastructure: a real single-node Slurm cluster on loopback (slurm.sh)."""
