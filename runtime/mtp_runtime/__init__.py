"""mtp_runtime: the bundled MTP speculative-decoding runtime (no Kubernetes imports)."""

__version__ = "0.1.0"
