"""Pipeline-parallel Qwen3.5 serving across several Macs, with native MTP decoding."""

__version__ = "0.1.0"
