"""``moefit bench``: plan, commit and run a model across a ladder of contexts, and record
planned versus allocated versus measured bytes per budget line, with throughput.

- :mod:`moefit.bench.ladder`: the contexts, one run per context (the record);
- :mod:`moefit.bench.report`: ``bench.json``, the Markdown table, the chart;
- :mod:`moefit.bench.versus`: the same prompt through transformers' ``generate``;
- :mod:`moefit.bench.command`: the command line.
"""
