"""Chat: messages -> prompt tokens, and generated text -> content and tool calls.

format.py is the entry point for the built-in Llama formats (one module per family: llama2.py,
llama3.py, llama4.py, sharing common.py); jinja.py renders an HF checkpoint's chat template;
tool_parser.py turns generated text back into content and tool calls; hf_tokenizer.py loads an
HF checkpoint's tokenizer.json.
"""
