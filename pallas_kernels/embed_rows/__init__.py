"""Row gather of a byte table (the token embedding's GGUF blocks) read from the file, not the mapping."""
