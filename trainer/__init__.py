"""In-container trainer."""
