"""The checks of benchmarks/gpu_check.py, one module each (see its docstring)."""
