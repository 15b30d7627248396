"""Pipeline-parallel Qwen3.5 serving across several Macs, with native MTP decoding."""

from cluster.lazy_mlx_lm import defer_package_init
from cluster.transport.grpc_io import choose_io_path

choose_io_path()  # before anything imports grpc: gRPC reads it once, at its first import
defer_package_init()  # before anything imports mlx-lm: its package body waits for a use

__version__ = "0.1.0"
