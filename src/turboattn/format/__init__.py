"""What is stored: codebooks, rotation, the codec and the key transform (no kernels, no cache object)."""
