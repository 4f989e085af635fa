"""Unit tests: one process, no Docker engine, no cluster; seconds each."""
