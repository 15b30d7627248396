"""Pipeline-parallel Qwen3.5 serving across several Macs, with native MTP decoding."""

from cluster.grpc_io import choose_io_path

choose_io_path()  # before anything imports grpc: gRPC reads it once, at its first import

__version__ = "0.1.0"
