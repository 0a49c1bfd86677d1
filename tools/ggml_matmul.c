// A peer for `python -m paged_qkv.bench --ggml BIN`: ggml's CPU matmul (llama.cpp's) on the
// benchmark's shapes, timed the same way (median per call over a time budget).
//
// Build against a llama.cpp checkout (tools/peers.sh does it):
//   cc -O2 tools/ggml_matmul.c -I$LLAMA/ggml/include $BUILD/ggml/src/libggml*.a \
//      -lstdc++ -lm -lpthread -fopenmp -o ggml_matmul
// Run: ggml_matmul K N M TYPE THREADS SECONDS   (TYPE: q4_0, q8_0, bf16, f32)
// Prints one line: "K N M TYPE THREADS median_seconds".
//
// ggml computes Y[M, N] = X[M, K] · W[N, K]ᵀ with X in f32, which it converts per call to the
// weight's dot type (q8_0 for q4_0/q8_0, bf16 for bf16): that conversion is part of its time, as
// in llama.cpp.

#include "ggml-cpu.h"
#include "ggml.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int cmp(const void * a, const void * b) {
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

int main(int argc, char ** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s K N M TYPE(q4_0|q8_0|bf16|f32) THREADS SECONDS\n", argv[0]);
        return 2;
    }
    const int64_t k = atoll(argv[1]), n = atoll(argv[2]), m = atoll(argv[3]);
    const char * tname = argv[4];
    const int threads = atoi(argv[5]);
    const double budget = atof(argv[6]);
    enum ggml_type type;
    if (!strcmp(tname, "q4_0")) type = GGML_TYPE_Q4_0;
    else if (!strcmp(tname, "q8_0")) type = GGML_TYPE_Q8_0;
    else if (!strcmp(tname, "bf16")) type = GGML_TYPE_BF16;
    else if (!strcmp(tname, "f32")) type = GGML_TYPE_F32;
    else {
        fprintf(stderr, "unknown type %s\n", tname);
        return 2;
    }
    if (k <= 0 || n <= 0 || m <= 0 || threads <= 0 || k % 32) {
        fprintf(stderr, "K, N, M and THREADS must be positive, K a multiple of 32\n");
        return 2;
    }
    const size_t wbytes = ggml_row_size(type, k) * n;
    struct ggml_init_params p = {
        // The weight, X and Y, the graph, and room for the work buffer ggml plans per call.
        .mem_size = wbytes + 2 * (size_t) (m * k + m * n) * sizeof(float) + ggml_graph_overhead() + (256u << 20),
        .mem_buffer = NULL,
        .no_alloc = false,
    };
    struct ggml_context * ctx = ggml_init(p);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, k, n);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    float * src = malloc(sizeof(float) * (size_t) (k * n));
    unsigned s = 12345;
    for (int64_t i = 0; i < k * n; i++) {
        s = s * 1664525u + 1013904223u;
        src[i] = ((float) (s >> 8) / (float) (1u << 24) - 0.5f) * 0.05f;
    }
    if (type == GGML_TYPE_F32) memcpy(w->data, src, sizeof(float) * (size_t) (k * n));
    else if (type == GGML_TYPE_BF16) ggml_fp32_to_bf16_row(src, (ggml_bf16_t *) w->data, k * n);
    else ggml_quantize_chunk(type, src, w->data, 0, n, k, NULL);
    float * xs = (float *) x->data;
    for (int64_t i = 0; i < k * m; i++) {
        s = s * 1664525u + 1013904223u;
        xs[i] = (float) (s >> 8) / (float) (1u << 24) - 0.5f;
    }
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_graph_compute_with_ctx(ctx, gf, threads);  // warm-up
    int cap = 100000, count = 0;
    double * times = malloc(sizeof(double) * cap);
    const double end = now() + budget;
    while (count < 5 || (now() < end && count < cap)) {
        double t = now();
        ggml_graph_compute_with_ctx(ctx, gf, threads);
        times[count++] = now() - t;
    }
    qsort(times, count, sizeof(double), cmp);
    printf("%lld %lld %lld %s %d %.9f\n", (long long) k, (long long) n, (long long) m, tname, threads, times[count / 2]);
    free(times);
    free(src);
    ggml_free(ctx);
    return 0;
}
