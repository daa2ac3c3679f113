"""The train stage."""
