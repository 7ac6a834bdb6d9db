/* Keyed pool contents: what no transport can predict, from a counter-based generator under a secret key.
 *
 * Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) keyed by a 64-bit content
 * key derived from the secret the run draws.  The byte at pool offset o of
 * rank r is byte o % 16 of block o / 16, a block being the four 32-bit words (little-endian) of
 * philox({blk lo, blk hi, r, SALT}, key).  Without the key no transport can produce a byte it did not carry;
 * kvbench/memory/keyed.py holds the pure-Python reference and the torch version these bytes must match.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_module.h"

#define M0 0xD2511F53u
#define M1 0xCD9E8D57u
#define W0 0x9E3779B9u
#define W1 0xBB67AE85u
#define SALT 0x6B766263u /* "kvbc": the counter's fourth word */

static inline void block(uint64_t blk, uint32_t rank, uint32_t k0, uint32_t k1, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)blk, c1 = (uint32_t)(blk >> 32), c2 = rank, c3 = SALT;
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)M0 * c0, p1 = (uint64_t)M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += W0;
        k1 += W1;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* Four consecutive blocks at once: independent chains the CPU overlaps (and SSE2's pmuludq can vectorise). */
static inline void block4(uint64_t blk, uint32_t rank, uint32_t k0, uint32_t k1, uint32_t out[16]) {
    uint32_t c0[4], c1[4], c2[4], c3[4];
    for (int j = 0; j < 4; j++)
        c0[j] = (uint32_t)(blk + j), c1[j] = (uint32_t)((blk + j) >> 32), c2[j] = rank, c3[j] = SALT;
    for (int r = 0; r < 10; r++) {
        for (int j = 0; j < 4; j++) {
            uint64_t p0 = (uint64_t)M0 * c0[j], p1 = (uint64_t)M1 * c2[j];
            uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[j] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3[j] ^ k1;
            c1[j] = (uint32_t)p1, c3[j] = (uint32_t)p0, c0[j] = n0, c2[j] = n2;
        }
        k0 += W0;
        k1 += W1;
    }
    for (int j = 0; j < 4; j++) out[4 * j] = c0[j], out[4 * j + 1] = c1[j], out[4 * j + 2] = c2[j], out[4 * j + 3] = c3[j];
}

/* The content of [off, off + n) into dst, each byte XOR-ed with `flip`. */
static void content(unsigned char *dst, int64_t off, int64_t n, uint32_t rank, uint32_t k0, uint32_t k1,
                    unsigned char flip) {
    uint32_t w[4];
    unsigned char *b = (unsigned char *)w;
    uint32_t w4[16];
    while (n > 0 && (off & 15) == 0 && n >= 64) {
        block4((uint64_t)off >> 4, rank, k0, k1, w4);
        if (flip)
            for (int k = 0; k < 16; k++) w4[k] = ~w4[k];
        memcpy(dst, w4, 64);
        dst += 64, off += 64, n -= 64;
    }
    while (n > 0) {
        int64_t lead = off & 15, take = 16 - lead < n ? 16 - lead : n;
        block((uint64_t)off >> 4, rank, k0, k1, w);
        if (flip)
            for (int k = 0; k < 4; k++) w[k] = ~w[k];
        memcpy(dst, b + lead, (size_t)take);
        dst += take, off += take, n -= take;
    }
}

/* ranges(out, descs, k0, k1, rank, place, flip): the content of every row's SRC range of rank's pool under key
 * (k0, k1) written into out: back to back (place -1) or at the row's column `place` (0: SRC, 1: DST); flip 1
 * writes the complement. */
static PyObject *ranges(PyObject *self, PyObject *args) {
    PyObject *out_o, *d_o;
    unsigned int k0, k1, rank;
    int place, flip;
    Py_buffer out, dv;
    if (!PyArg_ParseTuple(args, "OOIIIii", &out_o, &d_o, &k0, &k1, &rank, &place, &flip)) return NULL;
    if (place < -1 || place > 1) {
        PyErr_SetString(PyExc_ValueError, "place is -1 (back to back), 0 (SRC) or 1 (DST)");
        return NULL;
    }
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(d_o, &dv, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t n = dv.len / (3 * (Py_ssize_t)sizeof(int64_t));
    const int64_t *d = (const int64_t *)dv.buf;
    int64_t at = 0, bad = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        int64_t o = place < 0 ? at : d[3 * i + place], len = d[3 * i + 2];
        bad = len < 0 || d[3 * i] < 0 || o < 0 || o + len > (int64_t)out.len;
        at += len;
    }
    if (bad) {
        PyBuffer_Release(&dv);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "a range falls outside the output buffer");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t o = place < 0 ? at : d[3 * i + place], len = d[3 * i + 2];
        content((unsigned char *)out.buf + o, d[3 * i], len, rank, k0, k1, flip ? 0xFF : 0);
        at += len;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dv);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

KV_MODULE(_keyed, "Keyed pool contents (Philox4x32-10): what no transport can predict.",
          KV_METHOD(ranges, "ranges(out, descs, k0, k1, rank, place, flip): the keyed content of each row's SRC range, back to back (place -1) or at column place, complemented when flip."))
