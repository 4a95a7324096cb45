"""The speculative engine: paged KV cache, continuous batching, MTP drafting.

sequence.py, block_manager.py and scheduler.py are plain Python (no torch);
all tensor work lives in sampler.py and model_runner.py.
"""
