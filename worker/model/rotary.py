"""Rotary frequency tables, including Llama-3 and linear rope scaling."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, and the band
        # between is interpolated smoothly (Llama 3.1's published recipe).
        low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def cos_sin_table(cfg: ModelConfig, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the head_dim/2 frequencies, then sin."""
    inv_freq = inverse_frequencies(cfg)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
