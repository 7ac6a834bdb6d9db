/* exp-split's hot loops in C (one pass over a layer); kvbench/codecs/exp_split.py holds the numpy
 * reference they must match bit for bit, and documents the frame.
 *
 * encode(kind, data, lut, streams, counts, pos, val, chunk_log2) -> escapes, or -1 when more than
 *     len(val) escapes (the caller then sends the layer raw).  kind 0 bf16, 1 fp16, 2 fp8-e5m2.
 * decode(kind, streams, counts, pos, val, exps, out, chunk_log2) -> None; ValueError on any slack bit
 *     that is not what the encoder writes (padding, an escape's code slot, positions, table exponents).
 * The GIL is released while the loops run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_module.h"
#include <stdint.h>
#include <string.h>

static Py_ssize_t stream_len(int kind, Py_ssize_t n) {
    if (kind == 0) return (n + 1) / 2 + n;
    return (kind == 1 ? n : 0) + 7 * ((n + 7) / 8);
}

static PyObject *encode(PyObject *self, PyObject *args) {
    int kind, clog;
    Py_buffer d, l, s, c, p, v;
    if (!PyArg_ParseTuple(args, "iy*y*w*w*w*w*i", &kind, &d, &l, &s, &c, &p, &v, &clog)) return NULL;
    Py_ssize_t width = kind == 2 ? 1 : 2, n = d.len / width, cap = v.len, nesc = 0;
    Py_ssize_t nchunks = (n + ((Py_ssize_t)1 << clog) - 1) >> clog;
    PyObject *ret = NULL;
    if (kind < 0 || kind > 2 || l.len != 256 || s.len != stream_len(kind, n) || c.len != 2 * nchunks ||
        p.len < 2 * cap || clog < 1 || clog > 16) {
        PyErr_SetString(PyExc_ValueError, "encode: buffer sizes do not match the layer");
        goto out;
    }
    /* restrict: the buffers never overlap, and uint8_t stores would otherwise alias every load */
    const uint8_t *restrict in = d.buf, *restrict lut = l.buf;
    uint8_t *restrict st = s.buf, *restrict val = v.buf;
    uint16_t *restrict cnt = c.buf, *restrict pos = p.buf;
    uint16_t mask = (uint16_t)((1u << clog) - 1);
    int over = 0;
    Py_BEGIN_ALLOW_THREADS
    memset(cnt, 0, 2 * nchunks);
    if (kind == 0) {
        uint8_t *restrict nib = st, *restrict sm = st + (n + 1) / 2;
        const uint16_t *in16 = (const uint16_t *)in;
        Py_ssize_t full = n & ~(Py_ssize_t)15;
        uint8_t codes[16];
        for (Py_ssize_t g = 0; g < full && !over; g += 16) {
            /* 16 elements branch-free; the rare group holding an escape takes the slow path below */
            uint8_t any = 0;
            for (int k = 0; k < 16; k++) {
                uint16_t v;
                memcpy(&v, in16 + g + k, 2);
                uint8_t c = lut[(v >> 7) & 0xFF];
                codes[k] = c;
                any |= c;
                sm[g + k] = (uint8_t)(((v >> 8) & 0x80) | (v & 0x7F));
            }
            if (__builtin_expect(any & 0x10, 0)) {
                for (int k = 0; k < 16; k++) {
                    if (!(codes[k] & 0x10)) continue;
                    if (nesc >= cap) { over = 1; break; }
                    Py_ssize_t i = g + k;
                    uint16_t v;
                    memcpy(&v, in16 + i, 2);
                    pos[nesc] = (uint16_t)(i & mask); val[nesc++] = (uint8_t)((v >> 7) & 0xFF); cnt[i >> clog]++;
                    codes[k] = 0;
                }
            }
            for (int k = 0; k < 8; k++) nib[(g >> 1) + k] = (uint8_t)(codes[2 * k] | (codes[2 * k + 1] << 4));
        }
        for (Py_ssize_t i = full; i < n && !over; i += 2) {
            /* the tail: two elements per nibble byte; a missing odd last element codes as 0 (checked padding) */
            uint8_t c0 = 0, c1 = 0;
            for (int k = 0; k < 2 && i + k < n; k++) {
                uint8_t lo = in[2 * (i + k)], hi = in[2 * (i + k) + 1];
                uint8_t e = (uint8_t)((hi << 1) | (lo >> 7)), c = lut[e];
                sm[i + k] = (hi & 0x80) | (lo & 0x7F);
                if (c & 0x10) {
                    if (nesc >= cap) { over = 1; break; }
                    pos[nesc] = (uint16_t)((i + k) & mask); val[nesc++] = e; cnt[(i + k) >> clog]++; c = 0;
                }
                if (k) c1 = c; else c0 = c;
            }
            nib[i >> 1] = (uint8_t)(c0 | (c1 << 4));
        }
    } else {
        uint8_t *restrict low = st, *restrict p7 = st + (kind == 1 ? n : 0);
        Py_ssize_t full = n & ~(Py_ssize_t)7;
        for (Py_ssize_t g = 0; g < full && !over; g += 8) {
            /* 8 values in 7 bytes, branch-free unless the group holds an escape */
            uint8_t his[8], codes[8], any = 0;
            if (kind == 1) {
                for (int k = 0; k < 8; k++) { low[g + k] = in[2 * (g + k)]; his[k] = in[2 * (g + k) + 1]; }
            } else {
                memcpy(his, in + g, 8);
            }
            for (int k = 0; k < 8; k++) { codes[k] = lut[(his[k] >> 2) & 0x1F]; any |= codes[k]; }
            if (__builtin_expect(any & 0x10, 0)) {
                for (int k = 0; k < 8; k++) {
                    if (!(codes[k] & 0x10)) continue;
                    if (nesc >= cap) { over = 1; break; }
                    Py_ssize_t i = g + k;
                    pos[nesc] = (uint16_t)(i & mask); val[nesc++] = (his[k] >> 2) & 0x1F; cnt[i >> clog]++;
                    codes[k] = 0;
                }
            }
            uint64_t acc = 0;
            for (int k = 0; k < 8; k++)
                acc |= (uint64_t)((codes[k] << 3) | ((his[k] >> 5) & 4) | (his[k] & 3)) << (7 * k);
            memcpy(p7 + 7 * (g / 8), &acc, 7);
        }
        if (full < n && !over) {  /* the last, partial group: padding values are 0 (checked on decode) */
            uint64_t acc = 0;
            for (Py_ssize_t i = full; i < n; i++) {
                uint8_t hi = kind == 1 ? in[2 * i + 1] : in[i];
                if (kind == 1) low[i] = in[2 * i];
                uint8_t e = (hi >> 2) & 0x1F, code = lut[e];
                if (code & 0x10) {
                    if (nesc >= cap) { over = 1; break; }
                    pos[nesc] = (uint16_t)(i & mask); val[nesc++] = e; cnt[i >> clog]++; code = 0;
                }
                acc |= (uint64_t)((code << 3) | ((hi >> 5) & 4) | (hi & 3)) << (7 * (i - full));
            }
            memcpy(p7 + 7 * (full / 8), &acc, 7);
        }
    }
    Py_END_ALLOW_THREADS
    ret = PyLong_FromSsize_t(over ? -1 : nesc);
out:
    PyBuffer_Release(&d); PyBuffer_Release(&l); PyBuffer_Release(&s); PyBuffer_Release(&c);
    PyBuffer_Release(&p); PyBuffer_Release(&v);
    return ret;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    int kind, clog;
    Py_buffer s, c, p, v, x, o;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*y*w*i", &kind, &s, &c, &p, &v, &x, &o, &clog)) return NULL;
    Py_ssize_t width = kind == 2 ? 1 : 2, n = o.len / width, nesc = v.len;
    Py_ssize_t nchunks = (n + ((Py_ssize_t)1 << clog) - 1) >> clog;
    const char *err = NULL;
    if (kind < 0 || kind > 2 || x.len != 16 || s.len != stream_len(kind, n) || c.len != 2 * nchunks ||
        p.len != 2 * nesc || clog < 1 || clog > 16) {
        PyBuffer_Release(&s); PyBuffer_Release(&c); PyBuffer_Release(&p); PyBuffer_Release(&v);
        PyBuffer_Release(&x); PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "frame streams have the wrong length for the layer");
        return NULL;
    }
    const uint8_t *st = s.buf, *val = v.buf, *exps = x.buf;
    const uint16_t *cnt = c.buf, *pos = p.buf;
    uint8_t *out = o.buf;
    Py_BEGIN_ALLOW_THREADS
    uint8_t intable[256] = {0};
    for (int k = 0; k < 16; k++) intable[exps[k]] = 1;
    if (kind == 0) {
        const uint8_t *nib = st, *sm = st + (n + 1) / 2;
        if (n % 2 && (nib[n / 2] >> 4)) err = "nibble stream padding is not zero";
        uint16_t *o16 = (uint16_t *)out;
        uint16_t ehi[16];  /* each code's exponent already in place: bits 14..7 */
        for (int k = 0; k < 16; k++) ehi[k] = (uint16_t)(exps[k] << 7);
        for (Py_ssize_t i = 0; i + 1 < n; i += 2) {
            uint8_t b = nib[i >> 1];
            uint16_t m0 = sm[i], m1 = sm[i + 1];
            uint16_t v0 = (uint16_t)(((m0 & 0x80) << 8) | ehi[b & 0xF] | (m0 & 0x7F));
            uint16_t v1 = (uint16_t)(((m1 & 0x80) << 8) | ehi[b >> 4] | (m1 & 0x7F));
            memcpy(o16 + i, &v0, 2);
            memcpy(o16 + i + 1, &v1, 2);
        }
        if (n % 2) {
            Py_ssize_t i = n - 1;
            uint8_t e = exps[nib[i >> 1] & 0xF], m = sm[i];
            out[2 * i + 1] = (m & 0x80) | (e >> 1);
            out[2 * i] = (uint8_t)(e << 7) | (m & 0x7F);
        }
    } else {
        const uint8_t *low = st, *p7 = st + (kind == 1 ? n : 0);
        uint8_t hib[128];  /* every 7-bit value's byte (sign, exponent, 2 mantissa bits) but for escapes */
        for (int r = 0; r < 128; r++) hib[r] = (uint8_t)(((r & 4) << 5) | (exps[r >> 3] << 2) | (r & 3));
        Py_ssize_t full = n & ~(Py_ssize_t)7;
        for (Py_ssize_t g = 0; g < full; g += 8) {
            uint64_t acc = 0;
            memcpy(&acc, p7 + 7 * (g / 8), 7);
            if (kind == 1) {
                for (int k = 0; k < 8; k++, acc >>= 7) {
                    out[2 * (g + k)] = low[g + k];
                    out[2 * (g + k) + 1] = hib[acc & 0x7F];
                }
            } else {
                for (int k = 0; k < 8; k++, acc >>= 7) out[g + k] = hib[acc & 0x7F];
            }
        }
        if (full < n) {
            uint64_t acc = 0;
            memcpy(&acc, p7 + 7 * (full / 8), 7);
            for (int k = 0; k < 8; k++, acc >>= 7) {
                Py_ssize_t i = full + k;
                uint8_t r = acc & 0x7F;
                if (i >= n) { if (r) err = "7-bit stream padding is not zero"; continue; }
                if (kind == 1) { out[2 * i] = low[i]; out[2 * i + 1] = hib[r]; } else out[i] = hib[r];
            }
        }
    }
    /* escapes: positions ascending inside their chunk, code slot 0, exponent not in the table */
    Py_ssize_t j = 0, last = -1;
    for (Py_ssize_t ch = 0; ch < nchunks && !err; ch++) {
        for (uint16_t k = 0; k < cnt[ch]; k++, j++) {
            if (j >= nesc) { err = "escape counts exceed the escapes"; break; }
            Py_ssize_t i = (ch << clog) + pos[j];
            if (pos[j] >> clog || i <= last || i >= n) { err = "escape positions out of order or out of range"; break; }
            last = i;
            uint8_t e = val[j];
            if (intable[e]) { err = "an escape carries an exponent that has a code"; break; }
            uint8_t code;
            if (kind == 0) {
                code = (st[i >> 1] >> ((i & 1) * 4)) & 0xF;
                out[2 * i + 1] = (out[2 * i + 1] & 0x80) | (e >> 1);
                out[2 * i] = (uint8_t)(e << 7) | (out[2 * i] & 0x7F);
            } else {
                const uint8_t *p7 = st + (kind == 1 ? n : 0);
                uint64_t acc = 0;
                memcpy(&acc, p7 + 7 * (i / 8), 7);
                code = (uint8_t)((acc >> (7 * (i % 8) + 3)) & 0xF);
                uint8_t *hp = kind == 1 ? &out[2 * i + 1] : &out[i];
                *hp = (uint8_t)((*hp & 0x83) | (e << 2));
            }
            if (code) { err = "an escape's code slot is not zero"; break; }
        }
    }
    if (!err && j != nesc) err = "escape counts do not add up to the escapes";
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&s); PyBuffer_Release(&c); PyBuffer_Release(&p); PyBuffer_Release(&v);
    PyBuffer_Release(&x); PyBuffer_Release(&o);
    if (err) { PyErr_SetString(PyExc_ValueError, err); return NULL; }
    Py_RETURN_NONE;
}

KV_MODULE(_codec, "exp-split encode/decode loops.",
          KV_METHOD(encode, "encode(kind, data, lut, streams, counts, pos, val, chunk_log2) -> escapes or -1"),
          KV_METHOD(decode, "decode(kind, streams, counts, pos, val, exps, out, chunk_log2)"))
