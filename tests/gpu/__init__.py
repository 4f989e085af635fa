"""Needs a CUDA GPU; skipped without one (marker gpu)."""
