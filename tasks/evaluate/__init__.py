"""The evaluate stage."""
