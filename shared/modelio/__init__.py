"""A model's weights in and out of files other than the loop's own checkpoints: `hf` (Hugging Face
config.json, safetensors and tokenizer files, both ways, for a folder's hf.py) and `trained` (the weights
of a run directory, a checkpoint or hf:DIR, read onto a folder's mesh, for the commands that decode and
evaluate). AGENTS.md's map says what each module does."""
