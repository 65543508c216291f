"""Quantized checkpoints: NVFP4 numerics, ModelOpt configs, tensor validation and export.

Importing this package does not import Triton; the NVFP4 MoE kernel is `dlmc.custom_ops.nvfp4_moe`.
"""
