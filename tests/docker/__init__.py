"""Tests that need this machine's Docker engine (scripts/setup.sh starts it) but no cluster."""
