/* One instruction-set form of KilnAttention's arithmetic (attention_kernel.h), compiled twice: over
 * caches of floats (unit##FORM) and of halves (unit##FORM##_f16). The including file defines FORM (the
 * form's suffix, _512 or _256), V16 and its operations, transpose16, and c_load_half(p): sixteen halves
 * widened to floats. */
#define PASTE(a, b) a##b
#define SUFFIXED(a, b) PASTE(a, b)

#define NAME(x) SUFFIXED(x, FORM)
#define CACHE_T float
#define CACHE_HALF 0
#define c_load v_load
#include "attention_kernel.h"
#undef NAME
#undef CACHE_T
#undef CACHE_HALF
#undef c_load

#define NAME(x) SUFFIXED(SUFFIXED(x, FORM), _f16)
#define CACHE_T uint16_t
#define CACHE_HALF 1
#define c_load c_load_half
#include "attention_kernel.h"
#undef NAME
#undef CACHE_T
#undef CACHE_HALF
#undef c_load

#undef SUFFIXED
#undef PASTE
