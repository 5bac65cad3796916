"""Lightning callbacks: MoE routing statistics and throughput / MFU."""

from lightning_moe.callbacks.moe_monitor import MoEMonitor
from lightning_moe.callbacks.throughput import PEAK_FLOPS, MoEThroughput

__all__ = ["PEAK_FLOPS", "MoEMonitor", "MoEThroughput"]
