"""Process-level pieces of a rank, before and around torch: the signal recorder, the heap, the bytecode cache, start-up phases."""
