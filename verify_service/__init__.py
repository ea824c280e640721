"""specdec verify service: the target model, one KV cache per session, the acceptance rule."""
