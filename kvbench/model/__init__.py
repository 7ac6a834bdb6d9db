"""The KV cache as pure data: model shapes and bytes arithmetic (shapes), storage formats and their scale
planes (formats, planes), where a block sits and who owns it (layout), descriptor arrays (descriptors: the
``SRC, DST, LEN`` columns live here), who pairs with whom (schemes), arrivals and prompts (workload), and the
value types shared by suites and plans (inputs).

No I/O but YAML loading (yamlfile), no MPI, no transport: everything here is a function of its arguments.
"""
