"""Hugging Face checkpoints in and out: `python -m MaxOffload.convert --help` (convert/__main__.py)."""
