"""Lightning callbacks: CUDA-graph capture, activation offload, dynamic context-parallel sizing, MoE
routing statistics, throughput / MFU and the progress bar."""

from lightning_moe.callbacks.activation_offload import ActivationOffload
from lightning_moe.callbacks.cuda_graphs import CUDAGraphs
from lightning_moe.callbacks.dynamic_cp import DynamicContextParallel
from lightning_moe.callbacks.moe_monitor import MoEMonitor
from lightning_moe.callbacks.progress import MoEProgressBar
from lightning_moe.callbacks.throughput import PEAK_FLOPS, MoEThroughput

__all__ = [
    "PEAK_FLOPS",
    "ActivationOffload",
    "CUDAGraphs",
    "DynamicContextParallel",
    "MoEMonitor",
    "MoEProgressBar",
    "MoEThroughput",
]
