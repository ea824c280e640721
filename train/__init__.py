"""Training tools for specdec: corpus, tokenizer, target pre-training, draft distillation, evaluation."""
