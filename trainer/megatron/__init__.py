"""The Megatron-core backend: model, parallel layout, optimizer, checkpoint state."""
