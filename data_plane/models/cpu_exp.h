/* e^x in plain arithmetic the compiler vectorizes (the C library's expf is one call per value):
 * 2^(x log2 e) as an exponent and a degree-7 polynomial of the fraction, ~3e-7 relative, x
 * clamped to [-80, 80]. Included by the CPU kernels that need it (cpu_kernels.py hashes it with
 * their sources). */
#ifndef SUPERINFER_CPU_EXP_H
#define SUPERINFER_CPU_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_approx(float x) {
    x = x < -80.0f ? -80.0f : (x > 80.0f ? 80.0f : x);
    float t = x * 1.44269504f, whole = floorf(t), f = t - whole;
    float p = 1.5252733e-5f;
    p = p * f + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)whole * (1 << 23);
    memcpy(&p, &bits, sizeof p);
    return p;
}

#endif
