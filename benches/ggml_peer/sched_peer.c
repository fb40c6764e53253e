// ggml's scheduler on the MiniLM-shaped encoder of `benches/common/minilm.rs` (6 layers,
// hidden 384, 12 heads, intermediate 1536, sequence 128, f16 weights in a weights buffer), on
// the CPU backend: the peer of `cargo bench --bench sched`. See README.md for building.
//
// Usage: sched_peer [iterations] [case]
//   case: all (default), split, alloc_new, alloc_same (one case only, for callgrind).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

enum { LAYERS = 6, HIDDEN = 384, HEADS = 12, HEAD_DIM = HIDDEN / HEADS, FFN = 1536, SEQ = 128 };

struct layer {
    struct ggml_tensor *w[6], *b[6], *ln[4];
};

static struct layer layers[LAYERS];

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

// Weight tensors in their own context, allocated in one CPU buffer marked as weights.
static ggml_backend_buffer_t make_weights(struct ggml_context **out_ctx, ggml_backend_t cpu) {
    struct ggml_init_params p = {ggml_tensor_overhead() * LAYERS * 16 + 1024, NULL, true};
    struct ggml_context *ctx = ggml_init(p);
    for (int l = 0; l < LAYERS; l++) {
        struct layer *L = &layers[l];
        for (int i = 0; i < 4; i++) L->w[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, HIDDEN, HIDDEN);
        L->w[4] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, HIDDEN, FFN);
        L->w[5] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, FFN, HIDDEN);
        for (int i = 0; i < 6; i++) L->b[i] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, i == 4 ? FFN : HIDDEN);
        for (int i = 0; i < 4; i++) L->ln[i] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, HIDDEN);
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, cpu);
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    *out_ctx = ctx;
    return buf;
}

static struct ggml_tensor *proj(struct ggml_context *ctx, struct layer *L, int i, struct ggml_tensor *x) {
    return ggml_add(ctx, ggml_mul_mat(ctx, L->w[i], x), L->b[i]);
}

// A fresh encoder graph in a fresh no-alloc context (freed by the caller).
static struct ggml_cgraph *encoder(struct ggml_context **out_ctx) {
    struct ggml_init_params p = {ggml_tensor_overhead() * 1024 + ggml_graph_overhead_custom(512, false), NULL, true};
    struct ggml_context *ctx = ggml_init(p);
    const int batch = 1;
    struct ggml_tensor *x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, HIDDEN, SEQ, batch);
    ggml_set_input(x);
    ggml_set_name(x, "embeddings");
    struct ggml_tensor *mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, SEQ, SEQ);
    ggml_set_input(mask);
    ggml_set_name(mask, "mask");
    const float scale = 1.0f / sqrtf((float)HEAD_DIM);
    for (int l = 0; l < LAYERS; l++) {
        struct layer *L = &layers[l];
        struct ggml_tensor *q = ggml_permute(ctx, ggml_reshape_4d(ctx, proj(ctx, L, 0, x), HEAD_DIM, HEADS, SEQ, batch), 0, 2, 1, 3);
        struct ggml_tensor *k = ggml_permute(ctx, ggml_reshape_4d(ctx, proj(ctx, L, 1, x), HEAD_DIM, HEADS, SEQ, batch), 0, 2, 1, 3);
        struct ggml_tensor *v = ggml_reshape_4d(ctx, proj(ctx, L, 2, x), HEAD_DIM, HEADS, SEQ, batch);
        v = ggml_cont(ctx, ggml_permute(ctx, v, 1, 2, 0, 3));
        struct ggml_tensor *kq = ggml_soft_max_ext(ctx, ggml_mul_mat(ctx, k, q), mask, scale, 0.0f);
        struct ggml_tensor *kqv = ggml_mul_mat(ctx, v, kq);
        struct ggml_tensor *merged = ggml_cont_3d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), HIDDEN, SEQ, batch);
        struct ggml_tensor *h = ggml_add(ctx, proj(ctx, L, 3, merged), x);
        h = ggml_norm(ctx, h, 1e-12f);
        h = ggml_add(ctx, ggml_mul(ctx, h, L->ln[0]), L->ln[1]);
        struct ggml_tensor *ff = ggml_gelu(ctx, proj(ctx, L, 4, h));
        struct ggml_tensor *out = ggml_add(ctx, proj(ctx, L, 5, ff), h);
        out = ggml_norm(ctx, out, 1e-12f);
        x = ggml_add(ctx, ggml_mul(ctx, out, L->ln[2]), L->ln[3]);
    }
    ggml_set_output(x);
    ggml_set_name(x, "hidden_states");
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, 512, false);
    ggml_build_forward_expand(gf, x);
    *out_ctx = ctx;
    return gf;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *name, double *t, int n) {
    qsort(t, n, sizeof *t, cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += t[i];
    printf("%-28s median %7.2f us  mean %7.2f us  min %7.2f us  (%d iterations)\n", name, t[n / 2], sum / n, t[0], n);
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 2000;
    const char *which = argc > 2 ? argv[2] : "all";
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, 1);
    struct ggml_context *wctx;
    ggml_backend_buffer_t wbuf = make_weights(&wctx, cpu);
    ggml_backend_t backends[1] = {cpu};
    ggml_backend_sched_t sched = ggml_backend_sched_new(backends, NULL, 1, 512, false, false);
    struct ggml_context *gctx;
    struct ggml_cgraph *graph = encoder(&gctx);
    if (!ggml_backend_sched_reserve(sched, graph)) {
        fprintf(stderr, "reserve failed\n");
        return 1;
    }
    printf("ggml MiniLM encoder: %d nodes, %d splits, compute buffer %zu bytes\n", ggml_graph_n_nodes(graph),
           ggml_backend_sched_get_n_splits(sched), ggml_backend_sched_get_buffer_size(sched, cpu));
    double *t = malloc(sizeof(double) * iters);
    int all = strcmp(which, "all") == 0;

    // A freshly built graph split (no allocation), as ferrograph's split_new_graph.
    if (all || strcmp(which, "split") == 0) {
        for (int i = 0; i < iters; i++) {
            struct ggml_context *c;
            struct ggml_cgraph *g = encoder(&c);
            double t0 = now_us();
            ggml_backend_sched_reset(sched);
            ggml_backend_sched_split_graph(sched, g);
            t[i] = now_us() - t0;
            ggml_free(c);
        }
        report("split_new_graph", t, iters);
    }
    // A freshly built graph reset + allocated (split included), as reset_alloc_rebuilt_graph.
    if (all || strcmp(which, "alloc_new") == 0) {
        for (int i = 0; i < iters; i++) {
            struct ggml_context *c;
            struct ggml_cgraph *g = encoder(&c);
            double t0 = now_us();
            ggml_backend_sched_reset(sched);
            if (!ggml_backend_sched_alloc_graph(sched, g)) return 1;
            t[i] = now_us() - t0;
            ggml_backend_sched_reset(sched);
            ggml_free(c);
        }
        report("reset_alloc_rebuilt_graph", t, iters);
    }
    // The same graph reset + allocated again, as reset_alloc_same_graph.
    if (all || strcmp(which, "alloc_same") == 0) {
        for (int i = 0; i < iters; i++) {
            double t0 = now_us();
            ggml_backend_sched_reset(sched);
            if (!ggml_backend_sched_alloc_graph(sched, graph)) return 1;
            t[i] = now_us() - t0;
        }
        report("reset_alloc_same_graph", t, iters);
    }
    free(t);
    ggml_backend_sched_free(sched);
    ggml_free(gctx);
    ggml_backend_buffer_free(wbuf);
    ggml_free(wctx);
    ggml_backend_free(cpu);
    return 0;
}
