"""Tools on top of the library: the demo, the op benchmarks, the tiny HF models the tests and examples use."""
