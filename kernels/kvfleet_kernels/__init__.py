"""kvfleet kernels: plain PyTorch references (the CPU path and every kernel's oracle) and Triton kernels."""
