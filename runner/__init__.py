"""Host-side orchestrator."""
