"""Prefect flows and the trainflow command line. Flows compose stages; they never compute."""
