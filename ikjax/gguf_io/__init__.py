"""GGUF in and out: the header reader, the model config, the MLA tensor layouts, the writer."""
