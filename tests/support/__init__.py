"""Helpers the tests import or run (never test modules): runner CLI, trainer runs, fake nodes."""
