"""What a trainer process stands on: who it is in the job (dist_env: rank, world, process group),
what its container may use (container_limits), a full disk in one line (full_disk), the garbage
collector's schedule (gc_schedule), experiment tracking (tracking), and the test-only hold point
(hold). Imports only the config below it."""
