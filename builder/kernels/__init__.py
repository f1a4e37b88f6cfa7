"""CUDA sources cudaenv compiles in an env to prove its toolkit: ``topk_topp.cu``, the
top-k/top-p sampling kernel of the ``kernel-compile`` and ``sampling`` checks.
"""
