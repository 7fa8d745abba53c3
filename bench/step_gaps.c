/* The compiled one-stream decode step (engine/kernels/csrc/decode_step.c) with a wall clock around
 * every kernel call, for bench/step_gaps.py: how much of a step is the linears' weight reads and how
 * much the calls between them (norms, RoPE, attention, SiLU) and the OpenMP regions around them.
 *
 * Each call's time is kept as its minimum over all steps run (per layer and phase), not a sum: on a
 * machine shared with other jobs a call's best time is steady where its mean is not (two runs 1-2%
 * apart at load 4-5), and the sum of the minima is the step the kernels allow when nothing else runs.
 * CLOCK_MONOTONIC is read through the vDSO (tens of ns a read); CLOCK_THREAD_CPUTIME_ID is a system
 * call (~0.5 us a read in this VM: as much as a norm), so no CPU clock here.
 *
 *   built by bench/step_gaps.py with engine.kernels.build's flags; the step's calls are decode_step's,
 *   in its order (run_linear, run_attention: the same static functions, included below). */
#include "../engine/kernels/csrc/decode_step.c"
#include <omp.h>
#include <time.h>

/* the kernel calls of a layer, in step order; the final norm is phase PHASE_NORM1 of row n_layers */
enum { PHASE_NORM1, PHASE_WQKV, PHASE_ROPE, PHASE_ATTENTION, PHASE_WO, PHASE_NORM2, PHASE_W13, PHASE_SILU, PHASE_W2, STEP_PHASES };
int step_phases(void) { return STEP_PHASES; }

static double wall_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* `stmt`'s wall time folded into min_ns[layer][phase] */
#define TIMED(phase, layer, stmt)                                                                   \
    do {                                                                                            \
        const double started_ns = wall_ns();                                                        \
        stmt;                                                                                       \
        double *slot_ns = min_ns + (layer) * STEP_PHASES + (phase);                                 \
        const double took_ns = wall_ns() - started_ns;                                              \
        if (took_ns < *slot_ns) *slot_ns = took_ns;                                                 \
    } while (0)

/* decode_step, call for call, each call timed. min_ns: [n_layers + 1][STEP_PHASES], the caller's
 * (set to a large value before the first step). Returns what decode_step returns. */
int decode_step_gaps(const step_program *p, void *residual, void *out, const step_tokens *t, int threads, double *min_ns) {
    const step_kernels *kn = p->kernels;
    const step_scratch *s = p->scratch;
    const int bf16 = (int)p->bf16;
    const int64_t rows = t->rows;
    if (rows < 1 || rows > p->max_rows) return -2;
    const void *delta = NULL;
    int rc;
    for (int64_t i = 0; i < p->n_layers; i++) {
        const step_layer *l = p->layers + i;
        TIMED(PHASE_NORM1, i, kn->add_rms_norm(bf16, residual, delta, l->attention_norm, s->normed, rows, p->dim, p->eps, threads));
        TIMED(PHASE_WQKV, i, rc = run_linear(p, &l->wqkv, s->normed, s->qkv, rows, threads));
        if (rc) return rc;
        TIMED(PHASE_ROPE, i, kn->rope_and_cache_write(bf16, s->qkv, rows, p->heads, p->kv_heads, p->head_dim, t->position, t->rope, t->slot, l->k_cache, l->v_cache, threads));
        TIMED(PHASE_ATTENTION, i, rc = run_attention(p, l, t, threads));
        if (rc) return rc;
        TIMED(PHASE_WO, i, rc = run_linear(p, &l->wo, s->attn, s->attn_out, rows, threads));
        if (rc) return rc;
        TIMED(PHASE_NORM2, i, kn->add_rms_norm(bf16, residual, s->attn_out, l->ffn_norm, s->normed, rows, p->dim, p->eps, threads));
        TIMED(PHASE_W13, i, rc = run_linear(p, &l->w13, s->normed, s->gate_up, rows, threads));
        if (rc) return rc;
        TIMED(PHASE_SILU, i, kn->silu_mul(bf16, s->gate_up, s->act, rows, p->hidden, threads));
        TIMED(PHASE_W2, i, rc = run_linear(p, &l->w2, s->act, s->ffn_out, rows, threads));
        if (rc) return rc;
        delta = s->ffn_out;
    }
    TIMED(PHASE_NORM1, p->n_layers, kn->add_rms_norm(bf16, residual, delta, p->final_norm, out, rows, p->dim, p->eps, threads));
    return 0;
}

/* What the step's OpenMP regions cost with nothing in them: mean wall ns over `count` in a row (the
 * script keeps the best of many such batches). */
static volatile int region_sink; /* a store each region body keeps */

/* a region of `threads` as each linear and attention opens (parallel 1), or one whose if() is false
 * as the one-row norms, RoPE and SiLU open (parallel 0: libgomp still builds a team of one) */
double region_ns(int threads, int parallel, int count) {
    const double started_ns = wall_ns();
    for (int i = 0; i < count; i++) {
#pragma omp parallel num_threads(threads) if (parallel)
        region_sink = 1;
    }
    return (wall_ns() - started_ns) / count;
}

double barrier_ns(int threads, int count) { /* a barrier inside one region: what one region a step would pay instead */
    const double started_ns = wall_ns();
#pragma omp parallel num_threads(threads)
    for (int i = 0; i < count; i++) {
#pragma omp barrier
    }
    return (wall_ns() - started_ns) / count;
}
