"""Against the Slurm sandbox: slurmctld + several slurmd on this machine (marker slurm)."""
