/* Batched data movement for the timed path: one Python call per layer, not per block.
 *
 * copy_batch(dst, src, descs)       memcpy dst[D:D+L] = src[S:S+L] for every row (S, D, L)
 * sendv(fd, buf, descs, col[, head]) writev the bytes `head` (a small header, optional), then
 *                                   buf[row[col] : +L] for every row, until all sent
 * recvv(fd, buf, descs, col[, expect])  first read len(expect) bytes (a header) and compare them
 *                                   with `expect`: on a mismatch return the bytes read and move no
 *                                   payload; else readv into buf[row[col] : +L] for every row
 *     Both return, when every byte moved, the CLOCK_MONOTONIC time (= time.perf_counter()) at
 *     which the last one did: stamped here, not after the thread is back in Python.
 * relay(ctl, fd, pending, wlock, spin)  a pull destination's control thread: read 32-byte
 *     layer-ready headers from ctl; for each, the request header pending[tag] (if the read is
 *     posted) goes out on fd under wlock, else pending[tag] = None marks the signal early.
 *     Returns only with a header that is not a layer-ready signal (raises on a socket error).
 *
 * call_copies(fn, dst, src, descs, stream)  fn(dst + D, src + S, L, stream) for every row, stopping
 *     at the first non-zero return (returned with the row's index); fn is the address of a function
 *     with cuMemcpyAsync's signature (CUdeviceptr, CUdeviceptr, size_t, CUstream) -> int: one
 *     driver call per descriptor without a Python loop.  Addresses are not bounds-checked here
 *     (device memory): the caller checks the descriptors against both pools first.
 *
 * touch(buf, descs, col)  read one byte of every 64-byte line of each row's range of buf, and its last
 *     byte (a range that starts mid-line ends in a line of its own; --cache warm)
 * evict(buf, descs, col)  write back and drop from every CPU cache each 64-byte line of each row's range
 *     (clflush on x86-64, dc civac on aarch64; --cache cold); False on a CPU without such an instruction
 *
 * descs is a C-contiguous int64 buffer of shape (n, 3).  Every range is bounds-checked
 * before any byte moves, so a bad descriptor raises instead of corrupting memory.
 * The GIL is released while bytes move, so other threads (progress, a peer's socket)
 * keep running.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_module.h"
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

static int get_descs(PyObject *obj, Py_buffer *view, Py_ssize_t *n) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 8 || view->len % 24 != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "descs must be a C-contiguous int64 array of shape (n, 3)");
        return -1;
    }
    *n = view->len / 24;
    return 0;
}

static int check(const int64_t *d, Py_ssize_t n, int col, Py_ssize_t limit, const char *what) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t off = d[3 * i + col], len = d[3 * i + 2];
        if (off < 0 || len < 0 || off > (int64_t)limit - len) {
            PyErr_Format(PyExc_ValueError, "descriptor %zd (offset %lld, %lld bytes) outside the %s buffer of %zd bytes",
                         i, (long long)off, (long long)len, what, limit);
            return -1;
        }
    }
    return 0;
}

static PyObject *copy_batch(PyObject *self, PyObject *args) {
    PyObject *dst_o, *src_o, *d_o;
    if (!PyArg_ParseTuple(args, "OOO", &dst_o, &src_o, &d_o)) return NULL;
    Py_buffer dst, src, dv;
    Py_ssize_t n;
    if (PyObject_GetBuffer(dst_o, &dst, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(src_o, &src, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&dst); return NULL; }
    if (get_descs(d_o, &dv, &n) < 0) { PyBuffer_Release(&dst); PyBuffer_Release(&src); return NULL; }
    const int64_t *d = (const int64_t *)dv.buf;
    PyObject *ret = NULL;
    if (check(d, n, 0, src.len, "source") == 0 && check(d, n, 1, dst.len, "destination") == 0) {
        char *db = (char *)dst.buf;
        const char *sb = (const char *)src.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) memcpy(db + d[3 * i + 1], sb + d[3 * i], (size_t)d[3 * i + 2]);
        Py_END_ALLOW_THREADS
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&dv);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return ret;
}

/* readv that busy-polls: never sleep in the kernel, so the CPU stays awake for the next bytes
 * (like a UCX progress loop); yield so other threads on this CPU still run. */
static ssize_t readv_spin(int fd, struct iovec *iov, int cnt) {
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)cnt;
    for (;;) {
        ssize_t r = recvmsg(fd, &m, MSG_DONTWAIT);
        if (r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return r;
        sched_yield();
    }
}

/* A blocking read of the whole iovec in one sleep (MSG_WAITALL): a plain readv returns each time some
 * bytes arrived, one wake-up per socket-buffer's worth of a large layer. */
static ssize_t readv_all(int fd, struct iovec *iov, int cnt) {
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)cnt;
    return recvmsg(fd, &m, MSG_WAITALL);
}

/* Move `head` (writing only; may be empty), then every range, through writev/readv,
 * resuming after partial transfers: one system call per layer when the socket keeps up. */
static int do_vec(int fd, char *base, const int64_t *d, Py_ssize_t n, int col, int writing,
                  const char *head, size_t hlen, int spin) {
    struct iovec iov[IOV_MAX];
    Py_ssize_t next = 0;    /* next descriptor not yet placed in iov */
    size_t skip = 0;        /* bytes of descriptor `next` already moved */
    while (next < n || hlen > 0) {
        int cnt = 0;
        Py_ssize_t j = next;
        size_t first_skip = skip;
        if (hlen > 0) {
            iov[0].iov_base = (void *)head;
            iov[0].iov_len = hlen;
            cnt = 1;
        }
        for (; j < n && cnt < IOV_MAX; j++, cnt++) {
            size_t s = (j == next) ? first_skip : 0;
            iov[cnt].iov_base = base + d[3 * j + col] + s;
            iov[cnt].iov_len = (size_t)d[3 * j + 2] - s;
        }
        ssize_t r = writing ? writev(fd, iov, cnt) : spin ? readv_spin(fd, iov, cnt) : readv_all(fd, iov, cnt);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0 && !writing) { errno = ECONNRESET; return -2; }
        size_t left = (size_t)r;
        if (hlen > 0) {
            size_t h = left < hlen ? left : hlen;
            head += h; hlen -= h; left -= h;
        }
        while (left > 0 && next < n) {
            size_t rem = (size_t)d[3 * next + 2] - skip;
            if (left >= rem) { left -= rem; next++; skip = 0; }
            else { skip += left; left = 0; }
        }
        while (next < n && d[3 * next + 2] == 0) next++;
    }
    return 0;
}

/* Read exactly len bytes (a header). */
static int read_exact(int fd, char *p, size_t len, int spin) {
    while (len > 0) {
        ssize_t r = recv(fd, p, len, spin ? MSG_DONTWAIT : MSG_WAITALL);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (spin && (errno == EAGAIN || errno == EWOULDBLOCK)) { sched_yield(); continue; }
            return -1;
        }
        if (r == 0) { errno = ECONNRESET; return -2; }
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

#define MAX_HEAD 256

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static PyObject *vec(PyObject *args, int writing) {
    int fd, col;
    PyObject *buf_o, *d_o;
    const char *head = NULL;
    Py_ssize_t hlen = 0;
    int spin = 0;
    if (!PyArg_ParseTuple(args, "iOOi|y#p", &fd, &buf_o, &d_o, &col, &head, &hlen, &spin)) return NULL;
    if (hlen > MAX_HEAD) { PyErr_SetString(PyExc_ValueError, "header longer than 256 bytes"); return NULL; }
    if (col != 0 && col != 1) { PyErr_SetString(PyExc_ValueError, "col must be 0 (SRC) or 1 (DST)"); return NULL; }
    Py_buffer buf, dv;
    Py_ssize_t n;
    if (PyObject_GetBuffer(buf_o, &buf, writing ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) return NULL;
    if (get_descs(d_o, &dv, &n) < 0) { PyBuffer_Release(&buf); return NULL; }
    const int64_t *d = (const int64_t *)dv.buf;
    PyObject *ret = NULL;
    if (check(d, n, col, buf.len, writing ? "source" : "destination") == 0) {
        int rc = 0, bad = 0;
        double at = 0.0;
        char got[MAX_HEAD];
        Py_BEGIN_ALLOW_THREADS
        if (writing) {
            rc = do_vec(fd, (char *)buf.buf, d, n, col, 1, head, (size_t)hlen, 0);
        } else {
            if (hlen > 0 && (rc = read_exact(fd, got, (size_t)hlen, spin)) == 0) bad = memcmp(got, head, (size_t)hlen) != 0;
            if (rc == 0 && !bad) rc = do_vec(fd, (char *)buf.buf, d, n, col, 0, NULL, 0, spin);
        }
        at = now();
        Py_END_ALLOW_THREADS
        if (rc == -2) PyErr_SetString(PyExc_ConnectionError, "peer closed the connection mid-transfer");
        else if (rc < 0) PyErr_SetFromErrno(PyExc_OSError);
        else if (bad) ret = PyBytes_FromStringAndSize(got, hlen);
        else ret = PyFloat_FromDouble(at);
    }
    PyBuffer_Release(&dv);
    PyBuffer_Release(&buf);
    return ret;
}

static PyObject *sendv(PyObject *self, PyObject *args) { return vec(args, 1); }
static PyObject *recvv(PyObject *self, PyObject *args) { return vec(args, 0); }

#define SIGNAL_LEN 32
#define READY 4

/* Python's "out of step" and socket errors stay in Python; no Python runs between a signal
 * and its request (a cold interpreter on an idle core costs tens of microseconds per layer). */
static PyObject *relay(PyObject *self, PyObject *args) {
    int ctl, fd, spin;
    PyObject *pending, *wlock;
    if (!PyArg_ParseTuple(args, "iiO!Op", &ctl, &fd, &PyDict_Type, &pending, &wlock, &spin)) return NULL;
    char h[SIGNAL_LEN];
    for (;;) {
        int rc, sp = spin && PyDict_GET_SIZE(pending) > 0;  /* busy-poll only while a read waits */
        Py_BEGIN_ALLOW_THREADS
        rc = read_exact(ctl, h, SIGNAL_LEN, sp);
        Py_END_ALLOW_THREADS
        if (rc == -2) { PyErr_SetString(PyExc_ConnectionError, "peer closed the control connection"); return NULL; }
        if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
        if (memcmp(h, "KVBt", 4) != 0 || h[4] != READY) return PyBytes_FromStringAndSize(h, SIGNAL_LEN);
        unsigned long long tag = 0;
        for (int i = 7; i >= 0; i--) tag = (tag << 8) | (unsigned char)h[8 + i];  /* little-endian */
        PyObject *key = PyLong_FromUnsignedLongLong(tag);
        if (key == NULL) return NULL;
        PyObject *req = PyDict_SetDefault(pending, key, Py_None);  /* borrowed; atomic under the GIL */
        if (req == NULL || req == Py_None || !PyBytes_Check(req)) {  /* error, or early: the post sends it */
            Py_DECREF(key);
            if (req == NULL) return NULL;
            continue;
        }
        Py_INCREF(req);
        rc = PyDict_DelItem(pending, key);
        Py_DECREF(key);
        PyObject *r = rc < 0 ? NULL : PyObject_CallMethod(wlock, "acquire", NULL);
        if (r == NULL) { Py_DECREF(req); return NULL; }
        Py_DECREF(r);
        const char *p = PyBytes_AS_STRING(req);
        size_t len = (size_t)PyBytes_GET_SIZE(req);
        Py_BEGIN_ALLOW_THREADS
        rc = do_vec(fd, NULL, NULL, 0, 0, 1, p, len, 0);  /* the header alone, as sendv writes one */
        Py_END_ALLOW_THREADS
        int err = errno;
        Py_DECREF(req);
        r = PyObject_CallMethod(wlock, "release", NULL);
        if (rc < 0) { Py_XDECREF(r); errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
}

typedef int (*copy_fn)(uint64_t, uint64_t, size_t, void *);

static PyObject *call_copies(PyObject *self, PyObject *args) {
    unsigned long long fn, dst, src, stream;
    PyObject *d_o;
    if (!PyArg_ParseTuple(args, "KKKOK", &fn, &dst, &src, &d_o, &stream)) return NULL;
    Py_buffer dv;
    Py_ssize_t n;
    if (get_descs(d_o, &dv, &n) < 0) return NULL;
    const int64_t *d = (const int64_t *)dv.buf;
    copy_fn f = (copy_fn)(uintptr_t)fn;
    int rc = 0;
    Py_ssize_t i = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < n; i++) {
        rc = f((uint64_t)(dst + (uint64_t)d[3 * i + 1]), (uint64_t)(src + (uint64_t)d[3 * i]), (size_t)d[3 * i + 2],
               (void *)(uintptr_t)stream);
        if (rc != 0) break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dv);
    return Py_BuildValue("(in)", rc, rc != 0 ? i : (Py_ssize_t)-1);
}

#define LINE 64 /* the line size of x86-64 and of the aarch64 server cores; a longer line is visited twice */

/* The rows' ranges of buf, checked against its length; 0 on success. */
static int ranges_of(PyObject *buf_o, PyObject *d_o, Py_buffer *buf, Py_buffer *dv, Py_ssize_t *n, int *col) {
    if (*col != 0 && *col != 1) { PyErr_SetString(PyExc_ValueError, "col must be 0 (SRC) or 1 (DST)"); return -1; }
    if (PyObject_GetBuffer(buf_o, buf, PyBUF_SIMPLE) < 0) return -1;
    if (get_descs(d_o, dv, n) < 0) { PyBuffer_Release(buf); return -1; }
    if (check((const int64_t *)dv->buf, *n, *col, buf->len, "pool") < 0) {
        PyBuffer_Release(dv);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

static int ranges(PyObject *args, Py_buffer *buf, Py_buffer *dv, Py_ssize_t *n, int *col) {
    PyObject *buf_o, *d_o;
    if (!PyArg_ParseTuple(args, "OOi", &buf_o, &d_o, col)) return -1;
    return ranges_of(buf_o, d_o, buf, dv, n, col);
}

/* How many rows' ranges hold a byte other than `byte`, each flagged 1 in `flags` (one byte per row) when given:
 * a scan in place at memory speed (no gathered copy). */
static PyObject *unlike(PyObject *self, PyObject *args) {
    PyObject *buf_o, *d_o, *f_o = NULL;
    Py_buffer buf, dv, fl = {0};
    Py_ssize_t n, bad = 0;
    int col, byte;
    if (!PyArg_ParseTuple(args, "OOii|O", &buf_o, &d_o, &col, &byte, &f_o)) return NULL;
    if (ranges_of(buf_o, d_o, &buf, &dv, &n, &col) < 0) return NULL;
    if (f_o && f_o != Py_None) {
        if (PyObject_GetBuffer(f_o, &fl, PyBUF_WRITABLE) < 0 || fl.len < n) {
            if (fl.obj) PyBuffer_Release(&fl);
            else PyErr_Clear();
            PyBuffer_Release(&dv);
            PyBuffer_Release(&buf);
            PyErr_SetString(PyExc_ValueError, "flags must be a writable buffer of one byte per row");
            return NULL;
        }
    }
    const int64_t *d = (const int64_t *)dv.buf;
    unsigned char *flag = (unsigned char *)fl.buf, ref[4096];
    memset(ref, byte & 0xFF, sizeof ref);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = (const unsigned char *)buf.buf + d[3 * i + col];
        int hit = 0;
        for (int64_t k = 0, len = d[3 * i + 2]; k < len && !hit; k += (int64_t)sizeof ref) {
            size_t m = (size_t)(len - k < (int64_t)sizeof ref ? len - k : (int64_t)sizeof ref);
            hit = memcmp(p + k, ref, m) != 0;
        }
        bad += hit;
        if (flag) flag[i] = (unsigned char)hit;
    }
    Py_END_ALLOW_THREADS
    if (fl.obj) PyBuffer_Release(&fl);
    PyBuffer_Release(&dv);
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(bad);
}

static PyObject *touch(PyObject *self, PyObject *args) {
    Py_buffer buf, dv;
    Py_ssize_t n;
    int col;
    if (ranges(args, &buf, &dv, &n, &col) < 0) return NULL;
    const int64_t *d = (const int64_t *)dv.buf;
    unsigned long long sum = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const volatile unsigned char *p = (const unsigned char *)buf.buf + d[3 * i + col];
        int64_t len = d[3 * i + 2];
        for (int64_t k = 0; k < len; k += LINE) sum += p[k];
        if (len > 0) sum += p[len - 1];
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dv);
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLongLong(sum); /* returned, so the reads cannot be dropped */
}

static PyObject *evict(PyObject *self, PyObject *args) {
    Py_buffer buf, dv;
    Py_ssize_t n;
    int col, done = 0;
    if (ranges(args, &buf, &dv, &n, &col) < 0) return NULL;
#if defined(__x86_64__) || defined(__aarch64__)
    const int64_t *d = (const int64_t *)dv.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *p = (const char *)buf.buf + d[3 * i + col];
        int64_t len = d[3 * i + 2];
        for (int64_t k = 0; k < len; k += LINE) {
#if defined(__x86_64__)
            _mm_clflush(p + k);
#else
            __asm__ volatile("dc civac, %0" : : "r"(p + k) : "memory");
#endif
        }
        if (len > 0) { /* a range that ends mid-line: its last line too */
#if defined(__x86_64__)
            _mm_clflush(p + len - 1);
#else
            __asm__ volatile("dc civac, %0" : : "r"(p + len - 1) : "memory");
#endif
        }
    }
#if defined(__x86_64__)
    _mm_mfence();
#else
    __asm__ volatile("dsb ish" : : : "memory");
#endif
    Py_END_ALLOW_THREADS
    done = 1;
#endif
    PyBuffer_Release(&dv);
    PyBuffer_Release(&buf);
    return PyBool_FromLong(done);
}

KV_MODULE(_native, "Batched copies and vectored socket I/O.",
          KV_METHOD(unlike, "unlike(buf, descs, col, byte[, flags]): how many rows' ranges of buf hold a byte other than byte (flags[i] = 1 for each)."),
          KV_METHOD(touch, "touch(buf, descs, col): read every 64-byte line of each row's range of buf (and its last byte); a sum of the bytes read."),
          KV_METHOD(evict, "evict(buf, descs, col): flush every line of each row's range of buf from the CPU caches; False where this CPU cannot."),
          KV_METHOD(call_copies, "call_copies(fn, dst, src, descs, stream): fn(dst+D, src+S, L, stream) per row; (rc, failing row or -1)."),
          KV_METHOD(copy_batch, "copy_batch(dst, src, descs): memcpy every (SRC, DST, LEN) row."),
          KV_METHOD(sendv, "sendv(fd, buf, descs, col[, head]): writev head, then every row's range of buf (blocking fd); the perf_counter time the last byte left."),
          KV_METHOD(recvv, "recvv(fd, buf, descs, col[, expect[, spin]]): read and compare a header, then readv into every row's range of buf (blocking fd); returns the header read if it differs, else the perf_counter time the last byte landed."),
          KV_METHOD(relay, "relay(ctl, fd, pending, wlock, spin): turn each layer-ready signal read from ctl into the request pending[tag], written on fd under wlock; returns the first header that is not a signal."))
