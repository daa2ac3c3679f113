"""Stage work for trainflow: preprocess, train, evaluate, and MLflow tracking helpers."""
