"""What every layer of the runner stands on: errors and exit codes (errors), bounded parallel
per-node work (fanout), bytes from nodes made harmless (node_output), untrusted relative paths
(safe_path), run ids (runs), secrets masked (redact), where a node keeps the runner's files
(paths). Imports nothing of the runner above it."""
