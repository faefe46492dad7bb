"""kvfleet's C++ kernels (csrc/), each built once per machine and bound through ctypes by
the module of its source's name (paged_decode.py binds csrc/paged_decode.cpp); library.py
builds and loads them, threads.py is the engine's CPU threading they share."""
