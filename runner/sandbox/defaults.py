"""Where the sandbox clusters live by default: plain constants, importable without the sandbox's
own modules (the command line's parser shows them in `runner sandbox up --help`)."""

DEFAULT_BASE_ADDR = "127.0.0.11"          # node 0's address; node i at base + i
DEFAULT_PORT = 2222                       # sshd port on every node
ROOT = "root"                             # the login user unless --user
DEFAULT_SLURM_BASE_ADDR = "127.0.0.31"    # the Slurm sandbox's login node; node i at base + 1 + i
