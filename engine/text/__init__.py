"""Text processing without torch: tokenizer loading, chat templates, incremental detokenization."""
