"""The preprocess stage."""
