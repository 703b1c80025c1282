"""Native CPU kernels (C++ built with torch's extension builder): paged attention and
matmuls straight from GGUF-quantised weights."""
