"""One module per Llama family's chat format; engine/chat_format.py is the entry point."""
