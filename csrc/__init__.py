"""The csrc CPU kernels' C++ sources, shipped in every install so that a worker can build them for its CPU
(worker/csrc_ops.py; csrc/README.md). Nothing here is Python to import."""
