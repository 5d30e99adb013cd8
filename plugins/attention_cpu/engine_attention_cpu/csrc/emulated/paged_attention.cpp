// The paged_attention kernels built a second time, over SIMDe's AVX-512 (setup.py: emulated_extensions); a file of its own so
// that its object file does not collide with the native build's when both compile at once.
#include "../paged_attention.cpp"
