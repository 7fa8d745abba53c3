"""The C kernels and their Python side, one package:

- csrc/: the C sources by family over one shared header (vec.h: bfloat16, 16-lane vectors, rows,
  exp, AMX tile setup). elementwise.c, attention.c, linear.c and argmax.c make the cpu_kernels
  library; amx_linear.c, quant_kernels.c and decode_step.c one library each.
- build.py: building and caching those libraries (or finding them prebuilt per x86-64 level).
- the bindings, one module per library: cpu.py (norm, RoPE + cache write, SiLU-mul, paged
  attention, interleaved linear, argmax), amx.py (AMX linear), quant.py (low-bit linears), and the
  compiled decode step's.
- memory.py: CPU resident memory (oneDNN row buckets, huge-page weight arenas, idle heap trim).
"""
