// The AVX-512 VNNI products (kernels/cpu_quant_vnni.cpp) on SIMDe's portable AVX-512, for cpu_quant_vnni_test: their
// entry points are then panel_products_avx512_vnni_emulated and tile_products_avx512_vnni_emulated.
#define RINGSERVE_EMULATE_AVX512
#include "kernels/cpu_quant_vnni.cpp"  // NOLINT(bugprone-suspicious-include)
