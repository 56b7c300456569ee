/* What the sampler's two files share: the export mark, and the pieces of sampling.c (the exact
   arithmetic) that sampling_bounded.c (the bounded draw) calls. */
#ifndef KILN_SAMPLING_H
#define KILN_SAMPLING_H

#include <stdint.h>
#include <stddef.h>

#if defined(_WIN32)
#define KILN_EXPORT __declspec(dllexport)
#else
#define KILN_EXPORT __attribute__((visibility("default")))
#endif

/* top-p's cut of p [n]: how many it keeps (n + 1: no sum reaches top_p), marks[i] = 1 for each kept */
KILN_EXPORT int64_t kiln_top_p(const double *p, int64_t n, double top_p, unsigned char *marks, uint64_t *scratch);
/* top-p's cut of p [n] as kiln_top_p takes it: how many it keeps, the least value kept, how many of
   the values equal to it are kept of how many */
int64_t kiln_top_p_cut(const double *p, int64_t n, double top_p, double *threshold, int64_t *equal, int64_t *ties,
                       uint64_t *scratch);
/* a min-heap of k values with ``at`` out of place below, moved down */
void kiln_sift_down(double *heap, int64_t k, int64_t at);
/* (ids, probs) [m] compacted to the marked ones, in order; their number */
int64_t kiln_compact(int64_t *ids, double *probs, int64_t m, const unsigned char *marked);

#endif
