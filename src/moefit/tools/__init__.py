"""Tools that write model files (the tests, the benchmarks and ``moefit make-demo`` use them)."""
