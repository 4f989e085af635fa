"""The trainer's subcommands besides training: `trainer --dry-run` (dry_run), `trainer probe`
(probe, probe_link), `trainer plot` (plots), and shell completion (completion)."""
