// The AVX-512 VNNI panels (kernels/cpu_quant_panels_vnni.cpp) on SIMDe's portable AVX-512, for
// cpu_quant_vnni_test: their entry point is then panel_products_avx512_vnni_emulated.
#define RINGSERVE_EMULATE_AVX512
#include "kernels/cpu_quant_panels_vnni.cpp"  // NOLINT(bugprone-suspicious-include)
