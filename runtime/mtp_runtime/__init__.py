"""mtp_runtime: the bundled MTP speculative-decoding runtime (no Kubernetes imports)."""

__version__ = "0.1.0"

# `import mtp_runtime` stays torch-free: the engine loads on first use.
_LAZY_EXPORTS = {
    "LLM": "mtp_runtime.engine.llm",
    "SamplingParams": "mtp_runtime.sampling_params",
    "LLMEngine": "mtp_runtime.engine.llm_engine",
    "EngineConfig": "mtp_runtime.engine.config",
    "RequestOutput": "mtp_runtime.engine.llm_engine",
}


def __getattr__(name: str):
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mtp_runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["__version__", *_LAZY_EXPORTS]
