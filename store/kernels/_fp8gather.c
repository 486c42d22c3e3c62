/* store._fp8gather: table gathers for dequantising FP8 KV on the CPU.
 *
 * Dequantising an FP8 (e4m3) byte with a per-head scale has 256 possible results per
 * head, so store/table.py computes them once per head with PyTorch's own arithmetic
 * (fp32(value) * scale, rounded to the output dtype) and this module only looks them up:
 * dst[i] = table[src[i]]. The results are the reference bits by construction.
 *
 * One call runs a whole list of jobs (one per head of each stored part), so a hit costs
 * one call, with the GIL released. gather_blocks() and copy_blocks() take whole snapshot
 * payloads block by block (the tables made here from each head's scale) and copy the layers
 * stored unquantised. The caller (store.dequant) computes the addresses from
 * tensors it holds and checks every bound; nothing here is public API.
 *
 * On CPUs with AVX-512BW, 32 bytes at a time: four 64-entry word permutes cover the
 * 256-entry table and bits 6 and 7 of each byte select among them, and large aligned
 * outputs are written with streaming stores. With AVX2 only, 16 bytes at a time from the
 * form an e4m3 table has (two 8-entry shuffles and a multiply-add, gather16_avx2), for
 * every table found to have it, and streaming stores. Elsewhere, a plain loop.
 *
 * transpose_tiles() writes 2-byte tiles transposed (K into vLLM's CPU cache blocks, which
 * hold it [head_dim, block_size]), 8x8 at a time with SSE2, with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define KVW_X86 1
#include <immintrin.h>
#endif

static void gather16_scalar(const uint8_t *src, const uint16_t *lut, uint16_t *dst, size_t n, int may_stream) {
    (void)may_stream;
    for (size_t i = 0; i < n; i++) dst[i] = lut[src[i]];
}

static void gather32_scalar(const uint8_t *src, const uint32_t *lut, uint32_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = lut[src[i]];
}

#ifdef KVW_X86
__attribute__((target("avx512f,avx512bw")))
static void gather16_avx512(const uint8_t *src, const uint16_t *lut, uint16_t *dst, size_t n, int may_stream) {
    /* Streaming stores when the output is large and aligned: the output is new memory the
     * caller reads later, and plain stores would first read every line of it (22 MiB out,
     * the loader bench's geometry: 5.3 ms with plain stores, 3.2 ms streaming). */
    const int stream = may_stream && n >= 2048 && ((uintptr_t)dst & 63) == 0;
    const __m512i t0 = _mm512_loadu_si512((const void *)(lut + 0));
    const __m512i t1 = _mm512_loadu_si512((const void *)(lut + 32));
    const __m512i t2 = _mm512_loadu_si512((const void *)(lut + 64));
    const __m512i t3 = _mm512_loadu_si512((const void *)(lut + 96));
    const __m512i t4 = _mm512_loadu_si512((const void *)(lut + 128));
    const __m512i t5 = _mm512_loadu_si512((const void *)(lut + 160));
    const __m512i t6 = _mm512_loadu_si512((const void *)(lut + 192));
    const __m512i t7 = _mm512_loadu_si512((const void *)(lut + 224));
    const __m512i b6 = _mm512_set1_epi16(0x40), b7 = _mm512_set1_epi16(0x80);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + i)));
        /* bit 5 picks between the two tables of each permute, bits 0-4 the entry */
        __m512i r0 = _mm512_permutex2var_epi16(t0, idx, t1);  /* entries 0-63 */
        __m512i r1 = _mm512_permutex2var_epi16(t2, idx, t3);  /* 64-127 */
        __m512i r2 = _mm512_permutex2var_epi16(t4, idx, t5);  /* 128-191 */
        __m512i r3 = _mm512_permutex2var_epi16(t6, idx, t7);  /* 192-255 */
        __mmask32 m6 = _mm512_test_epi16_mask(idx, b6), m7 = _mm512_test_epi16_mask(idx, b7);
        __m512i lo = _mm512_mask_blend_epi16(m6, r0, r1), hi = _mm512_mask_blend_epi16(m6, r2, r3);
        __m512i r = _mm512_mask_blend_epi16(m7, lo, hi);
        if (stream) _mm512_stream_si512((void *)(dst + i), r);
        else _mm512_storeu_si512((void *)(dst + i), r);
    }
    if (stream) _mm_sfence();
    gather16_scalar(src + i, lut, dst + i, n - i, 0);
}
#endif

#ifdef KVW_X86
/* AVX2 (no AVX-512): no 256-entry shuffle, and 32-bit gathers (vpgatherdd, 8 entries at a
 * time) are no faster than the plain loop (Zen 3), so this uses what the table of an e4m3
 * byte holds. Byte s|eeee|mmm is the value (-1)^s 2^(e-7) (1 + m/8) (e > 0); times a scale
 * and rounded to a 2-byte float, its bits are B[m] + e * step (the exponent field counts e,
 * the rounding of the mantissa does not depend on it) while the results stay normal; e = 0
 * (zero and the subnormals) is 8 entries of its own; the sign bit of the byte flips the
 * result's; 0x7F and 0xFF (NaN) are two entries of their own. lut_structure() checks
 * every entry of a table against that form; a table that does not have it (a scale so
 * large or small that results leave the normal range) takes the plain loop. */
typedef struct {
    uint16_t norm[8], sub[8];  /* B[m] = entry(e = 1, m) - step; entry(e = 0, m) */
    uint16_t step, nan_pos, nan_neg;
} lut_form;

static int lut_structure(const uint16_t *lut, lut_form *f) {
    f->step = (uint16_t)(lut[16] - lut[8]);
    for (int m = 0; m < 8; m++) {
        f->sub[m] = lut[m];
        f->norm[m] = (uint16_t)(lut[8 + m] - f->step);
    }
    f->nan_pos = lut[0x7F];
    f->nan_neg = lut[0xFF];
    for (int k = 8; k < 0x7F; k++)
        if (lut[k] != (uint16_t)(f->norm[k & 7] + (k >> 3) * f->step)) return 0;
    for (int k = 0; k < 0x7F; k++)
        if (lut[0x80 + k] != (uint16_t)(lut[k] ^ 0x8000)) return 0;
    return 1;
}

__attribute__((target("avx2")))
static void gather16_avx2(const uint8_t *src, const uint16_t *lut, uint16_t *dst, size_t n, int may_stream) {
    lut_form f;
    if (n < 256 || !lut_structure(lut, &f)) {  /* short runs: not worth checking the table */
        gather16_scalar(src, lut, dst, n, 0);
        return;
    }
    const int stream = may_stream && n >= 2048 && ((uintptr_t)dst & 31) == 0;  /* as gather16_avx512, 32 bytes a store */
    const __m256i norm = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)f.norm));
    const __m256i sub = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)f.sub));
    const __m256i step = _mm256_set1_epi16((short)f.step);
    const __m256i nan_pos = _mm256_set1_epi16((short)f.nan_pos), nan_neg = _mm256_set1_epi16((short)f.nan_neg);
    const __m256i x7f = _mm256_set1_epi16(0x7F), seven = _mm256_set1_epi16(7), zero = _mm256_setzero_si256();
    /* pshufb index of 16-bit entry m: bytes 2m and 2m + 1 */
    const __m256i pair = _mm256_set1_epi16(0x0202), odd = _mm256_set1_epi16(0x0100);
    const __m256i sign_bit = _mm256_set1_epi16((short)0x8000);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m256i em = _mm256_and_si256(x, x7f);
        const __m256i e = _mm256_srli_epi16(em, 3);
        const __m256i idx = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_and_si256(x, seven), pair), odd);
        __m256i r = _mm256_add_epi16(_mm256_shuffle_epi8(norm, idx), _mm256_mullo_epi16(e, step));
        r = _mm256_blendv_epi8(r, _mm256_shuffle_epi8(sub, idx), _mm256_cmpeq_epi16(e, zero));
        const __m256i neg = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 15);  /* all ones where bit 7 */
        r = _mm256_xor_si256(r, _mm256_and_si256(neg, sign_bit));
        r = _mm256_blendv_epi8(r, _mm256_blendv_epi8(nan_pos, nan_neg, neg), _mm256_cmpeq_epi16(em, x7f));
        if (stream) _mm256_stream_si256((__m256i *)(dst + i), r);
        else _mm256_storeu_si256((__m256i *)(dst + i), r);
    }
    if (stream) _mm_sfence();
    gather16_scalar(src + i, lut, dst + i, n - i, 0);
}
#endif

/* Plain copies (layers kept unquantised) into the same new output: streaming stores for
 * large aligned destinations, for the reason given above (AVX2's 32 bytes a store: 24 MiB
 * out in 32 KiB rows, ~7% faster than memcpy on Zen 3); memcpy otherwise. */
static void copy_plain(const uint8_t *src, uint8_t *dst, size_t n) {
    memcpy(dst, src, n);
}

#ifdef KVW_X86
__attribute__((target("avx512f")))
static void copy_avx512(const uint8_t *src, uint8_t *dst, size_t n) {
    if (n < 4096 || ((uintptr_t)dst & 63) != 0) {
        memcpy(dst, src, n);
        return;
    }
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
}

__attribute__((target("avx2")))
static void copy_avx2(const uint8_t *src, uint8_t *dst, size_t n) {
    if (n < 4096 || ((uintptr_t)dst & 31) != 0) {
        memcpy(dst, src, n);
        return;
    }
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
}
#endif

typedef void (*copy_fn)(const uint8_t *, uint8_t *, size_t);
static copy_fn copy_bytes = copy_plain;

typedef void (*gather16_fn)(const uint8_t *, const uint16_t *, uint16_t *, size_t, int);

static gather16_fn pick_gather16(void) {
#ifdef KVW_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return gather16_avx512;
    if (__builtin_cpu_supports("avx2")) return gather16_avx2;
#endif
    return gather16_scalar;
}

static copy_fn pick_copy(void) {
#ifdef KVW_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return copy_avx512;
    if (__builtin_cpu_supports("avx2")) return copy_avx2;
#endif
    return copy_plain;
}

static gather16_fn gather16 = NULL;

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t need, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", name, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(gather_doc,
"gather(src, dst, count, tables, esize) -> None\n\n"
"For each job j: dst_j[i] = tables[j][src_j[i]] for i < count[j], where src_j and dst_j\n"
"are addresses (uint64 buffers src and dst), tables a buffer of 256 entries of esize\n"
"bytes (2 or 4) per job. Private to store.dequant, which checks every address.");

static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *osrc, *odst, *ocount, *otab;
    int esize;
    if (!PyArg_ParseTuple(args, "OOOOi", &osrc, &odst, &ocount, &otab, &esize)) return NULL;
    if (esize != 2 && esize != 4) {
        PyErr_Format(PyExc_ValueError, "esize must be 2 or 4, got %d", esize);
        return NULL;
    }
    Py_buffer src, dst, count, tab;
    if (PyObject_GetBuffer(osrc, &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t jobs = src.len / 8;
    if (get_buffer(odst, &dst, jobs * 8, 0, "dst") < 0) { PyBuffer_Release(&src); return NULL; }
    if (get_buffer(ocount, &count, jobs * 8, 0, "count") < 0) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); return NULL;
    }
    if (get_buffer(otab, &tab, jobs * 256 * esize, 0, "tables") < 0) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&count); return NULL;
    }
    const uint64_t *s = (const uint64_t *)src.buf, *d = (const uint64_t *)dst.buf, *c = (const uint64_t *)count.buf;
    const uint8_t *t = (const uint8_t *)tab.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < jobs; j++) {
        if (esize == 2) {
            uint16_t lut[256];  /* aligned copy: the tables buffer may be anywhere */
            memcpy(lut, t + (size_t)j * 512, 512);
            gather16((const uint8_t *)(uintptr_t)s[j], lut, (uint16_t *)(uintptr_t)d[j], (size_t)c[j], 1);
        } else {
            uint32_t lut[256];
            memcpy(lut, t + (size_t)j * 1024, 1024);
            gather32_scalar((const uint8_t *)(uintptr_t)s[j], lut, (uint32_t *)(uintptr_t)d[j], (size_t)c[j]);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&count); PyBuffer_Release(&tab);
    Py_RETURN_NONE;
}

/* One table entry: fp32(value) * scale rounded once to the output dtype, as PyTorch rounds
 * (store.table.tables is the reference; tests compare every byte value). bf16: round to
 * nearest even, every NaN to 0xFFFF (what Tensor.to(torch.bfloat16) gives on the CPU). */
static inline uint16_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if (x != x) return 0xFFFF;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static int get_u64(PyObject *obj, Py_buffer *view, Py_ssize_t n, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", name, view->len, n * 8);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(gather_blocks_doc,
"gather_blocks(bases, src, scale, rows, values, out, tokens, block, dim, esize) -> None\n\n"
"Dequantise FP8 heads of consecutive snapshot payloads (at addresses bases[i]) into out\n"
"(an address): job j of block i reads block*dim bytes at bases[i] + src[j] (at most the\n"
"tokens left), its fp32 scale at bases[i] + scale[j], makes the head's table from values\n"
"(the 256 FP8 values as float32) and writes row rows[j] of out, a [rows, tokens, dim]\n"
"array of esize-byte elements (2: bf16, 4: fp32), from token i * block on. Private to\n"
"store.table, which checks every address.");

static PyObject *gather_blocks(PyObject *self, PyObject *args) {
    PyObject *obases, *osrc, *oscale, *orows, *ovalues;
    unsigned long long out;
    Py_ssize_t tokens, block, dim;
    int esize;
    if (!PyArg_ParseTuple(args, "OOOOOKnnni", &obases, &osrc, &oscale, &orows, &ovalues, &out, &tokens, &block,
                          &dim, &esize)) return NULL;
    if (esize != 2 && esize != 4) {
        PyErr_Format(PyExc_ValueError, "esize must be 2 (bf16) or 4 (fp32), got %d", esize);
        return NULL;
    }
    Py_buffer bases, src, scale, rows, values;
    if (PyObject_GetBuffer(obases, &bases, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = bases.len / 8;
    if (PyObject_GetBuffer(osrc, &src, PyBUF_C_CONTIGUOUS) < 0) { PyBuffer_Release(&bases); return NULL; }
    Py_ssize_t jobs = src.len / 8;
    if (get_u64(oscale, &scale, jobs, "scale") < 0) { PyBuffer_Release(&bases); PyBuffer_Release(&src); return NULL; }
    if (get_u64(orows, &rows, jobs, "rows") < 0) {
        PyBuffer_Release(&bases); PyBuffer_Release(&src); PyBuffer_Release(&scale); return NULL;
    }
    if (get_buffer(ovalues, &values, 256 * 4, 0, "values") < 0) {
        PyBuffer_Release(&bases); PyBuffer_Release(&src); PyBuffer_Release(&scale); PyBuffer_Release(&rows);
        return NULL;
    }
    const uint64_t *b = (const uint64_t *)bases.buf, *so = (const uint64_t *)src.buf;
    const uint64_t *sc = (const uint64_t *)scale.buf, *ro = (const uint64_t *)rows.buf;
    float val[256];
    memcpy(val, values.buf, sizeof val);
    const size_t row_bytes = (size_t)tokens * (size_t)dim * (size_t)esize;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t left = tokens - i * block;
        if (left <= 0) break;
        size_t count = (size_t)(left < block ? left : block) * (size_t)dim;
        uint8_t *dst0 = (uint8_t *)(uintptr_t)out + (size_t)i * (size_t)block * (size_t)dim * (size_t)esize;
        for (Py_ssize_t j = 0; j < jobs; j++) {
            float s;
            memcpy(&s, (const uint8_t *)(uintptr_t)b[i] + sc[j], 4);
            const uint8_t *from = (const uint8_t *)(uintptr_t)b[i] + so[j];
            uint8_t *to = dst0 + ro[j] * row_bytes;
            if (esize == 2) {
                uint16_t lut[256];
                for (int k = 0; k < 256; k++) lut[k] = bf16_bits(val[k] * s);
                gather16(from, lut, (uint16_t *)to, count, 1);
            } else {
                uint32_t lut[256];
                for (int k = 0; k < 256; k++) {
                    float x = val[k] * s;
                    memcpy(&lut[k], &x, 4);
                }
                gather32_scalar(from, lut, (uint32_t *)to, count);
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bases); PyBuffer_Release(&src); PyBuffer_Release(&scale); PyBuffer_Release(&rows);
    PyBuffer_Release(&values);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_blocks_doc,
"copy_blocks(bases, src, rows, out, tokens, block, dim, esize) -> None\n\n"
"Copy heads stored unquantised: job j of block i copies up to block*dim esize-byte\n"
"elements from bases[i] + src[j] to row rows[j] of out (a [rows, tokens, dim] array at\n"
"that address) from token i * block on. Private to store.table, which checks every address.");

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    PyObject *obases, *osrc, *orows;
    unsigned long long out;
    Py_ssize_t tokens, block, dim;
    int esize;
    if (!PyArg_ParseTuple(args, "OOOKnnni", &obases, &osrc, &orows, &out, &tokens, &block, &dim, &esize))
        return NULL;
    Py_buffer bases, src, rows;
    if (PyObject_GetBuffer(obases, &bases, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = bases.len / 8;
    if (PyObject_GetBuffer(osrc, &src, PyBUF_C_CONTIGUOUS) < 0) { PyBuffer_Release(&bases); return NULL; }
    Py_ssize_t jobs = src.len / 8;
    if (get_u64(orows, &rows, jobs, "rows") < 0) { PyBuffer_Release(&bases); PyBuffer_Release(&src); return NULL; }
    const uint64_t *b = (const uint64_t *)bases.buf, *so = (const uint64_t *)src.buf, *ro = (const uint64_t *)rows.buf;
    const size_t row_bytes = (size_t)tokens * (size_t)dim * (size_t)esize;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t left = tokens - i * block;
        if (left <= 0) break;
        size_t nbytes = (size_t)(left < block ? left : block) * (size_t)dim * (size_t)esize;
        uint8_t *dst0 = (uint8_t *)(uintptr_t)out + (size_t)i * (size_t)block * (size_t)dim * (size_t)esize;
        for (Py_ssize_t j = 0; j < jobs; j++)
            copy_bytes((const uint8_t *)(uintptr_t)b[i] + so[j], dst0 + ro[j] * row_bytes, nbytes);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bases); PyBuffer_Release(&src); PyBuffer_Release(&rows);
    Py_RETURN_NONE;
}

/* Tile transposes of 2-byte elements (vLLM's CPU cache keeps K transposed in each block):
 * job j reads a [rows, cols] row-major tile at element offset src_off[j] of src and writes
 * it as [cols, rows] at element offset dst_off[j] of dst. 8x8 sub-tiles go through SSE2
 * unpacks (three rounds of interleaves), the edges through a plain loop. */
#ifdef KVW_X86
static inline void transpose8x8(const uint16_t *s, size_t ss, uint16_t *d, size_t ds) {
    __m128i r0 = _mm_loadu_si128((const __m128i *)(s + 0 * ss)), r1 = _mm_loadu_si128((const __m128i *)(s + 1 * ss));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * ss)), r3 = _mm_loadu_si128((const __m128i *)(s + 3 * ss));
    __m128i r4 = _mm_loadu_si128((const __m128i *)(s + 4 * ss)), r5 = _mm_loadu_si128((const __m128i *)(s + 5 * ss));
    __m128i r6 = _mm_loadu_si128((const __m128i *)(s + 6 * ss)), r7 = _mm_loadu_si128((const __m128i *)(s + 7 * ss));
    __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
    __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
    __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
    __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    _mm_storeu_si128((__m128i *)(d + 0 * ds), _mm_unpacklo_epi64(b0, b4));
    _mm_storeu_si128((__m128i *)(d + 1 * ds), _mm_unpackhi_epi64(b0, b4));
    _mm_storeu_si128((__m128i *)(d + 2 * ds), _mm_unpacklo_epi64(b1, b5));
    _mm_storeu_si128((__m128i *)(d + 3 * ds), _mm_unpackhi_epi64(b1, b5));
    _mm_storeu_si128((__m128i *)(d + 4 * ds), _mm_unpacklo_epi64(b2, b6));
    _mm_storeu_si128((__m128i *)(d + 5 * ds), _mm_unpackhi_epi64(b2, b6));
    _mm_storeu_si128((__m128i *)(d + 6 * ds), _mm_unpacklo_epi64(b3, b7));
    _mm_storeu_si128((__m128i *)(d + 7 * ds), _mm_unpackhi_epi64(b3, b7));
}
#endif

/* A strided 2-byte transpose: d[c * ds + r] = s[r * ss + c] for r < rows, c < cols. */
static void transpose_strided16(const uint16_t *s, size_t ss, uint16_t *d, size_t ds, size_t rows, size_t cols) {
    size_t r8 = 0, c8 = 0;
#ifdef KVW_X86
    r8 = rows - rows % 8;
    c8 = cols - cols % 8;
    for (size_t r = 0; r < r8; r += 8)
        for (size_t c = 0; c < c8; c += 8) transpose8x8(s + r * ss + c, ss, d + c * ds + r, ds);
#endif
    for (size_t r = 0; r < rows; r++)
        for (size_t c = (r < r8 ? c8 : 0); c < cols; c++) d[c * ds + r] = s[r * ss + c];
}

/* A [rows, cols] tile written [cols, rows], both contiguous. */
static void transpose_tile16(const uint16_t *s, uint16_t *d, size_t rows, size_t cols) {
    transpose_strided16(s, cols, d, rows, rows, cols);
}

PyDoc_STRVAR(transpose_tiles_doc,
"transpose_tiles(src, dst, src_off, dst_off, rows, cols) -> None\n\n"
"For each job j: the [rows, cols] tile of 2-byte elements at element offset src_off[j] of src\n"
"(int64 buffers of offsets) is written transposed, [cols, rows], at element offset dst_off[j]\n"
"of dst. Every tile is checked against its buffer's length. Private to store.kernels.tiles.");

static PyObject *transpose_tiles(PyObject *self, PyObject *args) {
    PyObject *osrc, *odst, *oso, *odo;
    Py_ssize_t rows, cols;
    if (!PyArg_ParseTuple(args, "OOOOnn", &osrc, &odst, &oso, &odo, &rows, &cols)) return NULL;
    if (rows < 1 || cols < 1) {
        PyErr_Format(PyExc_ValueError, "tiles of %zd x %zd elements", rows, cols);
        return NULL;
    }
    Py_buffer src, dst, so, dof;
    if (PyObject_GetBuffer(osrc, &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(odst, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) { PyBuffer_Release(&src); return NULL; }
    if (PyObject_GetBuffer(oso, &so, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); return NULL;
    }
    Py_ssize_t jobs = so.len / 8;
    if (get_buffer(odo, &dof, jobs * 8, 0, "dst_off") < 0) {
        PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&so); return NULL;
    }
    const int64_t *sof = (const int64_t *)so.buf, *dsf = (const int64_t *)dof.buf;
    const Py_ssize_t tile = rows * cols, slen = src.len / 2, dlen = dst.len / 2;
    for (Py_ssize_t j = 0; j < jobs; j++) {
        if (sof[j] < 0 || sof[j] > slen - tile || dsf[j] < 0 || dsf[j] > dlen - tile) {
            PyErr_Format(PyExc_ValueError, "tile %zd (offsets %lld, %lld) is outside its buffers", j,
                         (long long)sof[j], (long long)dsf[j]);
            PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&so); PyBuffer_Release(&dof);
            return NULL;
        }
    }
    const uint16_t *s = (const uint16_t *)src.buf;
    uint16_t *d = (uint16_t *)dst.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < jobs; j++) transpose_tile16(s + sof[j], d + dsf[j], (size_t)rows, (size_t)cols);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src); PyBuffer_Release(&dst); PyBuffer_Release(&so); PyBuffer_Release(&dof);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gather_vec_doc,
"gather_vec(bases, src, scale, rows, csrc, crows, values, caches, ids, tokens, block, dim, heads, ebs, skip,\n"
"           num_blocks) -> None\n\n"
"gather_blocks() for bf16 with vLLM's CPU cache blocks (cpu_vec) as the output: job j of snapshot\n"
"block i dequantises one head (its table from its fp32 scale at bases[i] + scale[j]) and writes\n"
"token t (skip <= t < tokens) of it into engine block ids[(t - skip) / ebs] of the layer cache at\n"
"address caches[rows[j] / (2 * heads)], a [num_blocks, heads, 2, ebs * dim] array of 2-byte elements\n"
"whose (block, head) holds K transposed ([dim, ebs]) then V ([ebs, dim]); rows[j] is\n"
"(2 * layer + (0: K, 1: V)) * heads + head. K goes through a reused tile, V straight into its block.\n"
"Copy job c (a head stored in bf16) reads bases[i] + csrc[c] and writes row crows[c] the same way.\n"
"Block ids, rows and the token range are checked here; the addresses by store.kernels.table.");

static PyObject *gather_vec(PyObject *self, PyObject *args) {
    PyObject *obases, *osrc, *oscale, *orows, *ocsrc, *ocrows, *ovalues, *ocaches, *oids;
    Py_ssize_t tokens, block, dim, heads, ebs, skip, num_blocks;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnnnnnnn", &obases, &osrc, &oscale, &orows, &ocsrc, &ocrows, &ovalues,
                          &ocaches, &oids,
                          &tokens, &block, &dim, &heads, &ebs, &skip, &num_blocks)) return NULL;
    if (block < 1 || dim < 1 || heads < 1 || ebs < 1 || skip < 0 || skip >= tokens || (tokens - skip) % ebs) {
        PyErr_Format(PyExc_ValueError, "tokens %zd from %zd are not whole engine blocks of %zd (block %zd, dim %zd, "
                     "heads %zd)", tokens, skip, ebs, block, dim, heads);
        return NULL;
    }
    Py_buffer bases, src, scale, rows, csrc, crows, values, caches, ids;
    if (PyObject_GetBuffer(obases, &bases, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = bases.len / 8;
    if (PyObject_GetBuffer(osrc, &src, PyBUF_C_CONTIGUOUS) < 0) { PyBuffer_Release(&bases); return NULL; }
    Py_ssize_t jobs = src.len / 8;
    int got = 2;
    if (get_u64(oscale, &scale, jobs, "scale") < 0) goto fail;
    got = 3;
    if (get_u64(orows, &rows, jobs, "rows") < 0) goto fail;
    got = 4;
    if (PyObject_GetBuffer(ocsrc, &csrc, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    got = 4;
    Py_ssize_t copies = csrc.len / 8;
    if (get_u64(ocrows, &crows, copies, "crows") < 0) goto fail;
    got = 5;
    if (get_buffer(ovalues, &values, 256 * 4, 0, "values") < 0) goto fail;
    got = 6;
    if (PyObject_GetBuffer(ocaches, &caches, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    got = 7;
    if (get_u64(oids, &ids, (tokens - skip) / ebs, "ids") < 0) goto fail;
    got = 8;
    if (n * block < tokens) {
        PyErr_Format(PyExc_ValueError, "%zd blocks of %zd tokens do not hold %zd tokens", n, block, tokens);
        goto fail;
    }
    const Py_ssize_t layers = caches.len / 8, count_ids = (tokens - skip) / ebs;
    const uint64_t *rw = (const uint64_t *)rows.buf, *crw = (const uint64_t *)crows.buf;
    const int64_t *id = (const int64_t *)ids.buf;
    for (Py_ssize_t j = 0; j < jobs + copies; j++) {
        const uint64_t r = j < jobs ? rw[j] : crw[j - jobs];
        if (r >= (uint64_t)(2 * heads * layers)) {
            PyErr_Format(PyExc_ValueError, "job %zd writes row %llu of %zd", j, (unsigned long long)r,
                         2 * heads * layers);
            goto fail;
        }
    }
    for (Py_ssize_t e = 0; e < count_ids; e++)
        if (id[e] < 0 || id[e] >= num_blocks) {
            PyErr_Format(PyExc_ValueError, "block id %lld is outside the cache's %zd blocks", (long long)id[e],
                         num_blocks);
            goto fail;
        }
    uint16_t *tile = (uint16_t *)PyMem_RawMalloc((size_t)block * (size_t)dim * 2);
    if (tile == NULL) { PyErr_NoMemory(); goto fail; }
    const uint64_t *b = (const uint64_t *)bases.buf, *so = (const uint64_t *)src.buf, *cso = (const uint64_t *)csrc.buf;
    const uint64_t *sc = (const uint64_t *)scale.buf, *cb = (const uint64_t *)caches.buf;
    float val[256];
    memcpy(val, values.buf, sizeof val);
    const size_t D = (size_t)dim, E = (size_t)ebs, half = E * D;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t t0 = i * block;
        if (t0 >= tokens) break;
        const Py_ssize_t t1 = (tokens - t0 < block) ? tokens : t0 + block;
        if (t1 <= skip) continue;
        const Py_ssize_t from_t = t0 > skip ? t0 : skip;
        for (Py_ssize_t j = 0; j < jobs; j++) {
            float s;
            memcpy(&s, (const uint8_t *)(uintptr_t)b[i] + sc[j], 4);
            uint16_t lut[256];
            for (int k = 0; k < 256; k++) lut[k] = bf16_bits(val[k] * s);
            const uint8_t *head = (const uint8_t *)(uintptr_t)b[i] + so[j];
            const size_t layer = (size_t)(rw[j] / (uint64_t)(2 * heads)), kv = (size_t)((rw[j] / (uint64_t)heads) % 2);
            const size_t h = (size_t)(rw[j] % (uint64_t)heads);
            uint16_t *cache = (uint16_t *)(uintptr_t)cb[layer];
            if (kv == 0)  /* K: the head's tokens into the tile (kept in cache), then transposed per engine block */
                gather16(head + (size_t)(from_t - t0) * D, lut, tile, (size_t)(t1 - from_t) * D, 0);
            for (Py_ssize_t t = from_t; t < t1;) {
                const Py_ssize_t e = (t - skip) / ebs, slot = (t - skip) % ebs;
                const Py_ssize_t len = (ebs - slot < t1 - t) ? ebs - slot : t1 - t;
                uint16_t *dst = cache + (((size_t)id[e] * (size_t)heads + h) * 2 + kv) * half;
                if (kv == 0)
                    transpose_strided16(tile + (size_t)(t - from_t) * D, D, dst + slot, E, (size_t)len, D);
                else
                    gather16(head + (size_t)(t - t0) * D, lut, dst + (size_t)slot * D, (size_t)len * D, 1);
                t += len;
            }
        }
        for (Py_ssize_t c = 0; c < copies; c++) {  /* heads stored in bf16: K transposed, V copied */
            const uint16_t *head = (const uint16_t *)((const uint8_t *)(uintptr_t)b[i] + cso[c]);
            const size_t layer = (size_t)(crw[c] / (uint64_t)(2 * heads)), kv = (size_t)((crw[c] / (uint64_t)heads) % 2);
            const size_t h = (size_t)(crw[c] % (uint64_t)heads);
            uint16_t *cache = (uint16_t *)(uintptr_t)cb[layer];
            for (Py_ssize_t t = from_t; t < t1;) {
                const Py_ssize_t e = (t - skip) / ebs, slot = (t - skip) % ebs;
                const Py_ssize_t len = (ebs - slot < t1 - t) ? ebs - slot : t1 - t;
                uint16_t *dst = cache + (((size_t)id[e] * (size_t)heads + h) * 2 + kv) * half;
                if (kv == 0)
                    transpose_strided16(head + (size_t)(t - t0) * D, D, dst + slot, E, (size_t)len, D);
                else
                    memcpy(dst + (size_t)slot * D, head + (size_t)(t - t0) * D, (size_t)len * D * 2);
                t += len;
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(tile);
    PyBuffer_Release(&bases); PyBuffer_Release(&src); PyBuffer_Release(&scale); PyBuffer_Release(&rows);
    PyBuffer_Release(&csrc); PyBuffer_Release(&crows); PyBuffer_Release(&values); PyBuffer_Release(&caches);
    PyBuffer_Release(&ids);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&bases); PyBuffer_Release(&src);
    if (got > 2) PyBuffer_Release(&scale);
    if (got > 3) PyBuffer_Release(&rows);
    if (got > 4) PyBuffer_Release(&csrc);
    if (got > 5) PyBuffer_Release(&crows);
    if (got > 6) PyBuffer_Release(&values);
    if (got > 7) PyBuffer_Release(&caches);
    if (got > 8) PyBuffer_Release(&ids);
    return NULL;
}

/* FP8 (e4m3) quantisation of bf16 KV, per head, with the codec's bits (store.format.precision.quantize,
 * store.kernels.gather.quantise_blocks): for each tile (one block's head: tokens * dim values)
 * xf = fp32(x); amax = max |xf| (a NaN anywhere: no scale); scale = amax > 0 ? amax / 448 : 1;
 * q = e4m3(clamp(xf / scale, -448, 448)) rounded as PyTorch rounds (c10's fp8e4m3fn_from_fp32_value);
 * back = fp32(q) * scale - xf, each operation rounded alone (no fused multiply-add: the file is built
 * with -ffp-contract=off). The caller takes the norms of back and xf with torch. */
static inline float f32_of_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* e4m3 as c10's fp8e4m3fn_from_fp32_value rounds (of a value already clamped to +-448): a NaN stays
 * one (0x7F), below 2^-6 a subnormal (rounded by the FPU's add), else round to nearest even on the bits. */
static inline uint8_t e4m3_of(float y) {
    uint32_t fb = bits_of_f32(y);
    const uint32_t sign = fb & UINT32_C(0x80000000), denorm = UINT32_C(141) << 23;
    uint32_t code;
    fb ^= sign;
    if (fb >= (UINT32_C(1087) << 20)) code = 0x7f;
    else if (fb < (UINT32_C(121) << 23)) code = bits_of_f32(f32_of_bits(fb) + f32_of_bits(denorm)) - denorm;
    else code = (fb + ((uint32_t)(7 - 127) << 23) + UINT32_C(0x7FFFF) + ((fb >> 20) & 1)) >> 20;
    return (uint8_t)(code | (sign >> 24));
}

/* An e4m3 code's fp32 value, exactly (normals are fp32 normals, subnormals m * 2^-9, 0x7F a NaN). */
static inline float f32_of_e4m3(uint8_t code) {
    uint32_t e = (code >> 3) & 0xF, m = code & 7;
    float mag = (code & 0x7f) == 0x7f ? f32_of_bits(UINT32_C(0x7FC00000))
              : e ? f32_of_bits(((e + 120) << 23) | (m << 20)) : (float)m * (1.0f / 512.0f);
    return (code & 0x80) ? -mag : mag;
}

static float tile_scale(float amax, int nan) { return (!nan && amax > 0.0f) ? amax / 448.0f : 1.0f; }

static void quantise_values(const float *w, uint8_t *c, float *b, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) {
        float y = w[i] / scale;
        y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
        c[i] = e4m3_of(y);
        float d = f32_of_e4m3(c[i]) * scale;
        b[i] = d - w[i];
    }
}

static float quantise_tile_scalar(const uint16_t *a, float *w, uint8_t *c, float *b, size_t n) {
    float amax = 0.0f;
    int nan = 0;
    for (size_t i = 0; i < n; i++) {
        float v = f32_of_bits((uint32_t)a[i] << 16), m = v < 0.0f ? -v : v;
        w[i] = v;
        if (m != m) nan = 1;
        else if (m > amax) amax = m;
    }
    const float scale = tile_scale(amax, nan);
    quantise_values(w, c, b, n, scale);
    return scale;
}

#ifdef KVW_X86
/* The same, 16 values at a time: the conversion's three cases as masks, every product and difference an
 * intrinsic of its own (never fused); the last n % 16 values take the scalar loop. */
__attribute__((target("avx512f,avx512bw")))
static float quantise_tile_avx512(const uint16_t *a, float *w, uint8_t *c, float *b, size_t n) {
    const size_t n16 = n - n % 16;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    for (size_t i = 0; i < n16; i += 16) {
        __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + i))), 16);
        __m512 v = _mm512_castsi512_ps(wide);
        _mm512_storeu_ps(w + i, v);
        __m512 m = _mm512_castsi512_ps(_mm512_and_si512(wide, absmask));
        nan |= _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
        amax = _mm512_max_ps(m, amax);  /* a NaN m gives amax: NaNs are counted apart */
    }
    float top = _mm512_reduce_max_ps(amax);
    int any_nan = nan != 0;
    for (size_t i = n16; i < n; i++) {
        float v = f32_of_bits((uint32_t)a[i] << 16), m = v < 0.0f ? -v : v;
        w[i] = v;
        if (m != m) any_nan = 1;
        else if (m > top) top = m;
    }
    const float scale = tile_scale(top, any_nan);
    const __m512 vs = _mm512_set1_ps(scale), hi = _mm512_set1_ps(448.0f), lo = _mm512_set1_ps(-448.0f);
    const __m512i signbit = _mm512_set1_epi32((int)0x80000000u), denorm = _mm512_set1_epi32(141 << 23);
    const __m512i bias = _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu)), one = _mm512_set1_epi32(1);
    const __m512i nan_from = _mm512_set1_epi32(1087 << 20), small_below = _mm512_set1_epi32(121 << 23);
    const __m512i x7f = _mm512_set1_epi32(0x7f), x80 = _mm512_set1_epi32(0x80), seven = _mm512_set1_epi32(7);
    const __m512i fifteen = _mm512_set1_epi32(15), e_bias = _mm512_set1_epi32(120);
    const __m512 qnan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)), ninth = _mm512_set1_ps(1.0f / 512.0f);
    for (size_t i = 0; i < n16; i += 16) {
        __m512 x = _mm512_loadu_ps(w + i);
        __m512 y = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_div_ps(x, vs)));  /* a NaN passes through */
        __m512i fb = _mm512_castps_si512(y);
        __m512i sign = _mm512_and_si512(fb, signbit);
        fb = _mm512_xor_si512(fb, sign);
        __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(fb, bias),
                                                              _mm512_and_si512(_mm512_srli_epi32(fb, 20), one)), 20);
        __m512i small = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(fb),
                                                                            _mm512_castsi512_ps(denorm))), denorm);
        __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(fb, small_below), normal, small);
        code = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(fb, nan_from), code, x7f);
        code = _mm512_or_si512(_mm512_and_si512(code, x7f), _mm512_srli_epi32(sign, 24));
        _mm_storeu_si128((__m128i *)(c + i), _mm512_cvtepi32_epi8(code));
        __m512i e = _mm512_and_si512(_mm512_srli_epi32(code, 3), fifteen), m = _mm512_and_si512(code, seven);
        __m512 mag = _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, e_bias), 23),
                                                         _mm512_slli_epi32(m, 20)));
        mag = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), mag,
                                   _mm512_mul_ps(_mm512_cvtepi32_ps(m), ninth));
        mag = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(_mm512_and_si512(code, x7f), x7f), mag, qnan);
        __m512 d = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag),
                                                       _mm512_slli_epi32(_mm512_and_si512(code, x80), 24)));
        _mm512_storeu_ps(b + i, _mm512_sub_ps(_mm512_mul_ps(d, vs), x));
    }
    quantise_values(w + n16, c + n16, b + n16, n - n16, scale);
    return scale;
}
#endif

typedef float (*quantise_fn)(const uint16_t *, float *, uint8_t *, float *, size_t);
static quantise_fn quantise_tile = quantise_tile_scalar;

PyDoc_STRVAR(quantise_heads_doc,
"quantise_heads(x, xf, q, back, scales, tile) -> None\n\n"
"x: bf16 bits (2-byte elements) of whole tiles of tile values each; xf and back: fp32 outputs of\n"
"x's size; q: one byte per value; scales: one fp32 per tile. See the comment above it in the\n"
"source for what is computed. Private to store.kernels.gather.");

static PyObject *quantise_heads(PyObject *self, PyObject *args) {
    PyObject *ox, *oxf, *oq, *oback, *oscales;
    Py_ssize_t tile;
    if (!PyArg_ParseTuple(args, "OOOOOn", &ox, &oxf, &oq, &oback, &oscales, &tile)) return NULL;
    if (tile < 1) { PyErr_Format(PyExc_ValueError, "tiles of %zd values", tile); return NULL; }
    Py_buffer x, xf, q, back, sc;
    if (PyObject_GetBuffer(ox, &x, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = x.len / 2, tiles = n / tile;
    if (n % tile) {
        PyErr_Format(PyExc_ValueError, "%zd values are not whole tiles of %zd", n, tile);
        PyBuffer_Release(&x); return NULL;
    }
    if (get_buffer(oxf, &xf, n * 4, 1, "xf") < 0) { PyBuffer_Release(&x); return NULL; }
    if (get_buffer(oq, &q, n, 1, "q") < 0) { PyBuffer_Release(&x); PyBuffer_Release(&xf); return NULL; }
    if (get_buffer(oback, &back, n * 4, 1, "back") < 0) {
        PyBuffer_Release(&x); PyBuffer_Release(&xf); PyBuffer_Release(&q); return NULL;
    }
    if (get_buffer(oscales, &sc, tiles * 4, 1, "scales") < 0) {
        PyBuffer_Release(&x); PyBuffer_Release(&xf); PyBuffer_Release(&q); PyBuffer_Release(&back); return NULL;
    }
    const uint16_t *xs = (const uint16_t *)x.buf;
    float *xo = (float *)xf.buf, *bo = (float *)back.buf, *so = (float *)sc.buf;
    uint8_t *qo = (uint8_t *)q.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < tiles; t++)
        so[t] = quantise_tile(xs + t * tile, xo + t * tile, qo + t * tile, bo + t * tile, (size_t)tile);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x); PyBuffer_Release(&xf); PyBuffer_Release(&q); PyBuffer_Release(&back); PyBuffer_Release(&sc);
    Py_RETURN_NONE;
}

static quantise_fn pick_quantise(void) {
#ifdef KVW_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return quantise_tile_avx512;
#endif
    return quantise_tile_scalar;
}

static PyObject *isa(PyObject *self, PyObject *noargs) {
#ifdef KVW_X86
    if (gather16 == gather16_avx512) return PyUnicode_FromString("avx512bw");
    if (gather16 == gather16_avx2) return PyUnicode_FromString("avx2");
#endif
    return PyUnicode_FromString("scalar");
}

static PyObject *use_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (strcmp(name, "scalar") == 0) {
        gather16 = gather16_scalar;
        copy_bytes = copy_plain;
        quantise_tile = quantise_tile_scalar;
    } else if (strcmp(name, "best") == 0) {
        gather16 = pick_gather16();
        copy_bytes = pick_copy();
        quantise_tile = pick_quantise();
    } else {
        PyErr_Format(PyExc_ValueError, "unknown instruction set %s: use 'scalar' or 'best'", name);
        return NULL;
    }
    return isa(self, NULL);
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"gather_blocks", gather_blocks, METH_VARARGS, gather_blocks_doc},
    {"copy_blocks", copy_blocks, METH_VARARGS, copy_blocks_doc},
    {"transpose_tiles", transpose_tiles, METH_VARARGS, transpose_tiles_doc},
    {"gather_vec", gather_vec, METH_VARARGS, gather_vec_doc},
    {"quantise_heads", quantise_heads, METH_VARARGS, quantise_heads_doc},
    {"isa", isa, METH_NOARGS, "The instruction set the 2-byte gather uses on this CPU: avx512bw, avx2 or scalar."},
    {"use_isa", use_isa, METH_VARARGS,
     "use_isa('scalar' | 'best') -> str: pin the plain loops (what CPUs without AVX2 run; for\n"
     "tests and benches) or go back to the best this CPU has. Not thread-safe against running gathers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "store._fp8gather",
    "Table gathers for dequantising FP8 KV on the CPU (private to store.dequant).", -1, methods,
};

PyMODINIT_FUNC PyInit__fp8gather(void) {
    gather16 = pick_gather16();
    copy_bytes = pick_copy();
    quantise_tile = pick_quantise();
    return PyModule_Create(&module);
}
