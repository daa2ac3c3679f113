#!/usr/bin/env bash
# The fine-tuning example in one command: make its data, tokenizer and base model (once), then
# fine-tune. Arguments go to `trainflow run` (e.g. --set train.epochs=1).
set -euo pipefail
cd "$(dirname "$0")"
BIN=${TRAINFLOW_BIN:-../../.venv/bin}
"$BIN/python" prepare.py
exec "$BIN/trainflow" run finetune.toml "$@"
