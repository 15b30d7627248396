"""Decoding: the engine, the pipelines it drives, the tail's sampling and verification."""
