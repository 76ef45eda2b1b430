"""GPU kernels and the Python ops around them (torch, triton, numpy, safetensors only)."""
