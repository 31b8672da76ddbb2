"""The functional core: pure records, rewards, advantages, alignment and loss kernels (no I/O)."""
