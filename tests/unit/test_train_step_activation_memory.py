"""`benchmarks/train_step.py`'s activation memory (`ActivationMemory`): the measured steps' peak of
allocated CUDA memory minus the static memory, what is allocated just before each measured
optimizer step (weight-cast caches made in a step's first forward included), marked by the
Lightning callback from the first micro-batch after the warm-up, the run's peak still covering the
warm-up. The CUDA allocator statistics are simulated here; on CPU the figures are None."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.train_step import ActivationMemory, activation_memory_callback, memory_callbacks  # noqa: E402

GIB = 2**30


class FakeAllocator:
    """`torch.cuda`'s allocated-memory statistics driven by `allocate` / `free`."""

    def __init__(self, monkeypatch) -> None:
        self.allocated = self.peak = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)

    def reset_peak(self, *a) -> None:
        self.peak = self.allocated

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def step(self, activations: int) -> None:
        self.allocate(activations)
        self.free(activations)


def test_activation_memory_is_the_measured_peak_over_the_static_memory(monkeypatch):
    alloc = FakeAllocator(monkeypatch)
    tracker = ActivationMemory()
    alloc.allocate(10 * GIB)  # parameters
    alloc.step(7 * GIB)  # warm-up: its first step peaks higher than the measured ones
    alloc.allocate(20 * GIB)  # gradients and optimizer states, made in the warm-up
    tracker.measured_start()
    for _ in range(3):
        alloc.allocate(2 * GIB)  # the step's weight casts, made in its first forward
        alloc.step(3 * GIB)
        tracker.before_optimizer_step()
        alloc.free(2 * GIB)  # dropped at the optimizer step
    tracker.measured_end()
    figures = tracker.figures()
    # static: 30 GiB of states and 2 of casts; not the 30 allocated when the steps started
    assert figures == {"static_gib": 32.0, "measured_peak_gib": 35.0, "activation_gib": 3.0}
    assert tracker.run_peak() == 35 * GIB  # the warm-up's 17 GiB stays below
    alloc.step(40 * GIB)  # after the measured steps: the run's peak, not the measured one
    assert tracker.run_peak() == 70 * GIB and tracker.figures()["activation_gib"] == 3.0
    tracker.reset()
    assert tracker.figures()["activation_gib"] is None


def test_the_warm_up_optimizer_steps_set_no_static_memory(monkeypatch):
    alloc = FakeAllocator(monkeypatch)
    tracker = ActivationMemory()
    alloc.allocate(9 * GIB)
    tracker.before_optimizer_step()  # a warm-up step: not measured
    alloc.free(8 * GIB)
    tracker.measured_start()
    alloc.step(GIB)
    tracker.before_optimizer_step()
    tracker.measured_end()
    assert tracker.figures() == {"static_gib": 1.0, "measured_peak_gib": 2.0, "activation_gib": 1.0}


def test_the_callback_marks_the_first_micro_batch_after_the_warm_up(monkeypatch):
    alloc = FakeAllocator(monkeypatch)
    args = argparse.Namespace(warmup=2, accumulate=3, offload=None)
    tracker = ActivationMemory()
    callback = activation_memory_callback(args, tracker)
    alloc.allocate(5 * GIB)
    for batch_idx in range(4 * args.accumulate):  # 2 warm-up and 2 measured optimizer steps
        callback.on_train_batch_start(None, None, None, batch_idx)
        if batch_idx == args.warmup * args.accumulate - 1:
            alloc.allocate(GIB)  # optimizer states, in the last warm-up micro-batch
        alloc.step(2 * GIB if batch_idx < args.warmup * args.accumulate else GIB)
        if batch_idx % args.accumulate == args.accumulate - 1:
            callback.on_before_optimizer_step(None, None, None)
    callback.on_train_end(None, None)
    assert tracker.figures() == {"static_gib": 6.0, "measured_peak_gib": 7.0, "activation_gib": 1.0}
    assert tracker.run_peak() == 8 * GIB
    assert type(memory_callbacks(args)[0]).__name__ == "MarkMeasuredSteps"


def test_no_figures_off_cuda():
    tracker = ActivationMemory()
    tracker.measured_start()
    tracker.measured_end()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert tracker.figures() == {"static_gib": None, "measured_peak_gib": None, "activation_gib": None}
        assert tracker.run_peak() is None
