"""specdec draft service: client-facing Generate, the draft model and the decode loop."""
