"""C++ kernels for the CPU (csrc/*.cpp) and their builder/loader (build.py)."""
