/* The mpi transport's per-request MPI calls, made from C: one Python call per request, not per layer.
 *
 * The functions are the MPI library's own, found by address in the library mpi4py loaded
 * (transports/mpi_native.py), and called with mpi4py's handles, so nothing here is compiled against an
 * MPI header: `hsize` is the size of an MPI handle in that library (MPI._sizeof(MPI.Win)): 4 where
 * handles are integers (MPICH, Intel MPI, MVAPICH, Cray MPICH), 8 where they are pointers (Open MPI,
 * the MPI ABI).  Handles arrive as Python ints (mpi4py sign-extends integer handles; the low 32 bits
 * are the handle).
 *
 * rma(fn, hsize, base, descs, ocol, tcol, peer, byte, win)
 *     fn(base + row[ocol], row[LEN], byte, peer, row[tcol], row[LEN], byte, win) for every row:
 *     MPI_Put and MPI_Get share that signature.  Returns (rc, failing row or -1).
 * flush_send(flush, send, hsize, win, peer, buf, count, dtype, tag, comm)
 *     MPI_Win_flush(peer, win), then (send != 0) MPI_Send(buf, count, dtype, peer, tag, comm).
 *     Returns rc.
 * recv_sync(recv, get_count, sync, hsize, buf, count, dtype, peer, tag, comm, win)
 *     MPI_Recv(buf, count, dtype, peer, tag, comm, &status), MPI_Get_count(&status, dtype, &n),
 *     then MPI_Win_sync(win).  Returns (rc, n).
 * comm_rank(fn, hsize, comm)  MPI_Comm_rank: (rc, rank), to check the functions match mpi4py's handles.
 *
 * Row lengths must fit an int (the caller keeps longer rows on mpi4py); addresses are not checked here
 * (the caller checked every descriptor against both pools).  The GIL is released while MPI runs: a
 * blocking flush or receive must not stop the harness's watchdog, as with mpi4py's own calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_module.h"
#include <stdint.h>

typedef int (*rma4_fn)(const void *, int, int, int, intptr_t, int, int, int);
typedef int (*rma8_fn)(const void *, int, void *, int, intptr_t, int, void *, void *);
typedef int (*flush4_fn)(int, int);
typedef int (*flush8_fn)(int, void *);
typedef int (*send4_fn)(const void *, int, int, int, int, int);
typedef int (*send8_fn)(const void *, int, void *, int, int, void *);
typedef int (*recv4_fn)(void *, int, int, int, int, int, void *);
typedef int (*recv8_fn)(void *, int, void *, int, int, void *, void *);
typedef int (*count4_fn)(const void *, int, int *);
typedef int (*count8_fn)(const void *, void *, int *);
typedef int (*sync4_fn)(int);
typedef int (*sync8_fn)(void *);
typedef int (*rank4_fn)(int, int *);
typedef int (*rank8_fn)(void *, int *);

#define H4(h) ((int)(uint32_t)(h))
#define H8(h) ((void *)(uintptr_t)(h))
#define FN(h) ((uintptr_t)(h))

static int check_hsize(int hsize) {
    if (hsize == 4 || hsize == 8) return 0;
    PyErr_Format(PyExc_ValueError, "an MPI handle of %d bytes (4 or 8 expected)", hsize);
    return -1;
}

static PyObject *rma(PyObject *self, PyObject *args) {
    unsigned long long fn, base, byte, win;
    int hsize, ocol, tcol, peer;
    Py_buffer dv;
    if (!PyArg_ParseTuple(args, "KiKy*iiiKK", &fn, &hsize, &base, &dv, &ocol, &tcol, &peer, &byte, &win)) return NULL;
    if (check_hsize(hsize) < 0 || ocol < 0 || ocol > 1 || tcol < 0 || tcol > 1 || dv.len % 24) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "rma: descs must be int64 rows (S, D, L); columns 0 or 1");
        PyBuffer_Release(&dv);
        return NULL;
    }
    const int64_t *d = (const int64_t *)dv.buf;
    Py_ssize_t n = dv.len / 24, i = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (d[3 * k + 2] < 0 || d[3 * k + 2] > INT32_MAX) {
            PyBuffer_Release(&dv);
            PyErr_Format(PyExc_ValueError, "rma: row %zd moves %lld bytes (at most 2^31-1 per call)", k, (long long)d[3 * k + 2]);
            return NULL;
        }
    }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < n; i++) {
        const int64_t *r = d + 3 * i;
        const void *at = (const void *)(uintptr_t)(base + (uint64_t)r[ocol]);
        int len = (int)r[2];
        rc = hsize == 4 ? ((rma4_fn)FN(fn))(at, len, H4(byte), peer, (intptr_t)r[tcol], len, H4(byte), H4(win))
                        : ((rma8_fn)FN(fn))(at, len, H8(byte), peer, (intptr_t)r[tcol], len, H8(byte), H8(win));
        if (rc != 0) break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dv);
    return Py_BuildValue("(in)", rc, rc != 0 ? i : (Py_ssize_t)-1);
}

static PyObject *flush_send(PyObject *self, PyObject *args) {
    unsigned long long flush, send, win, buf, dtype, comm;
    int hsize, peer, count, tag;
    if (!PyArg_ParseTuple(args, "KKiKiKiKiK", &flush, &send, &hsize, &win, &peer, &buf, &count, &dtype, &tag, &comm))
        return NULL;
    if (check_hsize(hsize) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hsize == 4 ? ((flush4_fn)FN(flush))(peer, H4(win)) : ((flush8_fn)FN(flush))(peer, H8(win));
    if (rc == 0 && send)
        rc = hsize == 4 ? ((send4_fn)FN(send))((const void *)(uintptr_t)buf, count, H4(dtype), peer, tag, H4(comm))
                        : ((send8_fn)FN(send))((const void *)(uintptr_t)buf, count, H8(dtype), peer, tag, H8(comm));
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *recv_sync(PyObject *self, PyObject *args) {
    unsigned long long recv, get_count, sync, buf, dtype, comm, win;
    int hsize, count, peer, tag;
    if (!PyArg_ParseTuple(args, "KKKiKiKiiKK", &recv, &get_count, &sync, &hsize, &buf, &count, &dtype, &peer, &tag,
                          &comm, &win))
        return NULL;
    if (check_hsize(hsize) < 0) return NULL;
    /* larger than any library's MPI_Status (MPICH 20 bytes, Open MPI 24, the MPI ABI 32) */
    _Alignas(16) unsigned char status[256] = {0};
    int rc, n = 0;
    Py_BEGIN_ALLOW_THREADS
    if (hsize == 4) {
        rc = ((recv4_fn)FN(recv))((void *)(uintptr_t)buf, count, H4(dtype), peer, tag, H4(comm), status);
        if (rc == 0) rc = ((count4_fn)FN(get_count))(status, H4(dtype), &n);
        if (rc == 0) rc = ((sync4_fn)FN(sync))(H4(win));
    } else {
        rc = ((recv8_fn)FN(recv))((void *)(uintptr_t)buf, count, H8(dtype), peer, tag, H8(comm), status);
        if (rc == 0) rc = ((count8_fn)FN(get_count))(status, H8(dtype), &n);
        if (rc == 0) rc = ((sync8_fn)FN(sync))(H8(win));
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ii)", rc, n);
}

static PyObject *comm_rank(PyObject *self, PyObject *args) {
    unsigned long long fn, comm;
    int hsize, rank = -1;
    if (!PyArg_ParseTuple(args, "KiK", &fn, &hsize, &comm)) return NULL;
    if (check_hsize(hsize) < 0) return NULL;
    int rc = hsize == 4 ? ((rank4_fn)FN(fn))(H4(comm), &rank) : ((rank8_fn)FN(fn))(H8(comm), &rank);
    return Py_BuildValue("(ii)", rc, rank);
}

KV_MODULE(_mpicalls, "The mpi transport's MPI calls by address.",
          KV_METHOD(rma, "rma(fn, hsize, base, descs, ocol, tcol, peer, byte, win): MPI_Put/MPI_Get per row; (rc, failing row or -1)."),
          KV_METHOD(flush_send, "flush_send(flush, send, hsize, win, peer, buf, count, dtype, tag, comm): MPI_Win_flush, then MPI_Send unless send is 0; rc."),
          KV_METHOD(recv_sync, "recv_sync(recv, get_count, sync, hsize, buf, count, dtype, peer, tag, comm, win): MPI_Recv, MPI_Get_count, MPI_Win_sync; (rc, count)."),
          KV_METHOD(comm_rank, "comm_rank(fn, hsize, comm): MPI_Comm_rank; (rc, rank)."))
