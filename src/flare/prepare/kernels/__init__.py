"""Capture-safe Triton kernels for the prepared programs.

Every kernel here reads lengths, positions, slots and page ids from device
tensors; its launch grid depends only on static shapes, so one CUDA-graph
capture serves every later step. Importing a submodule imports Triton, so the
reference path (CPU, no Triton) never imports this package's submodules.
"""
