"""Torch starts here: the model runner, its input batch builder, KV tensors and sampler."""
