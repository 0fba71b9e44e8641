/* deskchat's decode step in C: one call runs every layer of a Llama/Qwen2-style decoder
 * over the rows of a step (a token per decoding stream, drafted tokens, prompt chunks).
 *
 * Why: the torch step is ~1,800 eager ops, each paying its dispatch at one row; here a
 * layer is ten passes over a persistent thread pool (dc_forward; docs/native.md).
 *
 * Batch-invariant by construction: every value of a row is computed by one thread, in an
 * order fixed by the row alone (its length, its position), never by the other rows or by
 * the number of threads. Integer products are exact, so their blocking does not matter.
 * Activations are int8 per row (symmetric, max |x| -> 127) and weights int8 per output
 * channel; products use the sign trick (at dot_rows), whose pair sums never saturate:
 * 8-bit rows on every CPU. Weights may instead be 4-bit in groups (int4-row, at dot4_rows):
 * two exact integer sums there. Float code is compiled without FMA contraction (at emit).
 *
 * Built per CPU by inference/native/build.py (-mavx2 -mfma -mf16c, plus -mavxvnni or
 * -mavx512vnni -mavx512vl for VNNI's vpdpbusd; -mavx, -msse4.2 or plain x86-64); the same
 * source serves each, by the macros below.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define ABI_VERSION 6 /* 2: the cache holds float16; 3: 4-bit weights (dc_linear4_set);
                        * 4: the pool steals (dc_test_pause); 5: from every pass;
                        * 6: per-head query and key norms (dc_layer_qk_norm_set) */
#define MAX_THREADS 64
#define TILE 16 /* output channels per work item: their weights stay in cache over the rows */
#define WIDE_TILES 8 /* ... and tiles per item when the rows fit one block (a decode step): a
                      * wider item keeps the pool's marks (gemm_tiles) few and cheap */
#define ROWS 8  /* activation rows per weight load: 8 took a prompt's products 5-9 % less time than
                 * 4 on every build (int8 and 4-bit, 16-64 rows, docs/native.md); 12 and 16
                 * made the int8 product slower */
#define GROUP 32 /* 4-bit weights: elements per sub-scale; a row's group sums (xsum) too */
#define K4_MAX 32768 /* 4-bit weights: the longest k whose 32-bit lanes cannot overflow */
#define K8_MAX 65536 /* int8 weights: the longest k whose sums cannot overflow (dot_rows) */

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* C has no ?: on vectors: selects by the all-ones masks comparisons give */
static inline v8f pick(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }
static inline v8f vmax(v8f a, v8f b) { return pick(a > b, a, b); }
static inline v8f vmin(v8f a, v8f b) { return pick(a < b, a, b); }
static inline v8f vabs(v8f a) { return (v8f)((v8i)a & 0x7fffffff); }

/* ---------------------------------------------------------------- float16 keys and values
 * Both conversions are exact IEEE ones (F. Giesen's), the same bits on every build: float to
 * half rounds to nearest even, as F16C's vcvtps2ph does; half to float is exact, by F16C
 * where the build has it. */

static uint16_t to_half(float value) {
    union { float f; uint32_t u; } f = {value}, magic = {.u = ((127 - 15) + (23 - 10) + 1) << 23};
    uint32_t sign = f.u & 0x80000000u, out;
    f.u ^= sign;
    if (f.u >= (uint32_t)(127 + 16) << 23) {
        out = f.u > 255u << 23 ? 0x7e00 : 0x7c00; /* NaN stays NaN, too large is inf */
    } else if (f.u < 113u << 23) {             /* a subnormal half, or zero */
        f.f += magic.f;
        out = f.u - magic.u;
    } else {
        uint32_t odd = (f.u >> 13) & 1;
        f.u += ((uint32_t)(15 - 127) << 23) + 0xfff + odd;
        out = f.u >> 13;
    }
    return (uint16_t)(out | sign >> 16);
}

static inline v8f from_half8(const uint16_t *h) {
#if defined(__F16C__)
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    v8i in = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]};
    v8i u = (in & 0x7fff) << 13, exp = u & (0x7c00 << 13);
    u += (127 - 15) << 23;
    u += (exp == (0x7c00 << 13)) & ((128 - 16) << 23); /* inf and NaN */
    v8i small = exp == 0;                                /* zero and subnormals */
    v8f f = (v8f)(u + (small & (1 << 23)));
    f = pick(small, f - 0x1p-14f, f); /* 2^-14: the subnormal's own value */
    return (v8f)((v8i)f | ((in & 0x8000) << 16));
#endif
}

/* ---------------------------------------------------------------- the model */

typedef struct {
    const int8_t *q; /* [n, k], or NULL for 4-bit weights */
    const uint8_t *q4; /* 4-bit weights: [n, k / 2] nibbles (at dot4_rows), else NULL */
    const uint8_t *sub; /* 4-bit weights: [n, k / GROUP] steps, 1..255 */
    const int8_t *mins; /* 4-bit weights: [n, k / GROUP] offsets, -127..127 */
    const float *min_scale; /* 4-bit weights: [n] */
    const float *scale; /* [n] */
    const float *bias; /* [n] or NULL */
    int n, k;
} Linear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    Linear qkv, o, gate_up, down;
    const float *q_norm, *k_norm; /* [head_dim] each (Qwen3), or NULL: no per-head norm */
} Layer;

/* A step is a program of passes over the thread pool (below): a work function over
 * [begin, end) of the pass's items, and its context. */
typedef void (*work_fn)(void *ctx, int begin, int end, int thread);
#define SLOT 160 /* bytes of a pass's context: a Step, or a Gemm and its Linear */
#define PASSES 10 /* a layer's (dc_forward) */
#define FINAL_PASSES 3 /* the rows whose logits are asked, gathered; their norm; the head */

/* One pass of a program: fn over [0, items), its context copied in. Every fn commits each
 * item through the pool's marks, so any chunk may be stolen (the pool). */
typedef struct {
    work_fn fn;
    int items;
    _Alignas(16) unsigned char ctx[SLOT];
} Pass;

/* A step's working rows, kept with the model from one call to the next (dc_forward). */
typedef struct {
    int rows; /* the rows the buffers below hold; 0 before the first step */
    int8_t *xq; /* [rows, max k]: a pass's input rows as int8 */
    float *xs; /* [rows]: their scales */
    int16_t *xsum; /* [rows, max k / GROUP]: their group sums, for 4-bit weights */
    int32_t *xtotal; /* [rows]: their sums, for the offset trick (dot_rows) */
    float *qkv; /* [rows, qkv width] */
    float *attn; /* [rows, heads * head_dim] */
    float *gu; /* [rows, 2 inter] */
    float *last; /* [rows, hidden]: the rows whose logits are asked, for the final norm */
    float *scores; /* per thread: a query group's scores, [group, stride] */
    size_t scores_len; /* floats that `scores` holds */
} Scratch;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab, context;
    float eps, scaling;
    /* [context, head_dim]: positions 0 .. context - 1; sin carries rotate_half's sign */
    const float *cos, *sin;
    const float *final_norm;
    Linear head;
    Layer *layer;
    Scratch scratch;
    Pass *program; /* a step's passes: PASSES a layer, then FINAL_PASSES (dc_forward) */
} Model;

/* The build's level, as inference/native/build.py names it */
const char *dc_isa(void) {
#if defined(__AVX512VNNI__)
    return "avx512-vnni";
#elif defined(__AVXVNNI__)
    return "avx-vnni";
#elif defined(__AVX2__)
    return "avx2";
#elif defined(__AVX__)
    return "avx";
#elif defined(__SSE4_2__)
    return "sse4.2";
#else
    return "older";
#endif
}

int dc_abi(void) { return ABI_VERSION; }

/* 1 when this CPU has what the build's own instructions need, by CPUID: the level is chosen
 * from /proc/cpuinfo, which under qemu-user is the host's, not the emulated CPU's (an
 * emulated Haswell on an Alder Lake host would die of SIGILL in vpdpbusd). */
int dc_cpu_ok(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
#if defined(__AVX512VNNI__)
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vl")) return 0;
#endif
#if defined(__AVXVNNI__)
    if (!__builtin_cpu_supports("avxvnni")) return 0;
#endif
#if defined(__AVX2__)
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
#endif
#if defined(__F16C__)
    if (!__builtin_cpu_supports("f16c")) return 0;
#endif
#if defined(__AVX__)
    if (!__builtin_cpu_supports("avx")) return 0;
#endif
#if defined(__SSE4_2__)
    if (!__builtin_cpu_supports("sse4.2")) return 0;
#endif
#endif
    return 1;
}

Model *dc_model_new(int layers, int hidden, int heads, int kv_heads, int head_dim, int inter,
                    int vocab, int context, float eps, float scaling, const float *cos,
                    const float *sin, const float *final_norm) {
    if (hidden % 32 || (heads * head_dim) % 32 || inter % 32 || head_dim % 8 || !kv_heads ||
        heads % kv_heads || hidden > K8_MAX || heads * head_dim > K8_MAX || inter > K8_MAX)
        return NULL;
    Model *m = calloc(1, sizeof(Model));
    if (!m) return NULL;
    m->layer = calloc((size_t)layers, sizeof(Layer));
    if (!m->layer) {
        free(m);
        return NULL;
    }
    Pass *program = malloc(sizeof(Pass) * ((size_t)layers * PASSES + FINAL_PASSES));
    if (!program) {
        free(m->layer);
        free(m);
        return NULL;
    }
    *m = (Model){layers, hidden, heads, kv_heads, head_dim, inter, vocab, context, eps,
                 scaling, cos, sin, final_norm, {0}, m->layer, {0}, program};
    return m;
}

static void quiesce(void);

static void scratch_free_rows(Scratch *b) {
    free(b->xq);
    free(b->xs);
    free(b->xsum);
    free(b->xtotal);
    free(b->qkv);
    free(b->attn);
    free(b->gu);
    free(b->last);
    b->xq = NULL;
    b->xsum = NULL;
    b->xtotal = NULL;
    b->xs = b->qkv = b->attn = b->gu = b->last = NULL;
    b->rows = 0;
}

static void scratch_free(Scratch *b) {
    scratch_free_rows(b);
    free(b->scores);
    b->scores = NULL;
    b->scores_len = 0;
}

void dc_model_free(Model *m) {
    if (!m) return;
    quiesce(); /* a late thread may still read the scratch, the program and the weights */
    scratch_free(&m->scratch);
    free(m->program);
    free(m->layer);
    free(m);
}

static Linear linear(const int8_t *q, const float *scale, const float *bias, int n, int k) {
    return (Linear){q, NULL, NULL, NULL, NULL, scale, bias, n, k};
}

/* Layer i's parts: qkv [(heads + 2 kv_heads) * head_dim, hidden] (with bias or NULL), o
 * [hidden, heads * head_dim], gate_up [2 inter, hidden] (gate rows first), down [hidden, inter]. */
int dc_layer_set(Model *m, int i, const float *input_norm, const float *post_norm,
                 const int8_t *qkv_q, const float *qkv_s, const float *qkv_b, const int8_t *o_q,
                 const float *o_s, const int8_t *gu_q, const float *gu_s, const int8_t *down_q,
                 const float *down_s) {
    if (i < 0 || i >= m->layers) return -1;
    int qkv_n = (m->heads + 2 * m->kv_heads) * m->head_dim;
    m->layer[i] = (Layer){input_norm,
                          post_norm,
                          linear(qkv_q, qkv_s, qkv_b, qkv_n, m->hidden),
                          linear(o_q, o_s, NULL, m->hidden, m->heads * m->head_dim),
                          linear(gu_q, gu_s, NULL, 2 * m->inter, m->hidden),
                          linear(down_q, down_s, NULL, m->hidden, m->inter)};
    return 0;
}

/* Layer i's per-head norms (Qwen3): RMSNorm of each query head by q_norm and of each key
 * head by k_norm, [head_dim] each, after the q/k/v product and before the rotation. */
int dc_layer_qk_norm_set(Model *m, int i, const float *q_norm, const float *k_norm) {
    if (i < 0 || i >= m->layers || !q_norm || !k_norm || m->head_dim % 8) return -1;
    m->layer[i].q_norm = q_norm;
    m->layer[i].k_norm = k_norm;
    return 0;
}

void dc_head_set(Model *m, const int8_t *q, const float *scale) {
    m->head = linear(q, scale, NULL, m->vocab, m->hidden);
}

/* Makes one Linear 4-bit (after dc_layer_set or dc_head_set, which leave its shape and bias):
 * layer i's part 0 qkv, 1 o, 2 gate_up, 3 down, or the head for i == -1. -1 for a part or a k
 * that 4-bit weights cannot take (k a multiple of 64, at most K4_MAX). */
int dc_linear4_set(Model *m, int i, int part, const uint8_t *q4, const uint8_t *sub,
                   const float *scale, const int8_t *mins, const float *min_scale) {
    Linear *l = NULL;
    if (i == -1) l = &m->head;
    else if (i >= 0 && i < m->layers && part >= 0 && part < 4)
        l = (Linear *[]){&m->layer[i].qkv, &m->layer[i].o, &m->layer[i].gate_up,
                         &m->layer[i].down}[part];
    if (!l || l->k % 64 || l->k > K4_MAX) return -1;
    *l = (Linear){NULL, q4, sub, mins, min_scale, scale, l->bias, l->n, l->k};
    return 0;
}

/* ---------------------------------------------------------------- the thread pool */

/* A step is a program of passes (dc_forward: ten a layer, then the head), and a pass is
 * `items` independent work items. Threads claim items in small contiguous chunks from one
 * shared counter, each as it gets to it, instead of a fixed share per thread: on a busy PC
 * another program often has one of the threads' CPUs, and with fixed shares a pass waited
 * for that thread to be scheduled again; now the threads that run take its items. Which
 * thread computes an item changes no bit: every item's values come from the item alone (the
 * kernels' rule), and `thread` only picks a scratch buffer. The workers spin briefly between
 * passes (a layer's passes are microseconds apart) and then sleep on a condition variable,
 * so an idle server costs no CPU.
 *
 * Any thread moves the program on: the one whose chunk finishes a pass installs the next,
 * so a caller that another program has taken the CPU from does not hold the step up while
 * a worker runs (it used to start every pass itself).
 *
 * Stealing: a chunk already begun by a thread that has lost its CPU would hold the pass
 * until that thread is back, up to a scheduler tick (4 ms at 250 Hz; docs/latency.md). So a
 * thread that runs out of chunks to claim takes the unfinished ones too, each from its end,
 * and the first thread to finish an item writes it: an item is computed into registers or
 * the thread's stack, then a compare-and-swap on its mark (`marks`, stamped with the pass;
 * claim_item) lets exactly one thread write it, so a residual add or an in-place rotation is
 * never applied twice and the bits are the ones either thread would write. Every pass works
 * so (the products since 2026-12-04, the norms, rotary, attention and the rest since
 * 2026-12-05: a prompt's step spends more of its time in them than a decode step). A thread
 * that comes back late finds its items marked, writes nothing and leaves: `pass` has moved
 * on. Until it leaves it may still read the pass's inputs, so what it reads must outlive the
 * pass: its context is in the program (a thread checks `pass` after copying it, so a slot
 * being rewritten for a later step is never used), the weights are the model's, the
 * model's buffers are freed or reallocated only once every thread is out of its chunks
 * (quiesce: `inside`), and the caller's (hidden, positions, caches) are kept alive by the
 * caller until dc_pool_quiet says so (library.py). It only writes memory of a live pass: a
 * mark is won only while the pass still lacks it, and a pass ends only when every item is
 * written.
 *
 * The counter is one 64-bit word, `claim`: the pass's generation, its item count and the
 * next unclaimed item. A thread claims with a compare-and-swap of the whole word, so it can
 * only ever take items of the pass it read the word of, within that pass's count, even if
 * it was descheduled for several passes in between. It reads `active` and the program
 * between its load of the word and the swap, so a swap that succeeds proves they are its
 * pass's (none changes before that pass's last item is claimed): a thread whose id the
 * program does not use (whose scratch it may not have) takes nothing. `pass` counts passes
 * in 64 bits (the marks' stamps, which must never come round); the generation is its low
 * bits.
 *
 * One caller: a single thread calls dc_forward and dc_linear, and so run_program() and
 * pool_grow(). In the server that is the inference thread (inference/runtime/worker.py),
 * which loads the model and runs every step; HTTP threads never call in. A program's
 * fields (program, base, count, active) are written by the caller only between programs,
 * after the last one `ended`; a second caller at the same time would overwrite a program in
 * flight. The models' scratch buffers (dc_forward) rest on the same rule. */

#define GEN_BITS 20
#define GEN_MASK ((1u << GEN_BITS) - 1)
#define COUNT_BITS 22 /* items a pass may have, and the next-item field: up to 4M */
#define COUNT_MASK ((1ull << COUNT_BITS) - 1)
#define CHUNKS 8 /* a pass in about this many chunks per thread */

/* Fields that different threads write often are a cache line apart, and apart from `pass`,
 * which every item of a product reads (sharing lines was part of a 5-10 % cost to a quiet
 * decode step, with one-item passes handed between cores: docs/latency.md). */
#define LINE _Alignas(64)
static struct {
    int started; /* worker threads running */
    pthread_t thread[MAX_THREADS];
    unsigned born[MAX_THREADS]; /* per worker: the generation when it was started */
    LINE _Atomic uint64_t claim; /* generation << 44 | items << 22 | next item */
    LINE atomic_int finished;
    LINE atomic_int inside;
    LINE _Atomic uint64_t pass; /* the pass running: the marks' clock; the generation is its low bits */
    _Atomic uint64_t ended; /* the last pass of the last program that ended */
    _Atomic(Pass *) program; /* the running program: pass `base` is program[0] */
    _Atomic uint64_t base;
    atomic_int count, active, sleepers;
    _Atomic uint64_t *marks; /* per item block of a stealable pass: 2 pass (won), 2 pass + 1
                              * (written); each chunk's from a cache line of its own (mark_at) */
    size_t marks_len;
    LINE _Atomic uint64_t done[MAX_THREADS * CHUNKS]; /* per chunk: the last pass that finished it */
    pthread_mutex_t mutex;
    pthread_cond_t wake;
} pool = {.mutex = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

/* The pass a thread's current chunk belongs to, and whether it is being stolen (items from
 * the end), for the work functions that commit through marks. */
static _Thread_local uint64_t chunk_pass;
static _Thread_local int stealing, chunk_items; /* ... and its pass's chunk size */

/* The mark of item block i of a chunk of a pass with `chunk` items a chunk and `blocks`
 * blocks an item, the chunk beginning at item `begin`: each chunk's marks start a cache
 * line, so two threads' chunks never share one. */
#define MARKS_A_LINE 8
static inline size_t mark_at(int begin, int chunk, int blocks, size_t i) {
    size_t line = ((size_t)chunk * blocks + MARKS_A_LINE - 1) / MARKS_A_LINE * MARKS_A_LINE;
    return (size_t)(begin / chunk) * line + i;
}

/* The tests' late thread (dc_test_pause): the next chunk of a pass of `pause_fn` that thread
 * `thread` (0: the caller) claims, it sleeps first, as if another program had its CPU. */
static atomic_int pause_us, pause_thread, paused, ended_in_pause;
static _Atomic(work_fn) pause_fn;

int dc_test_paused(void) { return atomic_load(&paused); } /* pauses begun */

/* pauses during which the other threads finished the program */
int dc_test_ended_in_pause(void) { return atomic_load(&ended_in_pause); }

static void pause_for_test(void) {
    int us = atomic_exchange(&pause_us, 0);
    if (!us) return;
    atomic_fetch_add(&paused, 1);
    uint64_t last = atomic_load(&pool.base) + atomic_load(&pool.count) - 1;
    struct timespec ts = {us / 1000000, us % 1000000 * 1000L};
    nanosleep(&ts, NULL);
    if (atomic_load(&pool.ended) >= last) atomic_fetch_add(&ended_in_pause, 1);
}

static inline unsigned gen_of(uint64_t word) { return (unsigned)(word >> (2 * COUNT_BITS)); }

static void relax(void) {
#if defined(__SSE2__)
    _mm_pause();
#endif
}

/* An item's commit (every pass's work functions): computed first, then claim_item lets
 * exactly one thread write it (1), which then says item_written. A thread that finds the
 * item another's waits until it is written (0), so a chunk is never counted done before
 * all its values are in place. */
static inline int item_open(_Atomic uint64_t *mark, uint64_t pass) {
    return atomic_load(mark) < 2 * pass;
}

static int claim_item(_Atomic uint64_t *mark, uint64_t pass) {
    uint64_t seen = atomic_load(mark);
    while (seen < 2 * pass)
        if (atomic_compare_exchange_weak(mark, &seen, 2 * pass)) return 1;
    for (unsigned spins = 1; atomic_load_explicit(mark, memory_order_acquire) == 2 * pass;)
        if (++spins % 1024) relax(); /* another thread is writing it ... */
        else sched_yield(); /* ... and may be waiting for this CPU */
    return 0;
}

static inline void item_written(_Atomic uint64_t *mark, uint64_t pass) {
    atomic_store_explicit(mark, 2 * pass + 1, memory_order_release);
}

/* Item i (begin <= i < end) of the running chunk, of one mark each: its number (a stolen
 * chunk's from the end) and its mark, or -1 when there is nothing to do here: the pass is
 * over, or the item is another thread's (then written: waited for). */
static int open_item(int begin, int end, int i, _Atomic uint64_t **mark) {
    int t = stealing ? begin + end - 1 - i : i;
    if (atomic_load_explicit(&pool.pass, memory_order_relaxed) != chunk_pass) return -1;
    *mark = &pool.marks[mark_at(begin, chunk_items, 1, (size_t)(t - begin))];
    if (item_open(*mark, chunk_pass)) return t;
    claim_item(*mark, chunk_pass);
    return -1;
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

#define SPIN_US 200.0

static inline int chunk_of(int items, int active) {
    return (items + active * CHUNKS - 1) / (active * CHUNKS);
}

/* Makes `pass` (of the running program) the one threads claim from, and wakes sleepers. */
static void install(uint64_t pass) {
    const Pass *p = &atomic_load(&pool.program)[pass - atomic_load(&pool.base)];
    atomic_store(&pool.pass, pass); /* first: a late thread that reads it knows its pass ended */
    atomic_store(&pool.finished, 0);
    atomic_store(&pool.claim, (uint64_t)(pass & GEN_MASK) << (2 * COUNT_BITS) |
                                  (uint64_t)p->items << COUNT_BITS);
    if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.mutex);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mutex);
    }
}

static void gemm_tiles(void *ctx, int begin, int end, int thread);

/* Pass `next` of the running program is due: run here and now while it is one item of a
 * pass other than a product (a decode step's norms, rotary, quantization: microseconds,
 * and handing them to another core costs more), then install the next, or end. */
static void move_on(uint64_t next, int thread) {
    const Pass *program = atomic_load(&pool.program);
    uint64_t base = atomic_load(&pool.base), end = base + (uint64_t)atomic_load(&pool.count);
    for (; next < end && program[next - base].items == 1 && program[next - base].fn != gemm_tiles;
         next++) {
        atomic_store(&pool.pass, next); /* late threads of the pass before leave */
        chunk_pass = next;
        stealing = 0;
        chunk_items = 1;
        program[next - base].fn((void *)program[next - base].ctx, 0, 1, thread);
    }
    if (next < end) {
        install(next);
    } else {
        atomic_store(&pool.pass, next); /* no pass: late threads leave */
        atomic_store(&pool.ended, next - 1);
    }
}

/* Chunk c of `pass`, `count` of its `items`, is done: counted once, by whichever thread
 * gets here first (a stolen chunk comes here twice). The count that completes the pass
 * moves the program on. */
static void chunk_done(uint64_t pass, int c, int count, int items, int thread) {
    uint64_t seen = atomic_load(&pool.done[c]);
    while (seen < pass)
        if (atomic_compare_exchange_weak(&pool.done[c], &seen, pass)) {
            if (atomic_fetch_add(&pool.finished, count) + count == items) move_on(pass + 1, thread);
            return;
        }
}

/* Claims and runs chunks of the pass of generation `gen` until none is left (or that pass
 * is over); then its unfinished chunks. */
static void take_items(unsigned gen, int thread) {
    atomic_fetch_add(&pool.inside, 1);
    uint64_t pass;
    const Pass *p;
    for (;;) {
        uint64_t word = atomic_load(&pool.claim), now = atomic_load(&pool.pass);
        int items = (int)((word >> COUNT_BITS) & COUNT_MASK), next = (int)(word & COUNT_MASK);
        int active = atomic_load(&pool.active);
        if (gen_of(word) != gen || next >= items || thread >= active) break;
        if ((now & GEN_MASK) != gen) continue; /* the pass is being installed */
        const Pass *q = &atomic_load(&pool.program)[now - atomic_load(&pool.base)];
        int chunk = chunk_of(items, active), end = next + chunk < items ? next + chunk : items;
        if (!atomic_compare_exchange_weak(&pool.claim, &word, word + (uint64_t)(end - next)))
            continue;
        pass = now;
        p = q;
        chunk_pass = pass;
        stealing = 0;
        chunk_items = chunk;
        if (atomic_load_explicit(&pause_us, memory_order_relaxed) &&
            thread == atomic_load(&pause_thread) && p->fn == atomic_load(&pause_fn))
            pause_for_test();
        p->fn((void *)p->ctx, next, end, thread);
        chunk_done(pass, next / chunk, end - next, items, thread);
    }
    /* What is left of the pass: chunks begun by threads not running now. The
     * program's fields are read as a seqlock's reader does: then `pass` again, unchanged. */
    pass = atomic_load(&pool.pass);
    uint64_t base = atomic_load(&pool.base);
    Pass *program = atomic_load(&pool.program);
    int count = atomic_load(&pool.count), active = atomic_load(&pool.active);
    if ((pass & GEN_MASK) == gen && atomic_load(&pool.pass) == pass && thread < active &&
        pass - base < (uint64_t)count) {
        p = &program[pass - base];
        work_fn fn = p->fn;
        int items = p->items, chunk = chunk_of(items, active);
        atomic_thread_fence(memory_order_acquire);
        for (int c = 0; c * chunk < items && atomic_load(&pool.pass) == pass; c++) {
            if (atomic_load(&pool.done[c]) >= pass) continue;
            int end = (c + 1) * chunk < items ? (c + 1) * chunk : items;
            chunk_pass = pass;
            stealing = 1;
            chunk_items = chunk;
            fn((void *)p->ctx, c * chunk, end, thread);
            chunk_done(pass, c, end - c * chunk, items, thread);
        }
    }
    atomic_fetch_sub(&pool.inside, 1);
}

/* Waits until no worker is inside a chunk: before anything a late one may read is freed. */
static void quiesce(void) {
    unsigned spins = 0;
    while (atomic_load(&pool.inside))
        if (++spins % 1024) relax();
        else sched_yield();
}

/* Until the generation moves on from `seen` (or, for the caller, the program ends): spin a
 * while, then sleep. */
static unsigned next_gen(unsigned seen, uint64_t last) {
    double since = 0;
    unsigned spins = 0, gen;
    while ((gen = gen_of(atomic_load(&pool.claim))) == seen) {
        if (last && atomic_load(&pool.ended) >= last) return gen;
        relax();
        if (++spins % 256) continue;
        if (last) { /* the caller never sleeps (its step is running), but a worker that is
                     * finishing the pass may be waiting for this CPU */
            if (!(spins % 1024)) sched_yield();
            continue;
        }
        if (!since) since = now_us();
        else if (now_us() - since > SPIN_US) {
            pthread_mutex_lock(&pool.mutex);
            atomic_fetch_add(&pool.sleepers, 1);
            while (gen_of(atomic_load(&pool.claim)) == seen)
                pthread_cond_wait(&pool.wake, &pool.mutex);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mutex);
        }
    }
    return gen;
}

static void *worker(void *arg) {
    /* A worker started after some passes must not take the last pass, long over, for a new
     * one, so it starts from the generation it was born in. */
    int id = (int)(intptr_t)arg;
    unsigned seen = pool.born[id];
    for (;;) {
        seen = next_gen(seen, 0);
        take_items(seen, id);
    }
    return NULL;
}

static int pool_grow(int threads) {
    while (pool.started < threads - 1) {
        /* between programs: no one moves the generation (pthread_create publishes this) */
        pool.born[pool.started + 1] = gen_of(atomic_load(&pool.claim));
        if (pthread_create(&pool.thread[pool.started], NULL, worker,
                           (void *)(intptr_t)(pool.started + 1)))
            return -1;
        pool.started++;
    }
    return 0;
}

/* Runs the `count` passes of `program` in order, each over the threads (the caller is
 * thread 0, the pool's workers the rest, up to `threads`): returns once the last is done.
 * Only the one calling thread enters (see the pool). */
static void run_program(int threads, Pass *program, int count) {
    uint64_t base = atomic_load(&pool.pass) + 1, last = base + count - 1;
    if (threads > pool.started + 1) threads = pool.started + 1;
    if (threads <= 1) { /* in order on this thread; `pass` still moves, for the marks */
        for (int i = 0; i < count; i++) {
            atomic_store(&pool.pass, base + i);
            chunk_pass = base + i;
            stealing = 0;
            chunk_items = program[i].items;
            if (program[i].items > 0) program[i].fn(program[i].ctx, 0, program[i].items, 0);
        }
        atomic_store(&pool.pass, last + 1);
        return;
    }
    atomic_store(&pool.program, program);
    atomic_store(&pool.base, base);
    atomic_store(&pool.count, count);
    atomic_store(&pool.active, threads);
    move_on(base, 0);
    if (atomic_load(&pool.ended) >= last) return;
    unsigned gen = gen_of(atomic_load(&pool.claim));
    for (;;) {
        take_items(gen, 0);
        if (atomic_load(&pool.ended) >= last) return;
        gen = next_gen(gen, last);
        if (atomic_load(&pool.ended) >= last) return;
    }
}

/* Room for a stealable pass's `blocks` marks, each chunk's from a line of its own (grown
 * only while no thread is in a chunk). */
static int marks_fit(size_t blocks) {
    blocks += (size_t)MARKS_A_LINE * MAX_THREADS * CHUNKS;
    if (blocks <= pool.marks_len) return 0;
    quiesce();
    size_t n = blocks > 2 * pool.marks_len ? blocks : 2 * pool.marks_len;
    size_t bytes = (sizeof(uint64_t) * n + 63) / 64 * 64;
    _Atomic uint64_t *marks = aligned_alloc(64, bytes);
    if (!marks) return -1;
    memset(marks, 0, bytes);
    free(pool.marks);
    pool.marks = marks;
    pool.marks_len = n;
    return 0;
}

/* ---------------------------------------------------------------- row kernels
 * The float code from here on (norms, exp8, rotary, attention, emit) has many a * b + c.
 * Each is a product rounded and then a sum rounded, never one fused multiply-add, because
 * build.py compiles with -ffp-contract=off: a fused one rounds once and gives other bits,
 * and GCC would fuse in some copies of a loop and not in others, and only in the avx2
 * build (the one with -mfma). The notes below mark where it would happen. */

static float sum_squares(const float *x, int n) {
    v8f acc = {0};
    for (int i = 0; i < n; i += 8) {
        v8f v = *(const v8f *)(x + i);
        acc += v * v; /* not fused: -ffp-contract=off */
    }
    float s = 0;
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

static float abs_max(const float *x, int n) {
    v8f m = {0};
    for (int i = 0; i < n; i += 8) {
        v8f v = *(const v8f *)(x + i);
        m = vmax(vabs(v), m);
    }
    float r = 0;
    for (int j = 0; j < 8; j++) r = m[j] > r ? m[j] : r;
    return r;
}

/* x -> int8 in [-127, 127] (half to even) and its scale; x is left as it is. Also the sum of
 * each GROUP of q (|32 x 127| fits int16): what 4-bit weights' offsets need (at dot4_rows),
 * computed once per row for every channel of the pass. */
static void quantize_row(const float *x, int n, int8_t *q, float *scale, int16_t *sums,
                         int32_t *total) {
    float s = abs_max(x, n);
    s = (s < 1e-12f ? 1e-12f : s) / 127.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)rintf(x[i] / s);
    *scale = s;
    int32_t all = 0;
    for (int g = 0; g < n / GROUP; g++) {
        int sum = 0;
        for (int i = 0; i < GROUP; i++) sum += q[g * GROUP + i];
        sums[g] = (int16_t)sum;
        all += sum;
    }
    *total = all; /* the row's sum: what the offset trick takes away (products) */
}

/* RMSNorm(x) * weight, into out */
static void rms_norm(const float *x, const float *weight, int n, float eps, float *out) {
    float r = 1.0f / sqrtf(sum_squares(x, n) / n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * r);
}

/* e^x for x <= 0 (softmax) and for SiLU's -x, Cephes' polynomial, vectorized by the compiler */
static v8f exp8(v8f x) {
    const v8f lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8f hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    x = vmin(vmax(x, lo), hi);
    /* Horner's a * b + c, each rounded twice (-ffp-contract=off): inference/quant/exact.py
     * repeats these operations in torch and gets the same bits only so. */
    v8f fx = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(fx, v8i);
    v8f fn = __builtin_convertvector(n, v8f);
    fn += __builtin_convertvector(fn > fx, v8f); /* floor: -1 where rounding went up */
    n = __builtin_convertvector(fn, v8i);
    x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    v8f y = (v8f){0} + 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    v8i bits = (n + 127) << 23;
    v8f pow2;
    memcpy(&pow2, &bits, sizeof pow2);
    return y * pow2;
}

/* ---------------------------------------------------------------- int8 products */

#if defined(__AVX2__)
static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* acc + in each int32 lane the sum of its 4 byte products u x s (u unsigned, s signed).
 * VNNI's vpdpbusd does it in one instruction and never saturates; without VNNI pmaddubsw
 * sums pairs into 16 bits (saturating) and pmaddwd by ones adds the pairs. Within the sign
 * trick's bounds (dot_rows) both give each lane the same exact integer: the same bits on
 * every build. 256-bit on both VNNI builds (AVX-VNNI is VEX, 256 at most; the EVEX one
 * keeps the same width). */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
/* vpdpbusd adds into its accumulator with a latency of several cycles: a row's blocks of 32
 * alternate between 2 accumulators so the next one starts before the last ends (faster
 * products on the Zen 5 VM, dc_linear timed alone). Without VNNI the add is a 1-cycle paddd,
 * and 2 measured slower. Integer sums: the same bits in any grouping. */
#define CHAINS 2
#else
#define CHAINS 1
#endif
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* The two 8-bit operands of dot4 for weights wv and a row's xv, whose lanes multiply to
 * w x, or to (w + 128) x on the VNNI builds; their dot_rows sums are exact either way.
 *
 * The VNNI builds' offset trick: vpdpbusd multiplies an UNSIGNED byte by a signed one, and w
 * is signed; w + 128 (w with its top bit flipped) is unsigned, 1..255 since the quantizers
 * never give -128, and x goes in as it is: one xor a weight load serves every row, and the
 * caller takes 128 sum x_r away (products), which leaves w . x_r exactly. A lane's sum of
 * four products is at most 4 x 255 x 127 = 129,540 and a row's whole sum k x 32,385, so for
 * k <= K8_MAX every 32-bit sum is exact: the same integers as the other builds.
 *
 * Elsewhere the sign trick (pmaddubsw also takes unsigned x signed, and would saturate
 * 255 x 127 x 2): the unsigned side is |w| (psignb of w by itself) and w's sign moves onto x
 * (psignb of x by w: negated where w < 0, zero where w == 0); |w| * (x * sign w) = w * x.
 * Both are in [-127, 127], so a pair sum is at most 2 x 127 x 127 = 32,258 and never
 * saturates pmaddubsw's 16 bits: every product is exact, with all 8 bits of the row. */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define OFFSET_TRICK 128 /* what dot_rows' sums carry per unit of sum x (products) */
static inline __m256i unsigned_side(__m256i wv) {
    return _mm256_xor_si256(wv, _mm256_set1_epi8((char)0x80));
}
static inline __m256i signed_side(__m256i xv, __m256i wv) { (void)wv; return xv; }
#else
static inline __m256i unsigned_side(__m256i wv) { return _mm256_sign_epi8(wv, wv); }
static inline __m256i signed_side(__m256i xv, __m256i wv) { return _mm256_sign_epi8(xv, wv); }
#endif

/* out[r] = w . x_r (plus 128 sum x_r with OFFSET_TRICK) for `nr` rows of x (stride k), k a
 * multiple of 32. */
static inline __attribute__((always_inline)) void dot_rows(const int8_t *w, const int8_t *x,
                                                           int nr, int k, int32_t *out) {
    __m256i acc[CHAINS][ROWS];
    for (int h = 0; h < CHAINS; h++)
        for (int r = 0; r < nr; r++) acc[h][r] = _mm256_setzero_si256();
    for (int i = 0; i < k; i += 32 * CHAINS)
        for (int h = 0; h < CHAINS && i + 32 * h < k; h++) {
            const int8_t *wi = w + i + 32 * h, *xi = x + i + 32 * h;
            __m256i wv = _mm256_loadu_si256((const __m256i *)wi), u = unsigned_side(wv);
            for (int r = 0; r < nr; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xi + (size_t)r * k));
                acc[h][r] = dot4(acc[h][r], u, signed_side(xv, wv));
            }
        }
    for (int h = 1; h < CHAINS; h++)
        for (int r = 0; r < nr; r++) acc[0][r] = _mm256_add_epi32(acc[0][r], acc[h][r]);
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[0][r]);
}
#elif defined(__SSSE3__)
static inline int32_t hsum(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The AVX2 dot_rows at 16 bytes (SSSE3 has pmaddubsw and psignb): the same sign trick,
 * the same exact integer sums, so the same results. */
static inline __attribute__((always_inline)) void dot_rows(const int8_t *w, const int8_t *x,
                                                           int nr, int k, int32_t *out) {
    const __m128i ones = _mm_set1_epi16(1);
    __m128i acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm_setzero_si128();
    for (int i = 0; i < k; i += 16) {
        __m128i wv = _mm_loadu_si128((const __m128i *)(w + i));
        __m128i aw = _mm_sign_epi8(wv, wv); /* |w|: pmaddubsw's unsigned operand */
        for (int r = 0; r < nr; r++) {
            __m128i xv = _mm_loadu_si128((const __m128i *)(x + (size_t)r * k + i));
            /* |w| x (x with w's sign) = w x, pair sums <= 32,258: no saturation */
            __m128i p = _mm_maddubs_epi16(aw, _mm_sign_epi8(xv, wv));
            acc[r] = _mm_add_epi32(acc[r], _mm_madd_epi16(p, ones));
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
}
#else
/* Plain C: int32 sums of int8 products are exact, so these are the vector builds' values. */
static inline void dot_rows(const int8_t *w, const int8_t *x, int nr, int k, int32_t *out) {
    for (int r = 0; r < nr; r++) {
        int32_t s = 0;
        for (int i = 0; i < k; i++) s += (int32_t)w[i] * x[(size_t)r * k + i];
        out[r] = s;
    }
}
#endif

/* ---------------------------------------------------------------- 4-bit products
 * A channel's weights in blocks of 64 along k, 32 bytes a block: byte j holds element j in
 * its low nibble and element 32 + j in its high one (u, 0..15); every group of 32 (the
 * block's lows, its highs) has a step s (1..255) and an offset t (-127..127), the channel
 * float scales S and M: w = S s u - M t (inference/quant/rowint4.py makes them). So
 *     w . x = S sum_g s_g sum_{i in g} u_i x_i - M sum_g t_g sum_{i in g} x_i,
 * two exact integer sums (dot4_rows) and then floats in one fixed order (at products).
 * u goes in as pmaddubsw's unsigned side as it is (no sign trick): pair sums <= 2 x 15 x 127
 * = 3,810, no saturation; pmaddwd by s_g then gives <= 1,943,100 a 32-bit lane, two groups a
 * block: <= 3,886,200 a block, so k <= K4_MAX (512 blocks) never overflows a lane; the lanes
 * are summed in int64. The rows' group sums come with the row (quantize_row). */

/* sum_g t_g sums_g, exact in int32: |t x sum| <= 127 x 4,064 = 516,128, and at most
 * K4_MAX / GROUP = 1,024 groups: |total| <= 528,515,072 < 2^31, in any order of the adds.
 * AVX2 takes 16 groups a pmaddwd (one channel's offsets were a sixth of a one-row 4-bit
 * product at k = 1,536 as the compiler wrote the loop); the rest, and the other builds, the
 * loop. Integer sums: the same total on every build. */
static inline int64_t offsets(const int8_t *t, const int16_t *sums, int groups) {
    int32_t total = 0;
    int g = 0;
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    for (; g + 16 <= groups; g += 16) {
        __m256i tw = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(t + g)));
        __m256i sw = _mm256_loadu_si256((const __m256i *)(sums + g));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(tw, sw));
    }
    total = hsum(acc);
#endif
    for (; g < groups; g++) total += (int32_t)t[g] * sums[g];
    return total;
}

#if defined(__AVX2__)
/* The 8 int32 lanes' sum in int64: near K4_MAX a lane comes close to 2^31, their sum past. */
static inline int64_t hsum64(__m256i v) {
    __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                    _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
    return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}

/* steps[r] = sum_g s_g sum u x_r, channel n's 4-bit weights with `nr` rows of x (stride k).
 * One unpack of a block serves every row. The channel's steps are widened to 16 bits first,
 * so that each group's is one broadcast from memory, not a byte's load, store and load. */
static inline __attribute__((always_inline)) void dot4_rows(const Linear *l, int n,
                                                            const int8_t *x, int nr, int k,
                                                            int64_t *steps) {
    const uint8_t *w = l->q4 + (size_t)n * (k / 2), *s = l->sub + (size_t)n * (k / GROUP);
    const __m256i low = _mm256_set1_epi8(0x0f);
    int16_t wide[K4_MAX / GROUP] __attribute__((aligned(32)));
    int j = 0;
    for (; j + 16 <= k / GROUP; j += 16)
        _mm256_store_si256((__m256i *)(wide + j),
                           _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(s + j))));
    for (; j < k / GROUP; j++) wide[j] = s[j];
    __m256i acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_si256();
    for (int i = 0, g = 0; i < k; i += 64, g += 2) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(w + i / 2));
        __m256i u0 = _mm256_and_si256(b, low), u1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        __m256i s0 = _mm256_set1_epi16(wide[g]), s1 = _mm256_set1_epi16(wide[g + 1]);
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
        /* vpdpbusd sums 4 products a lane (|.| <= 4 x 15 x 127 = 7,620: fits int16), one
         * pack puts both groups' lanes in one register (a lane's four int16 of the low group,
         * then the high group's four), and one pmaddwd by [s0 x 4, s1 x 4] steps them: three
         * multiplies a block and row, not four. Each pmaddwd lane is s x (d + d') <= 3,886,200
         * as the pair sums' below: the same integers, the same bound. */
        __m256i s01 = _mm256_unpacklo_epi64(s0, s1);
        for (int r = 0; r < nr; r++) {
            const int8_t *xr = x + (size_t)r * k + i;
            __m256i d0 = dot4(_mm256_setzero_si256(), u0, _mm256_loadu_si256((const __m256i *)xr));
            __m256i d1 =
                dot4(_mm256_setzero_si256(), u1, _mm256_loadu_si256((const __m256i *)(xr + 32)));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_packs_epi32(d0, d1), s01));
        }
#else
        for (int r = 0; r < nr; r++) {
            const int8_t *xr = x + (size_t)r * k + i;
            __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *)xr));
            __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(xr + 32)));
            p0 = _mm256_madd_epi16(p0, s0);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(p0, _mm256_madd_epi16(p1, s1)));
        }
#endif
    }
    for (int r = 0; r < nr; r++) steps[r] = hsum64(acc[r]);
}
#elif defined(__SSSE3__)
static inline int64_t hsum64(__m128i v) {
    int32_t lane[4];
    _mm_storeu_si128((__m128i *)lane, v);
    return (int64_t)lane[0] + lane[1] + lane[2] + lane[3];
}

/* The AVX2 dot4_rows at 16 bytes: a block is two loads, each holding 16 elements of both of
 * its groups; one accumulator per group keeps a lane's bound that of the AVX2 build. */
static inline __attribute__((always_inline)) void dot4_rows(const Linear *l, int n,
                                                            const int8_t *x, int nr, int k,
                                                            int64_t *steps) {
    const uint8_t *w = l->q4 + (size_t)n * (k / 2), *s = l->sub + (size_t)n * (k / GROUP);
    const __m128i low = _mm_set1_epi8(0x0f);
    __m128i acc0[ROWS], acc1[ROWS];
    for (int r = 0; r < nr; r++) acc0[r] = acc1[r] = _mm_setzero_si128();
    for (int i = 0, g = 0; i < k; i += 64, g += 2) {
        __m128i b0 = _mm_loadu_si128((const __m128i *)(w + i / 2));
        __m128i b1 = _mm_loadu_si128((const __m128i *)(w + i / 2 + 16));
        __m128i u00 = _mm_and_si128(b0, low), u01 = _mm_and_si128(b1, low);
        __m128i u10 = _mm_and_si128(_mm_srli_epi16(b0, 4), low);
        __m128i u11 = _mm_and_si128(_mm_srli_epi16(b1, 4), low);
        __m128i s0 = _mm_set1_epi16(s[g]), s1 = _mm_set1_epi16(s[g + 1]);
        for (int r = 0; r < nr; r++) {
            const __m128i *xr = (const __m128i *)(x + (size_t)r * k + i);
            __m128i p00 = _mm_madd_epi16(_mm_maddubs_epi16(u00, _mm_loadu_si128(xr)), s0);
            __m128i p01 = _mm_madd_epi16(_mm_maddubs_epi16(u01, _mm_loadu_si128(xr + 1)), s0);
            __m128i p10 = _mm_madd_epi16(_mm_maddubs_epi16(u10, _mm_loadu_si128(xr + 2)), s1);
            __m128i p11 = _mm_madd_epi16(_mm_maddubs_epi16(u11, _mm_loadu_si128(xr + 3)), s1);
            acc0[r] = _mm_add_epi32(acc0[r], _mm_add_epi32(p00, p01));
            acc1[r] = _mm_add_epi32(acc1[r], _mm_add_epi32(p10, p11));
        }
    }
    for (int r = 0; r < nr; r++) steps[r] = hsum64(acc0[r]) + hsum64(acc1[r]);
}
#else
/* Plain C: int32 sums of u x per group, times s_g in int64: the vector builds' integers. */
static inline void dot4_rows(const Linear *l, int n, const int8_t *x, int nr, int k,
                             int64_t *steps) {
    const uint8_t *w = l->q4 + (size_t)n * (k / 2), *s = l->sub + (size_t)n * (k / GROUP);
    for (int r = 0; r < nr; r++) {
        int64_t total = 0;
        for (int i = 0; i < k; i += 64) {
            int32_t lo = 0, hi = 0;
            for (int j = 0; j < 32; j++) {
                lo += (w[i / 2 + j] & 15) * x[(size_t)r * k + i + j];
                hi += (w[i / 2 + j] >> 4) * x[(size_t)r * k + i + 32 + j];
            }
            total += (int64_t)s[i / GROUP] * lo + (int64_t)s[i / GROUP + 1] * hi;
        }
        steps[r] = total;
    }
}
#endif

typedef struct {
    const Linear *lin;
    const int8_t *x; /* [rows, k] */
    const float *xs; /* [rows] */
    const int16_t *xsum; /* [rows, k / GROUP]: the rows' group sums (quantize_row) */
    const int32_t *xtotal; /* [rows]: each row's sum, with the offset trick (dot_rows) */
    int rows;
    float *y; /* [rows, ystride] */
    int ystride;
    int add; /* 1: y += result (a residual), 0: y = result */
    int width; /* output channels a work item: TILE, or WIDE_TILES x TILE for one row block */
} Gemm;

/* (row r, channel n)'s product before the row's scale (products): times the row's scale,
 * plus the bias, plus the residual. emit is inlined into gemm_tiles' ROWS-row loop and into
 * its one-row loop for the remainder. With contraction on, GCC fused the product with the
 * add after it in one copy and not in the other, so a row's bits depended on whether it fell
 * in a block of ROWS, that is on the rows beside it (a test caught it). -ffp-contract=off
 * (build.py) keeps the product and each add separate roundings in both copies and builds. */
static inline void emit(const Gemm *g, int r, int n, float product) {
    const Linear *l = g->lin;
    float v = product * g->xs[r];
    if (l->bias) v += l->bias[n]; /* an add of its own, not fused with the product */
    float *y = g->y + (size_t)r * g->ystride + n;
    *y = g->add ? *y + v : v; /* the residual: an add of its own too */
}

/* Channel n's products with rows r .. r + nr - 1 before the rows' scales, by its weights'
 * kind: int8, the integer sum times the channel's scale; 4-bit, S x its steps' sum minus
 * M x its offsets' sum, each product rounded, then the difference (-ffp-contract=off). */
static inline __attribute__((always_inline)) void products(const Gemm *g, int n, int r, int nr,
                                                           float *out) {
    const Linear *l = g->lin;
    int k = l->k, groups = k / GROUP;
    if (l->q4) {
        int64_t steps[ROWS];
        dot4_rows(l, n, g->x + (size_t)r * k, nr, k, steps);
        for (int j = 0; j < nr; j++) {
            int64_t offset = offsets(l->mins + (size_t)n * groups,
                                     g->xsum + (size_t)(r + j) * groups, groups);
            out[j] = (float)steps[j] * l->scale[n] - (float)offset * l->min_scale[n];
        }
        return;
    }
    int32_t acc[ROWS];
    dot_rows(l->q + (size_t)n * k, g->x + (size_t)r * k, nr, k, acc);
#ifdef OFFSET_TRICK
    for (int j = 0; j < nr; j++) acc[j] -= OFFSET_TRICK * g->xtotal[r + j];
#endif
    for (int j = 0; j < nr; j++) out[j] = (float)acc[j] * l->scale[n];
}

/* A block of nr (1 .. ROWS) rows with channels n0 .. n1 - 1: one weight load serves all
 * of them. The cases make nr a constant in each inlined copy of the kernels, so their
 * accumulators stay in registers. The block is written only by the thread that wins its
 * mark (the pool's stealing): computed first, then marked, then written; a thread that
 * finds it marked by another waits until it is written, so a chunk is never counted done
 * before all its values are in place. */
_Static_assert(ROWS == 8, "tile_rows has a case for each block size");
static inline void tile_rows(const Gemm *g, _Atomic uint64_t *mark, uint64_t pass, int n0,
                             int n1, int r, int nr) {
    float acc[WIDE_TILES * TILE][ROWS];
    if (item_open(mark, pass)) {
        for (int n = n0; n < n1; n++) {
            switch (nr) {
            case 1: products(g, n, r, 1, acc[n - n0]); break;
            case 2: products(g, n, r, 2, acc[n - n0]); break;
            case 3: products(g, n, r, 3, acc[n - n0]); break;
            case 4: products(g, n, r, 4, acc[n - n0]); break;
            case 5: products(g, n, r, 5, acc[n - n0]); break;
            case 6: products(g, n, r, 6, acc[n - n0]); break;
            case 7: products(g, n, r, 7, acc[n - n0]); break;
            default: products(g, n, r, ROWS, acc[n - n0]);
            }
        }
    }
    if (!claim_item(mark, pass)) return;
    for (int n = n0; n < n1; n++)
        for (int j = 0; j < nr; j++) emit(g, r + j, n, acc[n - n0][j]);
    item_written(mark, pass);
}

/* A Gemm as a pass holds it: with its own copy of the Linear (dc_linear's is on a stack). */
typedef struct {
    Gemm g;
    Linear l;
} GemmSlot;
_Static_assert(sizeof(GemmSlot) <= SLOT, "a pass holds a GemmSlot");

static void gemm_tiles(void *ctx, int begin, int end, int thread) {
    (void)thread;
    GemmSlot s;
    memcpy(&s, ctx, sizeof s);
    atomic_thread_fence(memory_order_acquire);
    uint64_t pass = chunk_pass;
    if (atomic_load(&pool.pass) != pass) return; /* over (its slot may be another pass's now) */
    s.g.lin = &s.l;
    const Gemm *g = &s.g;
    int n = s.l.n, blocks = (g->rows + ROWS - 1) / ROWS, chunk = chunk_items;
    for (int i = begin; i < end; i++) {
        int t = stealing ? begin + end - 1 - i : i; /* a stolen chunk from its end */
        if (atomic_load_explicit(&pool.pass, memory_order_relaxed) != pass) return;
        int n0 = t * g->width, n1 = n0 + g->width < n ? n0 + g->width : n;
        for (int b = 0; b < blocks; b++) {
            int r = b * ROWS;
            size_t at = mark_at(begin, chunk, blocks, (size_t)(t - begin) * blocks + b);
            tile_rows(g, &pool.marks[at], pass, n0, n1, r, g->rows - r < ROWS ? g->rows - r : ROWS);
        }
    }
}

/* Pass p: y [rows, ystride] (=, or += with add) x [rows, k] through l, x quantized with its
 * scales, group sums and sums (quantize_row). The pool's marks must have room for it.
 * Returns the next pass (p itself when there are no rows). */
static Pass *gemm(Pass *p, const Linear *l, const int8_t *x, const float *xs,
                 const int16_t *xsum, const int32_t *total, int rows, float *y, int ystride,
                 int add) {
    if (rows <= 0) return p;
    int width = rows <= ROWS ? WIDE_TILES * TILE : TILE;
    GemmSlot s = {{NULL, x, xs, xsum, NULL, rows, y, ystride, add, width}, *l};
#ifdef OFFSET_TRICK
    if (!l->q4) s.g.xtotal = total;
#else
    (void)total;
#endif
    p->fn = gemm_tiles;
    p->items = (l->n + width - 1) / width;
    memcpy(p->ctx, &s, sizeof s);
    return p + 1;
}

/* ---------------------------------------------------------------- a step */

typedef struct {
    const Model *m;
    float *hidden; /* [rows, hidden] */
    const int32_t *pos;
    uint16_t *const *cache; /* per row: its sequence's [layers, 2, kv_heads, alloc, head_dim] */
    const int32_t *alloc;
    int layer;
    const float *norm; /* the norm pass's weight */
    int8_t *xq; /* [rows, max k]; this and the six below are the model's Scratch */
    float *xs;
    int16_t *xsum; /* [rows, max k / GROUP] */
    int32_t *xtotal; /* [rows]: each row's sum (gemm) */
    float *qkv; /* [rows, qkv width] */
    float *attn; /* [rows, heads * head_dim] */
    float *gu; /* [rows, 2 inter] */
    float *scores; /* per thread: a query group's scores, [group, stride] */
    int stride; /* the longest row's keys, rounded up to 8: scores go 8 at a time */
    const int32_t *out; /* the rows whose logits are asked ... */
    float *last; /* ... gathered here [n_out, hidden] (gather_last) */
} Step;
_Static_assert(sizeof(Step) <= SLOT, "a pass holds a Step");

/* Pass p: fn over `items` with the step's fields as they are now. Returns the next pass
 * (p itself for no items). */
static Pass *step_pass(Pass *p, work_fn fn, const Step *s, int items) {
    if (items <= 0) return p;
    p->fn = fn;
    p->items = items;
    memcpy(p->ctx, s, sizeof *s);
    return p + 1;
}

/* A step pass's context, copied as gemm_tiles copies its own: 0 when the pass is over (its
 * slot may be another pass's now). */
static int step_of(const void *ctx, Step *s) {
    memcpy(s, ctx, sizeof *s);
    atomic_thread_fence(memory_order_acquire);
    return atomic_load(&pool.pass) == chunk_pass;
}

static void gather_last(void *ctx, int begin, int end, int thread) {
    (void)thread;
    Step s;
    if (!step_of(ctx, &s)) return;
    size_t hidden = (size_t)s.m->hidden;
    for (int i = begin; i < end; i++) {
        _Atomic uint64_t *mark;
        int j = open_item(begin, end, i, &mark);
        if (j < 0 || !claim_item(mark, chunk_pass)) continue;
        memcpy(s.last + j * hidden, s.hidden + s.out[j] * hidden, sizeof(float) * hidden);
        item_written(mark, chunk_pass);
    }
}

/* The passes that leave each row quantized for the next product (norm_rows, quantize_attn,
 * silu_mul): row r's k floats from `row` (made in tmp, or the row itself), quantized on the
 * stack, then committed through the row's mark. */
typedef const float *(*row_fn)(const Step *s, int r, float *tmp);

static void quantized_rows(const Step *s, int begin, int end, int k, row_fn row) {
    float tmp[k];
    int8_t q[k];
    int16_t sums[k / GROUP];
    float scale;
    int32_t total;
    for (int i = begin; i < end; i++) {
        _Atomic uint64_t *mark;
        int r = open_item(begin, end, i, &mark);
        if (r < 0) continue;
        quantize_row(row(s, r, tmp), k, q, &scale, sums, &total);
        if (!claim_item(mark, chunk_pass)) continue;
        memcpy(s->xq + (size_t)r * k, q, (size_t)k);
        s->xs[r] = scale;
        memcpy(s->xsum + (size_t)r * (k / GROUP), sums, sizeof sums);
        s->xtotal[r] = total;
        item_written(mark, chunk_pass);
    }
}

static const float *normed(const Step *s, int r, float *tmp) {
    const Model *m = s->m;
    rms_norm(s->hidden + (size_t)r * m->hidden, s->norm, m->hidden, m->eps, tmp);
    return tmp;
}

static void norm_rows(void *ctx, int begin, int end, int thread) {
    (void)thread;
    Step s;
    if (step_of(ctx, &s)) quantized_rows(&s, begin, end, s.m->hidden, normed);
}

static uint16_t *kv_at(const Step *s, int r, int which, int kv_head, int position) {
    const Model *m = s->m;
    size_t alloc = (size_t)s->alloc[r], d = (size_t)m->head_dim;
    size_t offset = (((size_t)s->layer * 2 + which) * m->kv_heads + kv_head) * alloc * d;
    return s->cache[r] + offset + (size_t)position * d;
}

/* x * cos + roll(x, half) * signed_sin, as the torch path's _rotate, into out */
static void rotate(const float *x, float *out, const float *cos, const float *sin, int d) {
    int half = d / 2;
    /* two products and a sum, not fused (-ffp-contract=off): the same bits on every build */
    for (int i = 0; i < d; i++) out[i] = x[i] * cos[i] + x[(i + half) % d] * sin[i];
}

/* q and k (each head normed first where the layer has per-head norms) rotated in place, k
 * and v into the cache */
static void rope_and_store(void *ctx, int begin, int end, int thread) {
    (void)thread;
    Step s;
    if (!step_of(ctx, &s)) return;
    const Model *m = s.m;
    const Layer *layer = &m->layer[s.layer];
    int d = m->head_dim, width = (m->heads + 2 * m->kv_heads) * d;
    float out[(m->heads + m->kv_heads) * d], normed[d];
    for (int i = begin; i < end; i++) {
        _Atomic uint64_t *mark;
        int r = open_item(begin, end, i, &mark);
        if (r < 0) continue;
        float *row = s.qkv + (size_t)r * width;
        const float *cos = m->cos + (size_t)s.pos[r] * d, *sin = m->sin + (size_t)s.pos[r] * d;
        for (int h = 0; h < m->heads + m->kv_heads; h++) {
            const float *head = row + h * d, *norm = h < m->heads ? layer->q_norm : layer->k_norm;
            if (norm) {
                rms_norm(head, norm, d, m->eps, normed);
                head = normed;
            }
            rotate(head, out + h * d, cos, sin, d);
        }
        if (!claim_item(mark, chunk_pass)) continue;
        memcpy(row, out, sizeof out);
        for (int h = 0; h < m->kv_heads; h++) {
            uint16_t *k = kv_at(&s, r, 0, h, s.pos[r]), *v = kv_at(&s, r, 1, h, s.pos[r]);
            const float *kf = row + (m->heads + h) * d, *vf = kf + m->kv_heads * d;
            for (int j = 0; j < d; j++) {
                k[j] = to_half(kf[j]);
                v[j] = to_half(vf[j]);
            }
        }
        item_written(mark, chunk_pass);
    }
}

/* Lane sums of 8 vectors, one per lane of the result: a fixed tree, so a key's score has
 * the same bits wherever it sits in its block of 8 and whatever the other 7 are. */
static inline v8f hadd(v8f a, v8f b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

static inline v8f lane_sums(const v8f *a) {
    v8f u0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
    v8f u1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* q . k for keys j0 .. j0 + count - 1 (count <= 8; the other lanes 0), d <= 256: the last,
 * part-filled block of a row's keys. Whole blocks go to scores_block, which sums the same
 * products in the same order. */
static v8f scores8(const float *q, const uint16_t *keys, int count, int d) {
    v8f acc[8];
    for (int t = 0; t < 8; t++) acc[t] = (v8f){0};
    for (int t = 0; t < count; t++) {
        const uint16_t *k = keys + (size_t)t * d;
        v8f a = *(const v8f *)q * from_half8(k);
        /* a += q * k, the product rounded before the sum (-ffp-contract=off) */
        for (int i = 8; i < d; i += 8) a += *(const v8f *)(q + i) * from_half8(k + i);
        acc[t] = a;
    }
    return lane_sums(acc);
}

/* scores8 of a whole block of 8 keys, times `scaling`, for H query heads (H <= 3; head h's
 * query at q + h * d, its scores at out + h * stride): the same sums in the same order as
 * scores8's, but each key's float16 is converted once for all H heads, and four keys at a
 * time: the H x 4 chains of adds overlap (one key's chain alone waits out each add's
 * latency). With 16 registers (AVX2 and older) some sums spill to the stack; measured only
 * on an AVX-512 build, which has 32. */
static inline __attribute__((always_inline)) void
scores_block(const float *q, const int H, const uint16_t *keys, int d, float scaling,
             float *out, size_t stride) {
    v8f acc[3][8];
    for (int half = 0; half < 8; half += 4) {
        const uint16_t *k = keys + (size_t)half * d;
        for (int t = 0; t < 4; t++) {
            v8f x = from_half8(k + (size_t)t * d);
            for (int h = 0; h < H; h++) acc[h][half + t] = *(const v8f *)(q + h * d) * x;
        }
        for (int i = 8; i < d; i += 8) {
            v8f x[4];
            for (int t = 0; t < 4; t++) x[t] = from_half8(k + (size_t)t * d + i);
            for (int h = 0; h < H; h++) {
                v8f qi = *(const v8f *)(q + h * d + i);
                for (int t = 0; t < 4; t++) acc[h][half + t] += qi * x[t];
            }
        }
    }
    for (int h = 0; h < H; h++) *(v8f *)(out + h * stride) = lane_sums(acc[h]) * scaling;
}

/* o_h = sum over keys j < n, in order, of p_h[j] * v_j, divided by total_h, for H heads of
 * one key head (H <= 3; the scores of head h at p + h * stride, its output at o + h * d).
 * Each p * v is rounded, then added (-ffp-contract=off): every lane sums its products in key
 * order, so the bits are the same however lanes and heads are grouped. WEIGH x 8 lanes of
 * the H heads at a time, so each value is converted from float16 once for all H (AVX-512
 * builds, 32 registers, take 64 lanes rather than 32: on the conversation measured at
 * attend, its extra time fell from 7.4 to 6.1 ms so). */
#if defined(__AVX512VL__)
#define WEIGH 8 /* vectors of lanes per pass */
#else
#define WEIGH 4 /* AVX2 and older: 16 registers */
#endif
static inline __attribute__((always_inline)) void
weigh_values(const float *p, size_t stride, const int H, const uint16_t *values, int n, int d,
             const float *total, float *o) {
    int i = 0;
    for (; i + 8 * WEIGH <= d; i += 8 * WEIGH) {
        v8f acc[3][WEIGH] = {{{0}}};
        for (int j = 0; j < n; j++) {
            const uint16_t *v = values + (size_t)j * d + i;
            v8f x[WEIGH];
            for (int t = 0; t < WEIGH; t++) x[t] = from_half8(v + 8 * t);
            for (int h = 0; h < H; h++) {
                float pj = p[h * stride + j];
                for (int t = 0; t < WEIGH; t++) acc[h][t] += pj * x[t];
            }
        }
        for (int h = 0; h < H; h++)
            for (int t = 0; t < WEIGH; t++)
                *(v8f *)(o + h * d + i + 8 * t) = acc[h][t] / total[h];
    }
    for (; i < d; i += 8) {
        for (int h = 0; h < H; h++) {
            v8f acc = {0};
            for (int j = 0; j < n; j++)
                acc += p[h * stride + j] * from_half8(values + (size_t)j * d + i);
            *(v8f *)(o + h * d + i) = acc / total[h];
        }
    }
}

/* One (row, key head): for each query head h of its group, softmax(q_h . k_j * scaling)
 * over j <= the row's position, times v, up to 3 heads at a time (each float16 key and value
 * converted once for them; more heads at once would hold more sums than registers). Keys go
 * in blocks of 8, the last one padded with zero lanes: a row's bits depend on its position
 * alone. Measured on the embedded model (the engine alone, 2 threads, an AVX-512 Zen 4 EPYC
 * VM, medians of 5 runs side by side): a 12-exchange conversation's last question (~20
 * prompt rows after 575 cached tokens) took 11.1 ms longer than its first (43 tokens) a
 * head at a time, 6.2 ms so; every logit's bits unchanged. */
/* One query group's attention (an item: a row and a kv head) */
static void attend(void *ctx, int begin, int end, int thread) {
    Step st;
    if (!step_of(ctx, &st)) return;
    const Step *s = &st;
    const Model *m = s->m;
    int d = m->head_dim, group = m->heads / m->kv_heads;
    int width = (m->heads + 2 * m->kv_heads) * d;
    float *scores = s->scores + (size_t)thread * group * s->stride;
    float o[group * d];
    for (int i = begin; i < end; i++) {
        _Atomic uint64_t *mark;
        int item = open_item(begin, end, i, &mark);
        if (item < 0) continue;
        int r = item / m->kv_heads, g = item % m->kv_heads, n = s->pos[r] + 1;
        const float *q = s->qkv + (size_t)r * width + (size_t)g * group * d;
        const uint16_t *keys = kv_at(s, r, 0, g, 0), *values = kv_at(s, r, 1, g, 0);
        float total[group];
        for (int j = 0; j < n; j += 8) {
            int count = n - j < 8 ? n - j : 8;
            for (int h = 0; h < group;) { /* a whole block: 3 heads at a time, then 2 or 1 */
                float *out = scores + (size_t)h * s->stride + j;
                const float *qh = q + h * d;
                const uint16_t *kj = keys + (size_t)j * d;
                if (count < 8) { /* the last block, a head at a time */
                    v8f sc = scores8(qh, kj, count, d) * m->scaling;
                    for (int t = count; t < 8; t++) sc[t] = -INFINITY;
                    *(v8f *)out = sc;
                    h += 1;
                } else if (group - h == 1) {
                    scores_block(qh, 1, kj, d, m->scaling, out, s->stride), h += 1;
                } else if (group - h == 2) {
                    scores_block(qh, 2, kj, d, m->scaling, out, s->stride), h += 2;
                } else {
                    scores_block(qh, 3, kj, d, m->scaling, out, s->stride), h += 3;
                }
            }
        }
        for (int h = 0; h < group; h++) {
            float *sc_h = scores + (size_t)h * s->stride;
            v8f top8 = (v8f){0} - INFINITY;
            for (int j = 0; j < n; j += 8) top8 = vmax(top8, *(v8f *)(sc_h + j));
            float top = top8[0];
            for (int t = 1; t < 8; t++) top = top8[t] > top ? top8[t] : top;
            v8f total8 = {0};
            for (int j = 0; j < n; j += 8) {
                v8f e = exp8(*(v8f *)(sc_h + j) - top);
                for (int t = n - j; t < 8; t++) e[t] = 0;
                *(v8f *)(sc_h + j) = e;
                total8 += e;
            }
            total[h] = lane_sums((v8f[8]){total8, {0}, {0}, {0}, {0}, {0}, {0}, {0}})[0];
        }
        for (int h = 0; h < group;) { /* 3 heads at a time, the rest 2 or 1 */
            const float *p = scores + (size_t)h * s->stride;
            switch (group - h) {
            case 1: weigh_values(p, s->stride, 1, values, n, d, total + h, o + h * d); h += 1; break;
            case 2: weigh_values(p, s->stride, 2, values, n, d, total + h, o + h * d); h += 2; break;
            default: weigh_values(p, s->stride, 3, values, n, d, total + h, o + h * d); h += 3;
            }
        }
        if (!claim_item(mark, chunk_pass)) continue;
        memcpy(s->attn + (size_t)r * m->heads * d + (size_t)g * group * d, o, sizeof o);
        item_written(mark, chunk_pass);
    }
}

static const float *attention_out(const Step *s, int r, float *tmp) {
    (void)tmp;
    return s->attn + (size_t)r * s->m->heads * s->m->head_dim;
}

static void quantize_attn(void *ctx, int begin, int end, int thread) {
    (void)thread;
    Step s;
    if (step_of(ctx, &s)) quantized_rows(&s, begin, end, s.m->heads * s.m->head_dim, attention_out);
}

/* silu(gate) * up, into tmp */
static const float *activated(const Step *s, int r, float *tmp) {
    int inter = s->m->inter;
    const float *gate = s->gu + (size_t)r * 2 * inter, *up = gate + inter;
    for (int j = 0; j < inter; j += 8) {
        v8f g = *(const v8f *)(gate + j);
        *(v8f *)(tmp + j) = g / (1.0f + exp8(-g)) * *(const v8f *)(up + j);
    }
    return tmp;
}

/* silu(gate) * up, quantized for down */
static void silu_mul(void *ctx, int begin, int end, int thread) {
    (void)thread;
    Step s;
    if (step_of(ctx, &s)) quantized_rows(&s, begin, end, s.m->inter, activated);
}

/* 32-byte aligned memory for `bytes`, rounded up to 32 as aligned_alloc asks; NULL for none */
static void *aligned(size_t bytes) { return aligned_alloc(32, (bytes + 31) / 32 * 32); }

/* The model's buffers made big enough for a step of `rows` rows (and `rows` asked logits)
 * and `scores` floats of attention scores. They are allocated at the first step and kept
 * with the model (freed by dc_model_free), instead of six allocations every step. How many
 * rows a step has is the engine's choice (a prefill chunk, the decoding streams with their
 * drafts) and a measurement may run a whole text in one call, so they grow when a step needs
 * more than any before: rows by whole blocks of 32, scores with the thread count. Never
 * shrunk. Only the one calling thread (see the
 * pool) runs a step, so no step can be using them while they grow. Returns 0, or -1 when
 * memory ran out (the buffers then hold nothing, and the next step tries again). */
static int scratch_fit(Model *m, int rows, size_t scores) {
    Scratch *b = &m->scratch;
    if (rows > b->rows) {
        quiesce(); /* a late thread of a product may still read xq and its sums (the pool) */
        size_t n = ((size_t)rows + 31) / 32 * 32, attn = (size_t)m->heads * m->head_dim;
        size_t width = attn + (size_t)2 * m->kv_heads * m->head_dim;
        size_t k_max = (size_t)(m->inter > m->hidden ? m->inter : m->hidden); /* xq's widest */
        k_max = attn > k_max ? attn : k_max;
        scratch_free_rows(b);
        b->xq = aligned(n * k_max);
        b->xs = aligned(sizeof(float) * n);
        b->xsum = aligned(sizeof(int16_t) * n * (k_max / GROUP));
        b->xtotal = aligned(sizeof(int32_t) * n);
        b->qkv = aligned(sizeof(float) * n * width);
        b->attn = aligned(sizeof(float) * n * attn);
        b->gu = aligned(sizeof(float) * n * 2 * m->inter);
        b->last = aligned(sizeof(float) * n * m->hidden);
        if (!b->xq || !b->xs || !b->xsum || !b->xtotal || !b->qkv || !b->attn || !b->gu || !b->last) {
            scratch_free_rows(b);
            return -1;
        }
        b->rows = (int)n;
    }
    if (scores > b->scores_len) {
        quiesce(); /* a late thread's attention may still use its scores */
        size_t n = scores > 2 * b->scores_len ? scores : 2 * b->scores_len;
        free(b->scores);
        b->scores = aligned(sizeof(float) * n);
        b->scores_len = b->scores ? n : 0;
        if (!b->scores) return -1;
    }
    return 0;
}

/* Runs the rows through every layer, then the final norm and the head for the rows listed
 * in `out` (logits [n_out, vocab]). Row r goes at position pos[r] of the cache at cache[r]
 * (room for alloc[r] positions), which must already hold its positions before pos[r]:
 * the rows of one sequence come in order. A layer is ten passes over the pool. Returns 0, -1
 * when memory ran out, -2 for a position past the rotary table. */
int dc_forward(Model *m, int rows, float *hidden, const int32_t *pos, uint16_t *const *cache,
               const int32_t *alloc, int n_out, const int32_t *out, float *logits,
               int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (pool_grow(threads)) threads = pool.started + 1;
    int d = m->head_dim, width = (m->heads + 2 * m->kv_heads) * d;
    int longest = 0;
    for (int r = 0; r < rows; r++) {
        if (pos[r] < 0 || pos[r] >= m->context) return -2; /* past the rotary table */
        longest = pos[r] + 1 > longest ? pos[r] + 1 : longest;
    }
    int stride = (longest + 7) / 8 * 8;
    /* room for the whole context's scores at once (a few MB at most): a buffer that grows
     * waits for any late thread (quiesce), and a growing position would grow it often */
    size_t scores = (size_t)threads * (m->heads / m->kv_heads) * ((m->context + 7) / 8 * 8);
    if (scratch_fit(m, rows > n_out ? rows : n_out, scores)) return -1;
    /* every product's marks (gemm) now, so that no pass can run out of memory halfway */
    int widest = width > 2 * m->inter ? width : 2 * m->inter;
    widest = widest > m->hidden ? widest : m->hidden;
    size_t blocks = (size_t)(widest + TILE - 1) / TILE * ((rows + ROWS - 1) / ROWS);
    size_t head = (size_t)(m->vocab + TILE - 1) / TILE * ((n_out + ROWS - 1) / ROWS);
    size_t items = (size_t)rows * m->kv_heads; /* the most of the other passes (attention) */
    blocks = blocks > head ? blocks : head;
    if (marks_fit(blocks > items ? blocks : items)) return -1;
    const Scratch *b = &m->scratch;
    Step s = {.m = m, .hidden = hidden, .pos = pos, .cache = cache, .alloc = alloc,
              .xq = b->xq, .xs = b->xs, .xsum = b->xsum, .xtotal = b->xtotal, .qkv = b->qkv, .attn = b->attn, .gu = b->gu,
              .scores = b->scores, .stride = stride, .out = out, .last = b->last};
    Pass *p = m->program;
    atomic_thread_fence(memory_order_release); /* a late thread may be copying a pass (the pool) */
    for (int i = 0; i < m->layers; i++) {
        const Layer *l = &m->layer[i];
        s.layer = i;
        s.norm = l->input_norm;
        p = step_pass(p, norm_rows, &s, rows);                                   /* pass 1 */
        p = gemm(p, &l->qkv, s.xq, s.xs, s.xsum, s.xtotal, rows, s.qkv, width, 0);           /* 2 */
        p = step_pass(p, rope_and_store, &s, rows);                              /* 3 */
        p = step_pass(p, attend, &s, rows * m->kv_heads);                        /* 4 */
        p = step_pass(p, quantize_attn, &s, rows);                               /* 5 */
        p = gemm(p, &l->o, s.xq, s.xs, s.xsum, s.xtotal, rows, hidden, m->hidden, 1);        /* 6 */
        s.norm = l->post_norm;
        p = step_pass(p, norm_rows, &s, rows);                                   /* 7 */
        p = gemm(p, &l->gate_up, s.xq, s.xs, s.xsum, s.xtotal, rows, s.gu, 2 * m->inter, 0); /* 8 */
        p = step_pass(p, silu_mul, &s, rows);                                    /* 9 */
        p = gemm(p, &l->down, s.xq, s.xs, s.xsum, s.xtotal, rows, hidden, m->hidden, 1);     /* 10 */
    }
    p = step_pass(p, gather_last, &s, n_out);
    Step f = s;
    f.hidden = b->last;
    f.norm = m->final_norm;
    p = step_pass(p, norm_rows, &f, n_out);
    p = gemm(p, &m->head, f.xq, f.xs, f.xsum, f.xtotal, n_out, logits, m->vocab, 0);
    run_program(threads, m->program, (int)(p - m->program));
    return 0;
}

/* 1 when no pool thread is inside a chunk: no late thread can read what a step before was
 * given any more (the caller keeps its buffers until then: library.py) */
int dc_pool_quiet(void) { return atomic_load(&pool.inside) == 0; }

/* y [rows, n] = x [rows, k] through l alone */
static int linear_alone(const Linear *l, int rows, const float *x, float *y, int threads) {
    int k = l->k;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (pool_grow(threads)) threads = pool.started + 1;
    size_t r1 = rows ? (size_t)rows : 1;
    int8_t *xq = aligned(r1 * k);
    float *xs = malloc(sizeof(float) * r1);
    int16_t *xsum = malloc(sizeof(int16_t) * r1 * (k / GROUP));
    int32_t *total = malloc(sizeof(int32_t) * r1);
    int ok = xq && xs && xsum && total &&
             !marks_fit((size_t)(l->n + TILE - 1) / TILE * ((r1 + ROWS - 1) / ROWS));
    if (ok) {
        for (int r = 0; r < rows; r++)
            quantize_row(x + (size_t)r * k, k, xq + (size_t)r * k, xs + r,
                         xsum + (size_t)r * (k / GROUP), total + r);
        Pass one;
        run_program(threads, &one, (int)(gemm(&one, l, xq, xs, xsum, total, rows, y, l->n, 0) - &one));
    }
    quiesce(); /* a late thread may still read xq and the weights */
    free(xq);
    free(xs);
    free(xsum);
    free(total);
    return ok ? 0 : -1;
}

/* One Linear alone, for the paths that run a projection by itself (quality measures, a
 * model the whole step does not fit): y [rows, n] = x [rows, k] through l. */
int dc_linear(const int8_t *q, const float *scale, const float *bias, int n, int k, int rows,
              const float *x, float *y, int threads) {
    if (k % 32 || k > K8_MAX) return -1;
    Linear l = linear(q, scale, bias, n, k);
    return linear_alone(&l, rows, x, y, threads);
}

/* The same with 4-bit weights (q4 and sub as at dot4_rows) */
int dc_linear4(const uint8_t *q4, const uint8_t *sub, const float *scale, const int8_t *mins,
               const float *min_scale, const float *bias, int n, int k, int rows,
               const float *x, float *y, int threads) {
    if (k % 64 || k > K4_MAX) return -1;
    Linear l = {NULL, q4, sub, mins, min_scale, scale, bias, n, k};
    return linear_alone(&l, rows, x, y, threads);
}

/* The cache's conversions alone, for the tests: x [n] to float16 bits and those back (n a
 * multiple of 8). */
void dc_half(const float *x, int n, uint16_t *half, float *back) {
    for (int i = 0; i < n; i++) half[i] = to_half(x[i]);
    for (int i = 0; i < n; i += 8) {
        v8f f = from_half8(half + i);
        memcpy(back + i, &f, sizeof f);
    }
}

/* The work functions dc_test_pause names by number (library.py's PAUSABLE, in this order) */
static const work_fn pausable[] = {gemm_tiles, norm_rows, rope_and_store, attend,
                                   quantize_attn, silu_mul, gather_last};

void dc_test_pause(int us, int thread, int which) {
    if (which < 0 || which >= (int)(sizeof pausable / sizeof *pausable)) us = 0;
    else atomic_store(&pause_fn, pausable[which]);
    atomic_store(&pause_thread, thread);
    atomic_store(&pause_us, us);
}
