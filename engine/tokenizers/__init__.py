"""Tokenizers: tiktoken BPE (Llama 3.x, 4) and sentencepiece (Llama 2) in tokenizer.py, a checkpoint's
own tokenizer.json in hf.py, over the shared bases in base.py. Chat formats (engine/chat/) build on them.
"""
