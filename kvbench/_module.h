/* The module boilerplate of kvbench's C extensions: every function takes METH_VARARGS.
 *
 * KV_MODULE(_name, "module doc", KV_METHOD(fn, "fn's doc"), ...) defines the method table, the module
 * and PyInit__name.
 */
#ifndef KVBENCH_MODULE_H
#define KVBENCH_MODULE_H

#define KV_METHOD(fn, doc) {#fn, fn, METH_VARARGS, doc}

#define KV_MODULE(name, doc, ...)                                                                        \
    static PyMethodDef kv_methods[] = {__VA_ARGS__, {NULL, NULL, 0, NULL}};                              \
    static struct PyModuleDef kv_moddef = {PyModuleDef_HEAD_INIT, #name, doc, -1, kv_methods};           \
    PyMODINIT_FUNC PyInit_##name(void) { return PyModule_Create(&kv_moddef); }

#endif
