"""measure: `python -m ref_impl bench`. One module per suite (decode, quant, kernels, latency, kv, spec, loads,
unified, link, pipeline), the table that maps the CLI's flags to them (suites), the peers run beside ours (peers), and the one
results-record builder, reader and selector (records)."""
