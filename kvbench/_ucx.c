/* The ucx transport's one-sided calls into libucp (transports/ucx_rma.py): registration, packed rkeys, and a
 * whole post's ucp_put_nbx / ucp_get_nbx per descriptor followed by one ucp_ep_flush_nbx, in ONE call.
 *
 * ucxx's Python API has no memory handle, rkey or put/get, so this module takes ucxx's own handles (context,
 * worker, endpoint: the ``handle`` of its objects, plain pointers) and calls the libucp that ucxx loaded (the
 * libucx wheel's; setup.py links against it and builds this module only where its headers are installed).
 *
 * mem_map(context, addr, length) -> memh          ucp_mem_map of existing memory (no allocation)
 * mem_unmap(context, memh)
 * rkey_pack(context, memh) -> bytes               ucp_rkey_pack, for the peers
 * rkey_unpack(ep, packed) -> rkey                 ucp_ep_rkey_unpack
 * rkey_destroy(rkey)
 * rma(get, ep, local, memh, remote, rkey, descs, lcol, rcol) -> request or 0
 *     for every int64 row (SRC, DST, LEN): put local+row[lcol] -> remote+row[rcol] (get: the other way), then
 *     ucp_ep_flush_nbx: 0 when everything completed at once, else the flush request for ``test``.  The put/get
 *     requests are freed as posted (UCX frees them when they complete): the flush completes after all of them.
 * test(worker, request, spin_s) -> bool           progress until the request completes (True; it is freed) or
 *     spin_s passed (False); raises on a failed request.  The GIL is released while it spins.
 * cancel(worker, request)                         cancel and free a request still in flight (close)
 * counts() -> (put bytes, get bytes, posts)       what this process handed to ucp_put_nbx / ucp_get_nbx
 *
 * Addresses are not checked here (the caller checked every descriptor against both pools).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_module.h"
#include <stdint.h>
#include <time.h>
#include <ucp/api/ucp.h>

#define PTR(x) ((void *)(uintptr_t)(x))

static unsigned long long put_bytes, get_bytes, posts;

static PyObject *fail(const char *what, ucs_status_t st) {
    PyErr_Format(PyExc_RuntimeError, "%s: %s", what, ucs_status_string(st));
    return NULL;
}

static PyObject *mem_map(PyObject *self, PyObject *args) {
    unsigned long long ctx, addr, length;
    if (!PyArg_ParseTuple(args, "KKK", &ctx, &addr, &length)) return NULL;
    ucp_mem_map_params_t p = {0};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = PTR(addr);
    p.length = length;
    ucp_mem_h memh;
    ucs_status_t st = ucp_mem_map((ucp_context_h)PTR(ctx), &p, &memh);
    if (st != UCS_OK) return fail("ucp_mem_map", st);
    return PyLong_FromVoidPtr(memh);
}

static PyObject *mem_unmap(PyObject *self, PyObject *args) {
    unsigned long long ctx, memh;
    if (!PyArg_ParseTuple(args, "KK", &ctx, &memh)) return NULL;
    ucs_status_t st = ucp_mem_unmap((ucp_context_h)PTR(ctx), (ucp_mem_h)PTR(memh));
    if (st != UCS_OK) return fail("ucp_mem_unmap", st);
    Py_RETURN_NONE;
}

static PyObject *rkey_pack(PyObject *self, PyObject *args) {
    unsigned long long ctx, memh;
    if (!PyArg_ParseTuple(args, "KK", &ctx, &memh)) return NULL;
    void *buf;
    size_t size;
    ucs_status_t st = ucp_rkey_pack((ucp_context_h)PTR(ctx), (ucp_mem_h)PTR(memh), &buf, &size);
    if (st != UCS_OK) return fail("ucp_rkey_pack", st);
    PyObject *out = PyBytes_FromStringAndSize(buf, (Py_ssize_t)size);
    ucp_rkey_buffer_release(buf);
    return out;
}

static PyObject *rkey_unpack(PyObject *self, PyObject *args) {
    unsigned long long ep;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Ky*", &ep, &b)) return NULL;
    ucp_rkey_h rkey;
    ucs_status_t st = ucp_ep_rkey_unpack((ucp_ep_h)PTR(ep), b.buf, &rkey);
    PyBuffer_Release(&b);
    if (st != UCS_OK) return fail("ucp_ep_rkey_unpack", st);
    return PyLong_FromVoidPtr(rkey);
}

static PyObject *rkey_destroy(PyObject *self, PyObject *args) {
    unsigned long long rkey;
    if (!PyArg_ParseTuple(args, "K", &rkey)) return NULL;
    ucp_rkey_destroy((ucp_rkey_h)PTR(rkey));
    Py_RETURN_NONE;
}

static PyObject *rma(PyObject *self, PyObject *args) {
    int get, lcol, rcol;
    unsigned long long ep, local, memh, remote, rkey;
    Py_buffer dv;
    if (!PyArg_ParseTuple(args, "pKKKKKy*ii", &get, &ep, &local, &memh, &remote, &rkey, &dv, &lcol, &rcol))
        return NULL;
    if (dv.len % 24 || lcol < 0 || lcol > 1 || rcol < 0 || rcol > 1) {
        PyBuffer_Release(&dv);
        PyErr_SetString(PyExc_ValueError, "rma: descs must be int64 rows (S, D, L); columns 0 or 1");
        return NULL;
    }
    const int64_t *d = (const int64_t *)dv.buf;
    Py_ssize_t n = dv.len / 24, i = 0;
    ucp_request_param_t p = {0};
    p.op_attr_mask = memh ? UCP_OP_ATTR_FIELD_MEMH : 0;  // the pool's own registration: no cache lookup per row
    p.memh = (ucp_mem_h)PTR(memh);
    ucs_status_ptr_t r = NULL;
    unsigned long long moved = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < n; i++) {
        const int64_t *row = d + 3 * i;
        char *at = (char *)PTR(local + (uint64_t)row[lcol]);
        uint64_t there = remote + (uint64_t)row[rcol];
        r = get ? ucp_get_nbx((ucp_ep_h)PTR(ep), at, (size_t)row[2], there, (ucp_rkey_h)PTR(rkey), &p)
                : ucp_put_nbx((ucp_ep_h)PTR(ep), at, (size_t)row[2], there, (ucp_rkey_h)PTR(rkey), &p);
        if (UCS_PTR_IS_ERR(r)) break;
        if (r != NULL) ucp_request_free(r);
        moved += (unsigned long long)row[2];
    }
    if (!UCS_PTR_IS_ERR(r)) {
        ucp_request_param_t f = {0};
        r = ucp_ep_flush_nbx((ucp_ep_h)PTR(ep), &f);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dv);
    *(get ? &get_bytes : &put_bytes) += moved;
    posts++;
    if (UCS_PTR_IS_ERR(r)) {
        PyErr_Format(PyExc_RuntimeError, "%s of row %zd of %zd: %s", i < n ? (get ? "ucp_get_nbx" : "ucp_put_nbx")
                     : "ucp_ep_flush_nbx", i < n ? i : n, n, ucs_status_string(UCS_PTR_STATUS(r)));
        return NULL;
    }
    return PyLong_FromVoidPtr(r);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static PyObject *test(PyObject *self, PyObject *args) {
    unsigned long long worker, req;
    double spin_s;
    if (!PyArg_ParseTuple(args, "KKd", &worker, &req, &spin_s)) return NULL;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    double until = now_s() + spin_s;
    unsigned k = 0;
    while ((st = ucp_request_check_status(PTR(req))) == UCS_INPROGRESS) {
        ucp_worker_progress((ucp_worker_h)PTR(worker));
        if ((++k & 63) == 0 && now_s() >= until) break;  // the clock read every 64 progress calls: it costs more
    }
    Py_END_ALLOW_THREADS
    if (st == UCS_INPROGRESS) Py_RETURN_FALSE;
    ucp_request_free(PTR(req));
    if (st != UCS_OK) return fail("ucp_ep_flush_nbx completed", st);
    Py_RETURN_TRUE;
}

static PyObject *cancel(PyObject *self, PyObject *args) {
    unsigned long long worker, req;
    if (!PyArg_ParseTuple(args, "KK", &worker, &req)) return NULL;
    if (ucp_request_check_status(PTR(req)) == UCS_INPROGRESS) ucp_request_cancel((ucp_worker_h)PTR(worker), PTR(req));
    ucp_request_free(PTR(req));
    Py_RETURN_NONE;
}

static PyObject *counts(PyObject *self, PyObject *args) {
    return Py_BuildValue("KKK", put_bytes, get_bytes, posts);
}

KV_MODULE(_ucx, "One-sided UCX (ucp_mem_map, rkeys, put/get per descriptor + flush) on ucxx's handles.",
          KV_METHOD(mem_map, "mem_map(context, addr, length) -> memh"),
          KV_METHOD(mem_unmap, "mem_unmap(context, memh)"),
          KV_METHOD(rkey_pack, "rkey_pack(context, memh) -> bytes"),
          KV_METHOD(rkey_unpack, "rkey_unpack(ep, packed) -> rkey"),
          KV_METHOD(rkey_destroy, "rkey_destroy(rkey)"),
          KV_METHOD(rma, "rma(get, ep, local, memh, remote, rkey, descs, lcol, rcol) -> flush request or 0"),
          KV_METHOD(test, "test(worker, request, spin_s) -> True once complete (freed)"),
          KV_METHOD(cancel, "cancel(worker, request)"),
          KV_METHOD(counts, "counts() -> (put bytes, get bytes, posts)"))
