"""Text in and out of a model: tokenizer, chat template, incremental detokenizer and stop strings."""
