"""Random Hadamard transform (RHT) used by the NVFP4 recipe on weight-gradient GEMM inputs.

For ``dW = dY^T X`` both operands are contracted over tokens. Multiplying both, along the
token axis, by the same orthogonal block-diagonal matrix ``T`` (16x16 blocks of a Hadamard
matrix with a random sign diagonal, scaled by 1/4) leaves the product unchanged
(``(dY^T T)(X^T T)^T = dY^T X``) but spreads outliers over 16 values before the 4-bit
quantization, which is what makes NVFP4 weight gradients usable.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch


def hadamard_transform_matrix(
    size: int = 16, seed: int = 0, device: Optional[Union[str, torch.device]] = None
) -> torch.Tensor:
    """``diag(signs) @ H_size / sqrt(size)``: an orthogonal fp32 ``[size, size]`` matrix.

    ``H`` comes from Sylvester's construction; ``signs`` are ±1 drawn from a CPU generator
    seeded with ``seed`` (the same seed gives the same transform on every rank and device).
    """
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}.")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (size,), generator=generator).float() * 2 - 1
    return (signs[:, None] * h / size**0.5).to(device)


def random_hadamard_transform(x: torch.Tensor, seed: int = 0, block: int = 16) -> torch.Tensor:
    """Apply the block-diagonal RHT along the last dimension of ``x`` (fp32 result).

    The last dimension must be a multiple of ``block``.
    """
    if x.shape[-1] % block:
        raise ValueError(
            f"The random Hadamard transform works on blocks of {block} along the last dimension; "
            f"got size {x.shape[-1]}. Pad the token dimension to a multiple of {block}."
        )
    t = _cached_matrix(block, seed, x.device)
    return (x.float().reshape(-1, block) @ t).reshape(x.shape)


@functools.lru_cache(maxsize=16)
def _cached_matrix(size: int, seed: int, device: torch.device) -> torch.Tensor:
    # Built once per device: no host-to-device copy on the training hot path.
    return hadamard_transform_matrix(size, seed, device)
