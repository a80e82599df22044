"""Hugging Face <-> Megatron torch_dist checkpoint conversion, inspection and verification."""
