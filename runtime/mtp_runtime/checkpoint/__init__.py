"""Hugging Face checkpoint layout: published configs and tensor names, FP8 blocks,
safetensors reading/writing, tokenizer and corpus for tiny test checkpoints."""
