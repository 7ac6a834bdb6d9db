"""The KV cache as pure data: model shapes and bytes arithmetic (shapes), the kinds of layer a hybrid model mixes
(layers: full, sliding-window, linear state) and element types (dtypes), storage formats and their scale
planes (formats, planes), where a block sits and who owns it (layout), descriptor arrays (descriptors: the
``SRC, DST, LEN`` columns live here), who pairs with whom (schemes), arrivals and prompts (workload), request
traces and their prefix-cache hits (trace; the shipped traces in traces/), a trace replayed as a workload
(traceplan), the value types shared by suites and plans (inputs), and the limits a user's input is held to
before it is parsed, with how a message quotes a value (limits).

No I/O but YAML loading (yamlfile) and reading trace files (trace), no MPI, no transport: everything here is
a function of its arguments.
"""
