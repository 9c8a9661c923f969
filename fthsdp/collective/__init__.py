"""Collectives: FTAR's Python face, the native library loader and the small FFI op wrappers."""
