"""MX operations as torch.library custom ops; CPU runs the reference, CUDA runs the kernels."""
